"""gRPC client for the served models (tensorrtllm_backend's client contract), used by the CLI, validation and load.

Every call opens its own gRPC stream (decoupled models only answer on streams) or, with
`unary=True`, one ModelInfer call (models served with `triton.decoupled: false`), so calls are safe
from many threads at once as long as each thread uses its own client (the default: one per call).
`generate` returns the text, the perf outputs, the latency and the time to first token. Every wait is
bounded (`timeout`: RequestTimeout when no final response came in time). To stop a
request: cancel its stream (`cancel=`), let its deadline pass, or close the connection; both models
stop decoding it at their next step. `stop(url, model, request_id)` does the same by request id
(tensorrtllm_backend's `stop` input), for clients that cannot cancel their own call.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable

import numpy as np

from pipeline import door

BOOL_INPUTS = ("stream", "exclude_input_in_output", "return_perf_metrics", "use_draft_logits")
PERF_OUTPUTS = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "num_input_tokens",
                "num_output_tokens", "kv_cache_reused_blocks", "kv_cache_alloc_new_blocks",
                "kv_cache_alloc_total_blocks", "num_cached_tokens")


class RequestError(RuntimeError):
    """The server rejected or failed a request; the message is the server's."""


class RequestTimeout(RequestError):
    """No final response within the client's timeout (a slow server, or a response that never came)."""


def _tensor(name: str, value, dtype) -> object:
    import tritonclient.grpc as grpcclient  # heavy (grpc): only a call that sends pays it
    from tritonclient.utils import np_to_triton_dtype  # with tritonclient.grpc above

    arr = np.asarray(value, dtype=dtype)
    if arr.ndim == 0:
        arr = arr.reshape(1, 1)
    elif arr.ndim == 1:
        arr = arr.reshape(1, -1)
    t = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype) if dtype is not object else "BYTES")
    t.set_data_from_numpy(arr)
    return t


def make_inputs(prompt: str | bytes, max_tokens: int, method: str | None = None, stream: bool = False,
                temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                seed: int | None = None, end_id: int | None = None, stop_words: list[str] | None = None,
                num_draft_tokens: int | None = None, use_draft_logits: bool | None = None,
                return_perf_metrics: bool = True, exclude_input_in_output: bool | None = None,
                disable_at_batch: int | None = None, cache_prompt: bool | None = None,
                return_kv_cache_reuse_stats: bool | None = None, prediction: str | None = None) -> list:
    """InferInputs for one request (batch 1), with only the optional inputs that were given."""
    text = prompt if isinstance(prompt, bytes) else prompt.encode("utf-8")
    ins = [_tensor("text_input", [[text]], object), _tensor("max_tokens", [[max_tokens]], np.int32),
           _tensor("stream", [[stream]], bool), _tensor("return_perf_metrics", [[return_perf_metrics]], bool)]
    opt = {"temperature": (temperature, np.float32), "top_k": (top_k, np.int32), "top_p": (top_p, np.float32),
           "seed": (seed, np.uint64), "end_id": (end_id, np.int32), "num_draft_tokens": (num_draft_tokens, np.int32),
           "use_draft_logits": (use_draft_logits, bool), "exclude_input_in_output": (exclude_input_in_output, bool),
           "disable_at_batch": (disable_at_batch, np.int32), "cache_prompt": (cache_prompt, bool),
           "return_kv_cache_reuse_stats": (return_kv_cache_reuse_stats, bool)}
    for name, (value, dt) in opt.items():
        if value is not None:
            ins.append(_tensor(name, [[value]], dt))
    if method:
        ins.append(_tensor("method", [[method.encode()]], object))
    if prediction is not None:  # Predicted Outputs: the text the answer likely repeats
        ins.append(_tensor("prediction", [[prediction.encode("utf-8")]], object))
    if stop_words:
        ins.append(_tensor("stop_words", [[w.encode() for w in stop_words]], object))
    return ins


def infer_request(model: str, inputs: list, request_id: str = "", stream: bool = True) -> object:
    """The ModelInferRequest protobuf for `inputs` (from make_inputs), as both clients send it: the sync client on its
    stream (infer_stream) and the front's shared grpc.aio channel (pipeline/triton/grpc_channel.py). A streamed
    request asks for the empty final response (`triton_enable_empty_final_response`) that marks its end."""
    from tritonclient.grpc._utils import _get_inference_request  # what tritonclient's own infer calls build it with

    req = _get_inference_request(model_name=model, inputs=inputs, model_version="", request_id=request_id,
                                 outputs=None, sequence_id=0, sequence_start=False, sequence_end=False, priority=0,
                                 timeout=None, parameters=None)
    if stream:
        req.parameters["triton_enable_empty_final_response"].bool_param = True
    return req


def is_final(response) -> bool:
    """Is this ModelInferResponse the request's last (the stream's `triton_final_response` flag)?"""
    final = response.parameters.get("triton_final_response")
    return bool(final and final.bool_param)


def _first(result, name: str):
    arr = result.as_numpy(name)
    return None if arr is None else arr.reshape(-1)[0]


def infer_stream(url: str, model: str, inputs: list, timeout: float = 300.0,
                 on_response: Callable[[object], bool] | None = None, cancel: Callable[[], bool] | None = None,
                 client=None, request_id: str = "", disconnect: bool = False,
                 stream_timeout: float | None = None) -> tuple[list, bool]:
    """Send one request on a gRPC stream and collect its responses until the final flag.

    Returns (responses, complete). `on_response` sees each result; `cancel()` (polled after each response
    and every 200 ms) returning True cancels the request: the stream is closed with cancel_requests=True, or with
    `disconnect` the connection is dropped without a word (as a client that dies would).
    `stream_timeout` is the stream's gRPC deadline (the server sees it expire as a cancellation).
    """
    import tritonclient.grpc as grpcclient  # heavy (grpc): only a call that sends pays it
    from tritonclient.utils import InferenceServerException  # with tritonclient.grpc above

    c = client or grpcclient.InferenceServerClient(url)
    q: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: q.put((result, error)), stream_timeout=stream_timeout,
                   headers=door.grpc_headers())
    responses, complete, cancelled, answered = [], False, False, False
    deadline = time.monotonic() + timeout
    try:
        try:
            c._stream._enqueue_request(infer_request(model, inputs, request_id))  # async_stream_infer's own step
        except InferenceServerException as e:  # the stream is already gone, e.g. its deadline passed before sending
            answered = True  # nothing was sent, so there is nothing to cancel
            if stream_timeout is not None:
                raise RequestTimeout(f"the stream's deadline (stream_timeout {stream_timeout:g} s) passed before the "
                                     f"request to {model} was sent: {e.message()}") from None
            raise RequestError(f"the request to {model} could not be sent on the stream: {e.message()}") from None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestTimeout(f"no final response from {model} within {timeout:.0f}s")
            try:  # a waiting client wakes rarely: 128 clients polling every 50 ms took CPU from the server
                result, error = q.get(timeout=min(left, 0.2 if cancel else 1.0))
            except queue.Empty:
                if cancel and cancel():
                    cancelled = True
                    break
                continue
            if error is not None:
                answered = True  # the server's error ends the request
                raise RequestError(error.message() if isinstance(error, InferenceServerException) else str(error))
            resp = result.get_response()
            if resp.outputs:
                responses.append(result)
                if on_response:
                    on_response(result)
            if is_final(resp):
                complete = True
                break
            if cancel and cancel():
                cancelled = True
                break
    finally:
        if cancelled and disconnect:
            c._channel.close()  # no cancel, no goodbye: the server only sees the connection go
        else:
            try:
                # Without a final response or an error from the server (cancelled, timed out), cancel:
                # stop_stream(cancel_requests=False) waits for the server to end the stream, which a lost response
                # would make wait forever.
                c.stop_stream(cancel_requests=not (complete or answered))
            finally:
                if client is None:
                    c.close()
    return responses, complete


def infer_unary(url: str, model: str, inputs: list, timeout: float = 300.0, request_id: str = "") -> object:
    """One ModelInfer call (models served with `triton.decoupled: false`); the result, or RequestError."""
    import tritonclient.grpc as grpcclient  # heavy (grpc): only a call that sends pays it
    from tritonclient.utils import InferenceServerException  # with tritonclient.grpc above

    with grpcclient.InferenceServerClient(url) as c:
        try:
            return c.infer(model, inputs, request_id=request_id, client_timeout=timeout, headers=door.grpc_headers())
        except InferenceServerException as e:
            if str(e.status() or "").endswith("DEADLINE_EXCEEDED"):
                raise RequestTimeout(f"no response from {model} within {timeout:.0f}s") from None
            raise RequestError(e.message()) from None


def stop(url: str, model: str, request_id: str, unary: bool = False) -> None:
    """Stop the running request `request_id` on `model` (tensorrtllm_backend's `stop` input)."""
    ins = [_tensor("stop", [[True]], bool)]
    if unary:
        infer_unary(url, model, ins, request_id=request_id)
    else:
        infer_stream(url, model, ins, timeout=60, request_id=request_id)


class Reading:
    """What `generate` makes of a request's results, for both clients (this one and the front's grpc.aio channel):
    the text pieces as they come (to `on_piece`), the time to the first, and the perf outputs of the last."""

    def __init__(self, method: str | None, on_piece: Callable[[str], None] | None = None):
        self.method, self.on_piece = method, on_piece
        self.t0 = time.perf_counter()
        self.pieces: list[str] = []
        self.first: list[float] = []

    def seen(self, result) -> None:
        """One result (a tritonclient InferResult) with outputs."""
        arr = result.as_numpy("text_output")
        if arr is None:
            return
        piece = b"".join(v for v in arr.reshape(-1)).decode("utf-8", errors="replace")
        if piece and not self.first:
            self.first.append(time.perf_counter() - self.t0)
        self.pieces.append(piece)
        if self.on_piece and piece:
            self.on_piece(piece)

    def outcome(self, responses: list, complete: bool) -> dict:
        """generate's answer: text, pieces, perf outputs, latency_s, ttft_s."""
        latency = time.perf_counter() - self.t0
        out = {"text": "".join(self.pieces), "pieces": self.pieces, "complete": complete,
               "responses": len(responses), "latency_s": latency,
               "ttft_s": self.first[0] if self.first else latency, "method": self.method}
        if responses:
            last = responses[-1]
            for name in PERF_OUTPUTS:
                v = _first(last, name)
                if v is not None:
                    out[name] = float(v) if name == "acceptance_rate" else int(v)
        n = out.get("num_output_tokens")
        if n is not None:
            out["tokens_per_s"] = n / latency if latency > 0 else 0.0
        return out


def generate(url: str, model: str, prompt: str | bytes, max_tokens: int, method: str | None = None,
             stream: bool = False, timeout: float = 300.0, on_piece: Callable[[str], None] | None = None,
             client=None, unary: bool = False, request_id: str = "", cancel: Callable[[], bool] | None = None,
             disconnect: bool = False, **opts) -> dict:
    """One request; returns text, pieces, perf outputs, latency_s, ttft_s. Raises RequestError on an error.

    `unary` sends one ModelInfer call (a model served with `triton.decoupled: false`); otherwise a gRPC stream,
    which `cancel()` returning True cancels (or, with `disconnect`, abandons)."""
    reading = Reading(method, on_piece)
    inputs = make_inputs(prompt, max_tokens, method=method, stream=stream, **opts)
    if unary:
        result = infer_unary(url, model, inputs, timeout, request_id=request_id)
        reading.seen(result)
        responses, complete = [result], True
    else:
        responses, complete = infer_stream(url, model, inputs, timeout, on_response=reading.seen, client=client,
                                           request_id=request_id, cancel=cancel, disconnect=disconnect)
    return reading.outcome(responses, complete)


def chat_text(tokenizer, prompt: str) -> str:
    """The prompt formatted with the tokenizer's chat template (client-side; the server applies none)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
    return prompt


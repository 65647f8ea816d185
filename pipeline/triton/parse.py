"""Request parsing for the served model: Triton inputs -> runtime Requests, or a BadRequest naming the input.

No Triton import: `RequestParser.parse(get, request_id)` reads inputs through `get(name) -> numpy array
| None`, so tests call it with a dict. The rules (docs/serving.md, "What the server guarantees"):

- every input tensorrtllm_backend's ensemble declares is either honoured or refused with an error
  naming the input, the value and what to send instead (`NVIDIA_INPUTS`);
- sampling values that cannot give a proper distribution are defined or refused, never left to
  overflow: a temperature below `MIN_TEMPERATURE` decodes greedily (logits / 1e-38 overflow to inf,
  and softmax of inf is NaN), a `top_p` below `MIN_TOP_P` keeps the single most likely token (top_k
  1), a `top_k` at or above the vocabulary means no top-k, a huge temperature is the uniform
  distribution it tends to; NaN or infinite values are refused;
- a `stop` request (tensorrtllm_backend's way to cancel on models that do not see the client's gRPC
  cancel) names the request to stop by its request id and needs no other input.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pipeline.runtime.generate import Request
from pipeline.runtime.sampling import SamplingParams
from pipeline.runtime.specconfig import SpecDecodeConfig, SpeculationError

MIN_TEMPERATURE = 1e-3  # below it (and above 0) sampling is greedy: exp(logit gap / 1e-3) is a one-hot anyway
MIN_TOP_P = 1e-6  # below it top_p keeps one token: the most likely one (top_k 1)
MAX_STOP_WORDS = 64

Getter = Callable[[str], "np.ndarray | None"]


class BadRequest(ValueError):
    """A request the model cannot run; the message names the input, the value and what is allowed."""


@dataclass
class Parsed:
    """One Triton request, parsed: its rows (runtime Requests) and how to answer it."""

    request_id: str
    texts: list[str] = field(default_factory=list)
    reqs: list = field(default_factory=list)
    method: str = "baseline"
    k: int = 0
    use_draft_logits: bool = True
    disable_at_batch: int | None = None  # None: the model's configured value
    stream: bool = False
    exclude_input: bool = True
    perf: bool = False
    stop: bool = False  # a request to stop the running request `request_id`, not one to decode


@dataclass
class Limits:
    """What the parser checks against: the engine's limits and the deployment's defaults."""

    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    vocab: int
    end_ids: tuple[int, ...]
    methods: list[str]
    default_method: str
    spec: SpecDecodeConfig  # the deployment's speculation config: max_draft_len, default k, use_draft_logits
    default_exclude: bool = True
    add_special_tokens: bool = True
    decoupled: bool = True


# tensorrtllm_backend's ensemble inputs this backend cannot act on: (name, the value that means "off", why).
# A request that sends the neutral value (or omits the input) is served; any other value is refused.
NVIDIA_INPUTS: dict[str, tuple[object, str]] = {
    "beam_width": (1, "beam search is not implemented by the torch backend; send 1 (sampling or greedy)"),
    "num_return_sequences": (1, "one sequence per request; send 1 and repeat the request for more"),
    "repetition_penalty": (1.0, "penalties are not implemented by the torch backend; send 1.0 or omit it"),
    "presence_penalty": (0.0, "penalties are not implemented by the torch backend; send 0.0 or omit it"),
    "frequency_penalty": (0.0, "penalties are not implemented by the torch backend; send 0.0 or omit it"),
    "return_log_probs": (False, "log probabilities are not returned by the torch backend; send false"),
    "return_context_logits": (False, "logits are not returned by the torch backend; send false"),
    "return_generation_logits": (False, "logits are not returned by the torch backend; send false"),
}
# Inputs that only mean something to features this backend lacks: any non-empty value is refused.
UNSUPPORTED_INPUTS: dict[str, str] = {
    "decoder_text_input": "encoder-decoder models are not served by the torch backend",
    "prompt_embedding_table": "prompt tuning is not supported by the torch backend",
    "prompt_table_extra_id": "prompt tuning is not supported by the torch backend",
    "prompt_vocab_size": "prompt tuning is not supported by the torch backend",
    "embedding_bias_words": "embedding bias is not supported by the torch backend",
    "embedding_bias_weights": "embedding bias is not supported by the torch backend",
    "lora_task_id": "LoRA is not supported by the torch backend",
    "lora_weights": "LoRA is not supported by the torch backend",
    "lora_config": "LoRA is not supported by the torch backend",
    "guided_decoding_guide_type": "guided decoding is not supported by the torch backend",
    "guided_decoding_guide": "guided decoding is not supported by the torch backend",
}
# Accepted and honoured as they are by definition at beam width 1 (TensorRT-LLM ignores them there too).
NEUTRAL_AT_BEAM_1 = ("length_penalty", "early_stopping")


def text(raw, name: str) -> str:
    if isinstance(raw, str):
        return raw
    b = bytes(raw)
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"{name}: not valid UTF-8 (byte {b[e.start]:#04x} at position {e.start}); "
                         "send UTF-8 encoded text") from None


def _empty(arr) -> bool:
    if arr is None or arr.size == 0:
        return True
    if arr.dtype == np.object_:
        return all(not (v if isinstance(v, (bytes, str)) else bytes(v)) for v in arr.reshape(-1))
    return False


def sampling(temperature, top_k, top_p, seed, vocab: int):
    """SamplingParams for one row, with the definitions above; BadRequest names a value that has none."""
    t = 0.0 if temperature is None else float(temperature)
    if not math.isfinite(t) or t < 0:
        raise BadRequest(f"temperature: got {t}; must be 0 (greedy) or a positive finite number")
    if t < MIN_TEMPERATURE:
        t = 0.0  # defined as greedy: dividing by it would overflow to inf and NaN
    k = 0 if top_k is None else int(top_k)
    if k < 0:
        raise BadRequest(f"top_k: got {k}; must be 0 (off) or positive (at or above the vocabulary means off)")
    if k >= vocab:
        k = 0
    p = 1.0 if top_p is None else float(top_p)
    if not math.isfinite(p) or not 0 < p <= 1:
        raise BadRequest(f"top_p: got {p}; must be in (0, 1]")
    if p < MIN_TOP_P:
        p, k = 1.0, 1  # keeps one token: the most likely
    params = SamplingParams(t, k, p, None if seed is None else int(seed))
    try:
        params.check(vocab)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return params


class RequestParser:
    def __init__(self, tokenizer, limits: Limits):
        self.tok, self.lim = tokenizer, limits

    def _rows(self, arr, name: str, batch: int) -> list:
        """One value per batch row from a [B, 1] (or [1, 1], broadcast) input."""
        if arr is None:
            return [None] * batch
        if arr.ndim == 0:
            arr = arr.reshape(1, 1)
        if arr.shape[0] not in (1, batch) or arr.size == 0:
            raise BadRequest(f"{name}: got shape {list(arr.shape)}; expected [{batch}, 1] to match text_input")
        flat = arr.reshape(arr.shape[0], -1)
        if flat.shape[1] < 1:
            raise BadRequest(f"{name}: got shape {list(arr.shape)}; expected [{batch}, 1] to match text_input")
        return [flat[min(i, flat.shape[0] - 1), 0] for i in range(batch)]

    def _prediction(self, value) -> list[int] | None:
        """The `prediction` input's tokens (Predicted Outputs; methods suffix and hybrid draft from it first)."""
        if value is None:
            return None
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError:
                raise BadRequest("prediction: not valid UTF-8; send the predicted text as UTF-8 bytes") from None
        if not isinstance(value, str):
            raise BadRequest(f"prediction: got {type(value).__name__}; send a BYTES [1, 1] tensor of UTF-8 text")
        if len(value) > 64 * self.lim.max_seq_len:
            raise BadRequest(f"prediction: {len(value)} characters, far above max_seq_len={self.lim.max_seq_len} "
                             "tokens; send at most the expected answer")
        return self.tok(value, add_special_tokens=False)["input_ids"] or None

    def _words(self, arr, name: str, row: int) -> list[str]:
        if arr is None or arr.size == 0:
            return []
        vals = arr[min(row, arr.shape[0] - 1)].reshape(-1) if arr.ndim > 1 else arr.reshape(-1)
        if len(vals) > MAX_STOP_WORDS:
            raise BadRequest(f"{name}: {len(vals)} words; send at most {MAX_STOP_WORDS}")
        return [w for w in (text(v, name) for v in vals) if w]

    def encode(self, prompt: str) -> list[int]:
        bos = getattr(self.tok, "bos_token", None)
        special = self.lim.add_special_tokens and not (bos and prompt.startswith(bos))
        return list(self.tok(prompt, add_special_tokens=special)["input_ids"])

    def _nvidia(self, get: Getter, batch: int) -> None:
        for name, (neutral, why) in NVIDIA_INPUTS.items():
            for v in self._rows(get(name), name, batch):
                if v is None:
                    continue
                ok = bool(v) == neutral if isinstance(neutral, bool) else (
                    math.isfinite(float(v)) and float(v) == float(neutral))
                if not ok:
                    shown = bool(v) if isinstance(neutral, bool) else f"{float(v):.6g}"
                    raise BadRequest(f"{name}: got {shown}; {why}")
        for name, why in UNSUPPORTED_INPUTS.items():
            if not _empty(get(name)):
                raise BadRequest(f"{name}: {why}; omit it")
        for name in NEUTRAL_AT_BEAM_1:
            for v in self._rows(get(name), name, batch):
                if v is not None and not math.isfinite(float(v)):
                    raise BadRequest(f"{name}: got {v}; must be finite (it has no effect at beam_width 1)")
        for name in ("min_length", "min_tokens"):
            for v in self._rows(get(name), name, batch):
                if v is not None and int(v) > 1:
                    raise BadRequest(f"{name}: got {int(v)}; a minimum length is not implemented by the torch "
                                     "backend (it stops at end_id or max_tokens); send 0 or 1, or omit it")

    def parse(self, get: Getter, request_id: str = "") -> Parsed:
        lim = self.lim
        stop = get("stop")
        if stop is not None and stop.size and bool(stop.reshape(-1)[0]):
            if not request_id:
                raise BadRequest("stop: true needs the request_id of the request to stop; send it as this "
                                 "request's id (the id you gave the request to cancel)")
            return Parsed(request_id, stop=True)
        arr = get("text_input")
        if arr is None:
            raise BadRequest("text_input: missing; send the prompt as a BYTES tensor of shape [1, 1]")
        batch = int(arr.shape[0]) if arr.ndim else 1
        if batch < 1 or batch > lim.max_batch_size:
            raise BadRequest(f"text_input: batch size {batch} (shape {list(arr.shape)}); this model accepts 1 to "
                             f"{lim.max_batch_size} rows, one prompt per row: shape [1, 1] for one request")
        texts = [text(v, "text_input") for v in self._rows(arr, "text_input", batch)]
        job = Parsed(request_id, texts)
        scalar = lambda name: self._rows(get(name), name, batch)[0]  # noqa: E731
        method = scalar("method")
        job.method = lim.default_method if method is None else text(method, "method").strip()
        k = scalar("num_draft_tokens")
        if k is not None:
            k = int(k)
            if k != 0:  # 0 asks for no speculation; anything else must be within max_draft_len
                try:
                    lim.spec.check_k(k, "num_draft_tokens", "send one within it, 0 for plain decoding, or omit it for "
                                     "the deployment's default")
                except SpeculationError as e:
                    raise BadRequest(str(e)) from None
            if method is None and k == 0:
                job.method = "baseline"
        if job.method not in lim.methods:
            raise BadRequest(f"method: got {job.method!r}; this deployment serves {', '.join(lim.methods)}")
        if job.method in ("draft_target", "prompt_lookup", "suffix", "hybrid"):
            if k == 0:
                raise BadRequest(f"num_draft_tokens: got 0 with method {job.method!r}; send 1 to "
                                 f"{lim.spec.max_draft_len}, or omit it for the default {lim.spec.k_for(job.method)}")
            job.k = k or lim.spec.k_for(job.method)
        off = scalar("disable_at_batch")
        if off is not None:
            if int(off) < 0:
                raise BadRequest(f"disable_at_batch: got {int(off)}; send 0 (speculate at any batch size) or the "
                                 "batch size from which to decode plainly, or omit it for the configured value")
            job.disable_at_batch = int(off)

        def flag(name: str, default: bool) -> bool:
            v = scalar(name)
            return default if v is None else bool(v)

        job.stream = flag("stream", False)
        job.exclude_input = flag("exclude_input_in_output", lim.default_exclude)
        job.perf = flag("return_perf_metrics", False) or flag("return_num_input_tokens", False) or flag(
            "return_num_output_tokens", False) or flag("return_kv_cache_reuse_stats", False)
        job.use_draft_logits = flag("use_draft_logits", lim.spec.use_draft_logits)
        if job.stream and not lim.decoupled:
            raise BadRequest("stream: true, but this deployment is not decoupled (spec triton.decoupled: false): it "
                             "answers each request with one response. Send stream=false, or serve the spec with "
                             "triton.decoupled: true for streaming")
        if job.stream and batch > 1:
            raise BadRequest(f"stream: streaming needs one row per request; got a batch of {batch}. "
                             "Send the rows as separate requests")
        self._nvidia(get, batch)
        seeds = self._rows(get("seed"), "seed", batch)
        for i, v in enumerate(self._rows(get("random_seed"), "random_seed", batch)):
            if v is not None:
                if seeds[i] is not None and int(seeds[i]) != int(v):
                    raise BadRequest(f"random_seed: got {int(v)} next to seed {int(seeds[i])}; they are the same "
                                     "input (TensorRT-LLM renamed random_seed to seed): send one of them")
                seeds[i] = v
        cols = {n: self._rows(get(n), n, batch) for n in ("max_tokens", "temperature", "top_k", "top_p", "end_id",
                                                          "cache_prompt", "prediction")}
        stops, bads = get("stop_words"), get("bad_words")
        for i, prompt in enumerate(texts):
            if not prompt:
                raise BadRequest("text_input: empty; send at least one character of prompt")
            if len(prompt) > 64 * lim.max_input_len + 1024:  # refuse before spending time tokenizing it
                raise BadRequest(f"text_input: {len(prompt)} characters, far above what max_input_len="
                                 f"{lim.max_input_len} tokens can hold; shorten the prompt")
            ids = self.encode(prompt)
            if len(ids) > lim.max_input_len:
                raise BadRequest(f"text_input: the prompt is {len(ids)} tokens; this engine accepts at most "
                                 f"max_input_len={lim.max_input_len}. Shorten the prompt or rebuild with a larger "
                                 "limits.max_input_len")
            if cols["max_tokens"][i] is None:
                raise BadRequest("max_tokens: missing; send an INT32 [1, 1] tensor")
            n = int(cols["max_tokens"][i])
            room = lim.max_seq_len - len(ids)
            if not 1 <= n <= room:
                raise BadRequest(f"max_tokens: got {n}; must be between 1 and {room} (max_seq_len={lim.max_seq_len} "
                                 f"minus the prompt's {len(ids)} tokens)")
            params = sampling(cols["temperature"][i], cols["top_k"][i], cols["top_p"][i], seeds[i], lim.vocab)
            end_ids = tuple(lim.end_ids)
            if cols["end_id"][i] is not None:
                e = int(cols["end_id"][i])
                if not -1 <= e < lim.vocab:
                    raise BadRequest(f"end_id: got {e}; must be a token id between 0 and {lim.vocab - 1}, or -1 for "
                                     "none (decode to max_tokens or a stop word)")
                end_ids = (e,) if e >= 0 else ()  # -1: no end token, as TensorRT-LLM's executor reads end_id=-1
            if self._words(bads, "bad_words", i):
                raise BadRequest("bad_words: not supported by the torch backend; send an empty list or omit it")
            stop_ids = [self.tok(w, add_special_tokens=False)["input_ids"] for w in self._words(stops, "stop_words", i)]
            cache_prompt = cols["cache_prompt"][i] is None or bool(cols["cache_prompt"][i])  # the prompt cache
            job.reqs.append(Request(ids, n, params, stop=[s for s in stop_ids if s], end_ids=end_ids,
                                    cache_prompt=cache_prompt, prediction=self._prediction(cols["prediction"][i])))
        return job

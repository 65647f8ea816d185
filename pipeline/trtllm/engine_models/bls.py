"""tensorrt_llm_bls (ours): draft-target that streams, batches and reports acceptance, over the era's models.

Written into the repository by pipeline.trtllm.engine_repo when `tensorrt_llm.bls: pipeline` (the
default). It talks to the same models as NVIDIA's v0.18 BLS, with the same tensors:
`preprocessing` (QUERY ... -> INPUT_ID ...), `tensorrt_llm_draft` and `tensorrt_llm` (input_ids,
request_output_len, draft_input_ids, draft_logits, ... -> output_ids, sequence_length,
generation_logits) and `postprocessing` (TOKENS_BATCH, SEQUENCE_LENGTH -> OUTPUT). What differs:

- streaming: decoupled or not as the spec's `triton.decoupled` says (the key that makes the torch backend's
  served models stream). Decoupled, a draft-target request with `stream` gets one response per round (the tokens
  that round accepted; NVIDIA's refuses it); not decoupled, every request gets one response with the whole text,
  so tritonclient's unary `infer` works, and `stream: true` is refused with an error naming the key;
- batching: requests run concurrently in a thread pool (max_concurrency), and the rows of a
  request with batch > 1 too, so the LLM models' in-flight batching sees them together; NVIDIA's
  refuses batch > 1 with a draft;
- `return_perf_metrics`: acceptance_rate, total_accepted_draft_tokens, total_draft_tokens,
  num_input_tokens, num_output_tokens (NVIDIA's BLS has no such outputs);
- `exclude_input_in_output` (default true, the project's contract) is honoured here; the LLM models
  are always asked for output_ids with the prompt (exclude_input_in_output false), as NVIDIA's loop
  needs, and the prompt is sliced off here;
- `method` (baseline, draft_target, medusa) as the torch backend; without it a request speculates
  with the deployment's drafter (num_draft_tokens 0 means no speculation), `seed` / `min_tokens`
  are read like `random_seed` / `min_length`.

Greedy acceptance is the target engine's (draft_tokens_external): the target returns the accepted
draft tokens plus its own next token; `use_draft_logits` sends the draft's generation logits for
the engine's logits-based acceptance.
"""

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Request tensors passed to the LLM models as they are (request name -> tensorrt_llm name), as NVIDIA's BLS.
SAMPLING = {"top_k": "runtime_top_k", "top_p": "runtime_top_p", "temperature": "temperature",
            "length_penalty": "len_penalty", "repetition_penalty": "repetition_penalty",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
            "random_seed": "random_seed", "beam_width": "beam_width"}
PREPROC_OUTPUTS = ["INPUT_ID", "DECODER_INPUT_ID", "REQUEST_INPUT_LEN", "REQUEST_DECODER_INPUT_LEN", "BAD_WORDS_IDS",
                   "STOP_WORDS_IDS", "EMBEDDING_BIAS", "OUT_PAD_ID", "OUT_END_ID", "OUT_PROMPT_TABLE_EXTRA_IDS",
                   "PIXEL_VALUES", "IMAGE_SIZES", "IS_VIDEO_INPUT"]
LLM_OUTPUTS = ["output_ids", "sequence_length", "cum_log_probs", "output_log_probs", "context_logits",
               "generation_logits", "batch_index", "sequence_index", "kv_cache_alloc_new_blocks",
               "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks"]


def stream_piece(sent: str, text: str, final: bool) -> tuple[str, str]:
    """(the piece to send now, the text sent so far after it). A round can end inside a multi-byte UTF-8 character:
    the text then ends in U+FFFD, which the next round's text does not start with (sending the whole text again, as
    this did), so a trailing U+FFFD is held back until the character is whole or the request ends. What was sent is
    never sent again: the piece is what lies past it."""
    if not final:
        text = text.rstrip("\ufffd")
    return ("", sent) if len(text) <= len(sent) else (text[len(sent):], text)


class BadRequest(ValueError):
    """A request this model refuses; the message names the input, the value and what is allowed."""


def _param(params: dict, key: str, default: str = "") -> str:
    v = params.get(key, {}).get("string_value", "")
    return default if v == "" or v.startswith("${") else v


def _inputs(request) -> dict:
    """Every input tensor of a Triton request as numpy, by name."""
    return {t.name(): t.as_numpy() for t in request.inputs()}


def _row(arr, i):
    """Row i of a request tensor as a [1, ...] array (the batch dimension kept)."""
    return None if arr is None else arr[i:i + 1]


def _scalar(arr, i=0, default=None):
    return default if arr is None else arr.reshape(arr.shape[0], -1)[i][0]


def _error(e: Exception):
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e)))


def _exec(name: str, tensors: list, outputs: list[str]):
    resp = pb_utils.InferenceRequest(model_name=name, inputs=tensors, requested_output_names=outputs).exec()
    if resp.has_error():
        raise RuntimeError(f"{name}: {resp.error().message()}")
    return {t.name(): t.as_numpy() for t in resp.output_tensors()}


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        p = cfg.get("parameters", {})
        self.llm = _param(p, "tensorrt_llm_model_name", "tensorrt_llm")
        self.draft = _param(p, "tensorrt_llm_draft_model_name", "") or None
        self.k_default = int(_param(p, "default_num_draft_tokens", "4"))
        self.max_draft_len = int(_param(p, "max_draft_len", str(self.k_default)))
        self.use_logits_default = _param(p, "use_draft_logits", "false") == "true"
        self.exclude_default = _param(p, "exclude_input_in_output", "true") == "true"
        self.engine_method = _param(p, "engine_method", "baseline")
        self.methods = [self.engine_method] + (["draft_target"] if self.draft else [])
        if self.engine_method != "baseline":
            self.methods.append("baseline")  # a request for baseline runs the same engine (it speculates inside)
        n = int(_param(p, "max_concurrency", "8"))
        self.jobs = ThreadPoolExecutor(max_workers=n, thread_name_prefix="bls-job")
        self.rows = ThreadPoolExecutor(max_workers=n, thread_name_prefix="bls-row")
        self.logger = pb_utils.Logger
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)

    # -- requests ------------------------------------------------------------------------------------

    def _plan(self, ins: dict) -> dict:
        """What a request asks for: method, k, streaming, exclusion, perf; BadRequest when it cannot run."""
        if "text_input" not in ins or "max_tokens" not in ins:
            raise BadRequest("text_input and max_tokens are required")
        rows = ins["text_input"].shape[0]
        max_tokens = int(_scalar(ins["max_tokens"]))
        if max_tokens < 1:
            raise BadRequest(f"max_tokens: got {max_tokens}; must be 1 or more")
        method = _scalar(ins.get("method"))
        method = (method.decode() if isinstance(method, bytes) else method).strip() if method is not None else None
        k = _scalar(ins.get("num_draft_tokens"))
        k = None if k is None else int(k)
        if method is None:
            method = "draft_target" if self.draft and k != 0 else self.engine_method
        if method not in self.methods:
            raise BadRequest(f"method: got {method!r}; this deployment serves {self.methods}")
        if method == "draft_target":
            k = self.k_default if not k else k
            if not 1 <= k <= self.max_draft_len:
                raise BadRequest(f"num_draft_tokens: got {k}; the target engine was built with max_draft_len "
                                 f"{self.max_draft_len}: send 1..{self.max_draft_len}")
        elif k:
            raise BadRequest(f"num_draft_tokens: got {k} with method {method!r}; only draft_target takes draft "
                             "tokens: leave it out or send 0")
        off = _scalar(ins.get("disable_at_batch"), default=0)
        if int(off) > 0:
            raise BadRequest("disable_at_batch: tensorrtllm_backend's in-flight batching cannot switch speculation "
                             "off per batch; send 0 or leave it out")
        if _scalar(ins.get("return_context_logits"), default=False) and method == "draft_target":
            raise BadRequest("return_context_logits: not available with draft_target (the target sees the prompt "
                             "once per round); send false")
        stream = bool(_scalar(ins.get("stream"), default=False))
        if stream and not self.decoupled:
            raise BadRequest("stream: true, but this tensorrt_llm_bls is not decoupled (spec triton.decoupled: false): "
                             "it answers one response per request; send stream false, or set triton.decoupled: true "
                             "for streaming")
        if stream and rows > 1:
            raise BadRequest(f"stream: a streamed request has one row; got {rows} (send the rows as separate "
                             "requests: they are batched together)")
        for later, era in (("seed", "random_seed"), ("min_tokens", "min_length")):
            if later in ins:
                if era in ins and not np.array_equal(ins[later], ins[era]):
                    raise BadRequest(f"{later} and {era} are the same setting and differ: send one of them")
                ins[era] = ins.pop(later)
        use_logits = _scalar(ins.get("use_draft_logits"), default=self.use_logits_default)
        return {"rows": rows, "max_tokens": max_tokens, "method": method, "k": k, "stream": stream,
                "exclude": bool(_scalar(ins.get("exclude_input_in_output"), default=self.exclude_default)),
                "perf": bool(_scalar(ins.get("return_perf_metrics"), default=False)), "use_logits": bool(use_logits)}

    def execute(self, requests):
        if not self.decoupled:
            return self._execute_unary(requests)
        for request in requests:
            sender = request.get_response_sender()
            try:
                ins = _inputs(request)
                plan = self._plan(ins)
            except BadRequest as e:
                sender.send(_error(e), flags=FINAL)
                continue
            self.jobs.submit(self._answer, ins, plan, sender)
        return None

    def _execute_unary(self, requests) -> list:
        """Not decoupled: one response per request, returned from execute; the requests of a call still run
        concurrently (the LLM models' in-flight batching sees them together), and a bad one fails alone."""
        pending = []
        for request in requests:
            try:
                ins = _inputs(request)
                pending.append(self.jobs.submit(self._whole, ins, self._plan(ins)))
            except BadRequest as e:
                pending.append(_error(e))
        return [p if isinstance(p, pb_utils.InferenceResponse) else p.result() for p in pending]

    def _answer(self, ins: dict, plan: dict, sender) -> None:
        if not plan["stream"]:
            sender.send(self._whole(ins, plan), flags=FINAL)
            return
        try:
            pre = self._preprocess(ins)
            self._row(ins, plan, pre, 0, sender)
            sender.send(flags=FINAL)
        except Exception as e:  # noqa: BLE001 - any failure is this request's error, the model keeps serving
            self.logger.log_error(f"tensorrt_llm_bls: {type(e).__name__}: {e}")
            sender.send(_error(e), flags=FINAL)

    def _whole(self, ins: dict, plan: dict):
        """A request's rows, generated concurrently, as one response (an error response when anything fails)."""
        try:
            pre = self._preprocess(ins)
            futures = [self.rows.submit(self._row, ins, plan, pre, i, None) for i in range(plan["rows"])]
            results = [f.result() for f in futures]
            return self._response([r[0] for r in results], [r[1] for r in results], plan)
        except Exception as e:  # noqa: BLE001 - any failure is this request's error, the model keeps serving
            self.logger.log_error(f"tensorrt_llm_bls: {type(e).__name__}: {e}")
            return _error(e)

    # -- the models ----------------------------------------------------------------------------------

    def _preprocess(self, ins: dict) -> dict:
        names = {"text_input": "QUERY", "decoder_text_input": "DECODER_QUERY", "max_tokens": "REQUEST_OUTPUT_LEN",
                 "bad_words": "BAD_WORDS_DICT", "stop_words": "STOP_WORDS_DICT",
                 "embedding_bias_words": "EMBEDDING_BIAS_WORDS", "embedding_bias_weights": "EMBEDDING_BIAS_WEIGHTS",
                 "pad_id": "PAD_ID", "end_id": "END_ID", "prompt_table_extra_id": "PROMPT_TABLE_EXTRA_ID"}
        tensors = [pb_utils.Tensor(n, ins[k]) for k, n in names.items() if k in ins]
        return _exec("preprocessing", tensors, PREPROC_OUTPUTS)

    def _llm(self, model: str, ins: dict, pre: dict, i: int, ids: list[int], n: int, draft: list[int] | None = None,
             draft_logits=None, gen_logits: bool = False, min_length: int | None = None) -> tuple[list[int], object]:
        """One call of a TensorRT-LLM model: the new tokens after `ids`, and their generation logits."""
        t = [pb_utils.Tensor("input_ids", np.array([ids], np.int32)),
             pb_utils.Tensor("input_lengths", np.array([[len(ids)]], np.int32)),
             pb_utils.Tensor("request_output_len", np.array([[n]], np.int32)),
             pb_utils.Tensor("exclude_input_in_output", np.array([[False]])),
             pb_utils.Tensor("streaming", np.array([[False]])),
             pb_utils.Tensor("return_generation_logits", np.array([[gen_logits]])),
             pb_utils.Tensor("return_context_logits", np.array([[False]]))]
        for src, name in (("OUT_END_ID", "end_id"), ("OUT_PAD_ID", "pad_id"), ("STOP_WORDS_IDS", "stop_words_list"),
                          ("BAD_WORDS_IDS", "bad_words_list"), ("EMBEDDING_BIAS", "embedding_bias")):
            if pre.get(src) is not None:
                t.append(pb_utils.Tensor(name, _row(pre[src], i)))
        for src, name in SAMPLING.items():
            if src in ins:
                t.append(pb_utils.Tensor(name, _row(ins[src], i)))
        if min_length is not None:
            t.append(pb_utils.Tensor("min_length", np.array([[min_length]], np.int32)))
        elif "min_length" in ins and draft is None:
            t.append(pb_utils.Tensor("min_length", _row(ins["min_length"], i)))
        if draft:
            t.append(pb_utils.Tensor("draft_input_ids", np.array([draft], np.int32)))
            if draft_logits is not None:
                t.append(pb_utils.Tensor("draft_logits", np.ascontiguousarray(draft_logits[None])))
        out = _exec(model, t, ["output_ids", "sequence_length"] + (["generation_logits"] if gen_logits else []))
        seq = int(out["sequence_length"].reshape(-1)[0])
        tokens = out["output_ids"].reshape(-1)[len(ids):seq].tolist()
        logits = out.get("generation_logits")
        return tokens, (None if logits is None else logits.reshape(-1, *logits.shape[-2:])[0])

    def _text(self, tokens: list[int]) -> str:
        out = _exec("postprocessing", [pb_utils.Tensor("TOKENS_BATCH", np.array([[tokens]], np.int32)),
                                       pb_utils.Tensor("SEQUENCE_LENGTH", np.array([[len(tokens)]], np.int32))],
                    ["OUTPUT"])["OUTPUT"].reshape(-1)[0]
        return out.decode("utf-8", errors="replace") if isinstance(out, bytes) else str(out)

    # -- one row ---------------------------------------------------------------------------------------

    def _row(self, ins: dict, plan: dict, pre: dict, i: int, sender) -> tuple[str, dict]:
        """Generate one row; with a sender, stream a response per round. Returns (text, perf)."""
        n_in = int(pre["REQUEST_INPUT_LEN"].reshape(-1)[i])
        prompt = pre["INPUT_ID"][i][:n_in].tolist()
        end_id = int(pre["OUT_END_ID"].reshape(-1)[i])
        stops = self._stop_words(pre, i)
        max_tokens = plan["max_tokens"]
        stat = {"proposed": 0, "accepted": 0}
        gen: list[int] = []
        sent = [""]
        lock = threading.Lock()

        def emit(final: bool = False):
            if sender is None:
                return
            text = self._text(gen if plan["exclude"] else prompt + gen)
            with lock:
                piece, sent[0] = stream_piece(sent[0], text, final)
            if piece or final:
                sender.send(self._response([piece], [self._perf(stat, n_in, len(gen), plan)], plan))

        if plan["method"] != "draft_target":
            gen = self._llm(self.llm, ins, pre, i, prompt, max_tokens)[0]
            stat = None if plan["method"] == "medusa" or self.engine_method == "medusa" else stat
        else:
            while len(gen) < max_tokens:
                k = min(plan["k"], max_tokens - len(gen) - 1)
                draft, logits = [], None
                if k > 0:
                    draft, logits = self._llm(self.draft, ins, pre, i, prompt + gen, k, gen_logits=plan["use_logits"],
                                              min_length=k)
                    draft = draft[:k]
                    if plan["use_logits"] and logits is not None and draft:
                        logits = logits[-len(draft):]
                    else:
                        logits = None
                new = self._llm(self.llm, ins, pre, i, prompt + gen, len(draft) + 1, draft=draft,
                                draft_logits=logits)[0]
                a = 0
                while a < len(draft) and a < len(new) and draft[a] == new[a]:
                    a += 1
                stat["proposed"] += len(draft)
                stat["accepted"] += a
                if not new:
                    break
                gen += new[:max_tokens - len(gen)]
                emit()
                if end_id in new or any(gen[-len(s):] == s for s in stops):
                    break
        if sender is not None and plan["method"] != "draft_target":
            emit()
        text = self._text(gen if plan["exclude"] else prompt + gen)
        return text, self._perf(stat, n_in, len(gen), plan)

    @staticmethod
    def _stop_words(pre: dict, i: int) -> list[list[int]]:
        """Stop words from preprocessing's [batch, 2, n] format (flat ids, cumulative end offsets, -1 padded)."""
        arr = pre.get("STOP_WORDS_IDS")
        if arr is None or arr.shape[-1] == 0:
            return []
        ids, offs = arr[i][0].tolist(), [o for o in arr[i][1].tolist() if o >= 0]
        return [ids[a:b] for a, b in zip([0] + offs[:-1], offs) if b > a]

    @staticmethod
    def _perf(stat: dict | None, n_in: int, n_out: int, plan: dict) -> dict:
        if stat is None:  # the engine speculates inside and v0.18 reports nothing: -1
            return {"acceptance_rate": -1.0, "total_accepted_draft_tokens": -1, "total_draft_tokens": -1,
                    "num_input_tokens": n_in, "num_output_tokens": n_out}
        rate = stat["accepted"] / stat["proposed"] if stat["proposed"] else 0.0
        return {"acceptance_rate": rate, "total_accepted_draft_tokens": stat["accepted"],
                "total_draft_tokens": stat["proposed"], "num_input_tokens": n_in, "num_output_tokens": n_out}

    @staticmethod
    def _response(texts: list[str], perfs: list[dict], plan: dict):
        out = [pb_utils.Tensor("text_output", np.array([[t.encode("utf-8")] for t in texts], dtype=object))]
        if plan["perf"]:
            for name, dtype in (("acceptance_rate", np.float32), ("total_accepted_draft_tokens", np.int32),
                                ("total_draft_tokens", np.int32), ("num_input_tokens", np.int32),
                                ("num_output_tokens", np.int32)):
                out.append(pb_utils.Tensor(name, np.array([[p[name]] for p in perfs], dtype=dtype)))
        return pb_utils.InferenceResponse(output_tensors=out)

    def finalize(self):
        self.jobs.shutdown(wait=False, cancel_futures=True)
        self.rows.shutdown(wait=False, cancel_futures=True)

"""Triton python-backend model: the torch runtime behind tensorrtllm_backend's client contract.

Copied into triton_repo/<name>/tensorrt_llm_bls/1/model.py. One instance holds the weights and
serves every method (`method` input; default from config). Decoupled: streamed pieces go out as
the runtime emits tokens, and the last response carries the final flag and, when asked, the perf
outputs. `execute` only parses: one worker thread decodes. Plain requests (baseline, and speculative
ones whose load reaches `disable_at_batch`) join a continuous batch (`pipeline.runtime.batcher`):
rows are admitted and retired at every step, so clients arriving at different times share steps
instead of queueing behind each other. Speculative requests run as batches grouped by (method,
draft length) through `pipeline.runtime.decode.decode` when the continuous batch is empty (new plain
rows wait meanwhile, so neither kind starves). Between speculative rounds the worker looks at what
has arrived: once the load reaches `disable_at_batch`, the running rows hand their KV cache over to
the continuous batch and finish there, plainly, next to the newcomers; below it, newcomers of the
same group (draft_target, prompt_lookup, medusa) join the running batch: its rows step aside into the
continuous batch, the newcomers are prefilled next to them, and all speculate on together. Each row
is answered as it finishes. A bad request gets an error naming the input and never disturbs the
others; a cancelled request stops at its next step.
"""

from __future__ import annotations

import json
import math
import os
import queue
import site
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCEL_CHECK_S = 0.02


class BadRequest(ValueError):
    """A request the model cannot run; the message names the input, the value and what is allowed."""


class Cancelled(Exception):
    """Every row of a batch was cancelled by its client."""


def _param(cfg: dict, key: str, default: str = "") -> str:
    return cfg.get("parameters", {}).get(key, {}).get("string_value", default)


def _add_paths(paths: list[str]) -> None:
    """Put the venv's site-packages (with its .pth files) and the project ahead of the stub's own path."""
    before = list(sys.path)
    for p in paths:
        if p and os.path.isdir(p):
            site.addsitedir(p)
    added = [p for p in sys.path if p not in before]
    sys.path[:] = [p for p in paths if p] + [p for p in added if p not in paths] + [p for p in before if p not in paths]


@dataclass
class Job:
    """One Triton request: its rows (batch entries) and how to answer it."""

    request: object
    sender: object
    texts: list[str]
    reqs: list = field(default_factory=list)
    method: str = "baseline"
    k: int = 0
    use_draft_logits: bool = True
    disable_at_batch: int | None = None  # None: the model's configured value
    stream: bool = False
    exclude_input: bool = True
    perf: bool = False
    cancelled: bool = False
    checked_at: float = 0.0
    rows: list = field(default_factory=list)
    results: list = field(default_factory=list)
    plain: bool = False  # a speculative request decoded plainly (load at or above disable_at_batch)


@dataclass
class Row:
    job: Job
    index: int
    tokens: list[int] = field(default_factory=list)
    sent: str = ""  # text streamed so far
    prefix: int = 0  # streaming window: tokens[prefix:read] decoded to the end of `sent`
    read: int = 0
    plain: bool = False  # took plain steps in the continuous batch since it last speculated


def _resumable_method(method: str) -> bool:
    """Rows of this method can step aside into the continuous batch and speculate again (`resume=`)."""
    from pipeline.runtime.decode import RESUMABLE

    return method in RESUMABLE or method == "medusa_typical"


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        cfg = json.loads(args["model_config"])
        _add_paths(_param(cfg, "python_path").split(":"))
        import torch

        from pipeline.runtime.decode import load_bundle

        threads = int(_param(cfg, "threads", "0") or 0)
        if threads:
            torch.set_num_threads(threads)
        self.model_name = args.get("model_name", cfg.get("name", "tensorrt_llm_bls"))
        self.bundle = load_bundle(Path(_param(cfg, "engine_dir")), _param(cfg, "device", "cpu"))
        self.bundle.options["prompt_lookup_max_ngram"] = int(_param(cfg, "prompt_lookup_max_ngram", "3"))
        self.tok = self.bundle.tokenizer
        self.methods = self.bundle.methods()
        if "medusa" in self.methods:
            self.methods.append("medusa_typical")  # Medusa's own (lossy) typical acceptance, for comparison
        prefer = _param(cfg, "default_method", "baseline").split(",")
        self.default_method = next((m for m in prefer if m in self.methods), "baseline")
        k = _param(cfg, "num_draft_tokens", "auto")
        if k.isdigit():
            self.bundle.options["num_draft_tokens"] = int(k)
        self.bundle.options["prompt_lookup_num_tokens"] = int(_param(cfg, "prompt_lookup_num_tokens", "4"))
        self.bundle.options["disable_at_batch"] = int(_param(cfg, "disable_at_batch", "0") or 0)
        self.bundle.options["draft_lookup_min_ngram"] = int(_param(cfg, "draft_lookup_min_ngram", "0") or 0)
        self.bundle.options["draft_confidence"] = float(_param(cfg, "draft_confidence", "0") or 0)
        self.default_use_draft_logits = _param(cfg, "use_draft_logits", "true") == "true"
        self.default_exclude = _param(cfg, "exclude_input_in_output", "true") == "true"
        self.add_special = _param(cfg, "add_special_tokens", "true") == "true"
        self.max_batch_size = int(cfg.get("max_batch_size", 0)) or 1
        bc = self.bundle.config["build_config"]
        self.max_input_len = int(bc["max_input_len"])
        self.max_seq_len = int(bc["max_seq_len"])
        self.vocab = int(self.bundle.target.cfg.vocab_size)
        self._metrics()
        from pipeline.runtime.batcher import ContinuousBatch

        self.pool = ContinuousBatch(self.bundle.target, self.max_batch_size)
        self.inbox: queue.Queue = queue.Queue()
        self.waiting: list[Job] = []  # parsed jobs the worker has not started (worker thread only)
        self.stopping = False
        self.worker = threading.Thread(target=self._serve, name="decode", daemon=True)
        self.worker.start()
        pb_utils.Logger.log_info(f"{self.model_name}: serving {self.methods} (default {self.default_method})")

    def _metrics(self) -> None:
        kind = pb_utils.MetricFamily.COUNTER
        fams = {
            "requests": ("spec_decode_requests_total", "Requests (batch rows) finished, per decoding method"),
            "proposed": ("spec_decode_draft_tokens_proposed_total", "Draft tokens proposed to the target"),
            "accepted": ("spec_decode_draft_tokens_accepted_total", "Draft tokens the target accepted"),
            "output": ("spec_decode_output_tokens_total", "Tokens generated"),
            "steps": ("spec_decode_target_steps_total", "Target forward passes (incl. prefill)"),
            "errors": ("spec_decode_request_errors_total", "Requests rejected or failed"),
            "cancelled": ("spec_decode_requests_cancelled_total", "Requests cancelled by their client"),
            "plain": ("spec_decode_requests_speculation_off_total",
                      "Requests decoded plainly (wholly or in part) because the requests in flight reached "
                      "speculation.disable_at_batch"),
            "resumed": ("spec_decode_speculation_resumed_total",
                        "Times a request switched to plain decoding went back to speculating as the load dropped"),
        }
        self.families = {k: pb_utils.MetricFamily(name=n, description=d, kind=kind) for k, (n, d) in fams.items()}
        self.counters: dict = {}
        for what in ("requests", "proposed", "accepted", "output", "steps", "plain", "resumed"):
            for method in self.methods:
                self._count(what, method, 0)

    def _count(self, what: str, method: str, value: float) -> None:
        key = (what, method)
        if key not in self.counters:
            self.counters[key] = self.families[what].Metric(labels={"model": self.model_name, "method": method})
        if value > 0:
            self.counters[key].increment(float(value))

    # ---- request parsing -------------------------------------------------------------------

    def _input(self, request, name: str):
        t = pb_utils.get_input_tensor_by_name(request, name)
        return None if t is None else t.as_numpy()

    def _rows(self, arr, name: str, batch: int) -> list:
        """One value per batch row from a [B, 1] (or [1, 1], broadcast) input."""
        if arr is None:
            return [None] * batch
        flat = arr.reshape(arr.shape[0], -1)
        if flat.shape[0] not in (1, batch) or flat.shape[1] < 1:
            raise BadRequest(f"{name}: got shape {list(arr.shape)}; expected [{batch}, 1] to match text_input")
        return [flat[min(i, flat.shape[0] - 1), 0] for i in range(batch)]

    def _scalar(self, request, name: str, batch: int):
        return self._rows(self._input(request, name), name, batch)[0]

    def _text(self, raw, name: str) -> str:
        if isinstance(raw, str):
            return raw
        b = bytes(raw)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadRequest(f"{name}: not valid UTF-8 (byte {b[e.start]:#04x} at position {e.start}); "
                             "send UTF-8 encoded text") from None

    def _words(self, arr, name: str, row: int) -> list[str]:
        if arr is None:
            return []
        vals = arr[min(row, arr.shape[0] - 1)].reshape(-1) if arr.ndim > 1 else arr.reshape(-1)
        return [w for w in (self._text(v, name) for v in vals) if w]

    def _encode(self, text: str) -> list[int]:
        bos = getattr(self.tok, "bos_token", None)
        special = self.add_special and not (bos and text.startswith(bos))
        return list(self.tok(text, add_special_tokens=special)["input_ids"])

    def _parse(self, request, sender) -> Job:
        from pipeline.runtime.decode import default_k
        from pipeline.runtime.generate import Request
        from pipeline.runtime.sampling import SamplingParams

        arr = self._input(request, "text_input")
        if arr is None:
            raise BadRequest("text_input: missing; send the prompt as a BYTES tensor of shape [1, 1]")
        batch = int(arr.shape[0]) if arr.ndim else 1
        if batch < 1 or batch > self.max_batch_size:
            raise BadRequest(f"text_input: batch {batch}; this model accepts 1 to {self.max_batch_size} rows")
        texts = [self._text(v, "text_input") for v in self._rows(arr, "text_input", batch)]
        job = Job(request, sender, texts)
        method = self._scalar(request, "method", batch)
        job.method = self.default_method if method is None else self._text(method, "method").strip()
        k = self._scalar(request, "num_draft_tokens", batch)
        if k is not None:
            k = int(k)
            if not 0 <= k <= self.bundle.max_draft_len:
                raise BadRequest(f"num_draft_tokens: got {k}; this engine allows 0 to max_draft_len="
                                 f"{self.bundle.max_draft_len}")
            if method is None and k == 0:
                job.method = "baseline"
        if job.method not in self.methods:
            raise BadRequest(f"method: got {job.method!r}; this deployment serves {', '.join(self.methods)}")
        if job.method in ("draft_target", "prompt_lookup"):
            if k == 0:
                raise BadRequest(f"num_draft_tokens: got 0 with method {job.method!r}; send 1 to "
                                 f"{self.bundle.max_draft_len}, or omit it for the default "
                                 f"{default_k(self.bundle, job.method)}")
            job.k = k or default_k(self.bundle, job.method)
        off = self._scalar(request, "disable_at_batch", batch)
        if off is not None:
            if int(off) < 0:
                raise BadRequest(f"disable_at_batch: got {int(off)}; send 0 (speculate at any batch size) or the "
                                 "batch size from which to decode plainly, or omit it for the configured value")
            job.disable_at_batch = int(off)
        flag = lambda name, default: (lambda v: default if v is None else bool(v))(self._scalar(request, name, batch))
        job.stream = flag("stream", False)
        job.exclude_input = flag("exclude_input_in_output", self.default_exclude)
        job.perf = flag("return_perf_metrics", False)
        job.use_draft_logits = flag("use_draft_logits", self.default_use_draft_logits)
        if job.stream and batch > 1:
            raise BadRequest(f"stream: streaming needs one row per request; got a batch of {batch}. "
                             "Send the rows as separate requests")
        cols = {n: self._rows(self._input(request, n), n, batch)
                for n in ("max_tokens", "temperature", "top_k", "top_p", "seed", "end_id")}
        stops, bads = self._input(request, "stop_words"), self._input(request, "bad_words")
        for i, text in enumerate(texts):
            if not text:
                raise BadRequest("text_input: empty; send at least one character of prompt")
            if len(text) > 64 * self.max_input_len + 1024:  # refuse before spending time tokenizing it
                raise BadRequest(f"text_input: {len(text)} characters, far above what max_input_len="
                                 f"{self.max_input_len} tokens can hold; shorten the prompt")
            ids = self._encode(text)
            if len(ids) > self.max_input_len:
                raise BadRequest(f"text_input: the prompt is {len(ids)} tokens; this engine accepts at most "
                                 f"max_input_len={self.max_input_len}. Shorten the prompt or rebuild with a larger "
                                 "limits.max_input_len")
            if cols["max_tokens"][i] is None:
                raise BadRequest("max_tokens: missing; send an INT32 [1, 1] tensor")
            n = int(cols["max_tokens"][i])
            room = self.max_seq_len - len(ids)
            if not 1 <= n <= room:
                raise BadRequest(f"max_tokens: got {n}; must be between 1 and {room} (max_seq_len={self.max_seq_len} "
                                 f"minus the prompt's {len(ids)} tokens)")
            temp = cols["temperature"][i]
            top_k = cols["top_k"][i]
            top_p = cols["top_p"][i]
            seed = cols["seed"][i]
            params = SamplingParams(0.0 if temp is None else float(temp), 0 if top_k is None else int(top_k),
                                    1.0 if top_p is None else float(top_p), None if seed is None else int(seed))
            if not math.isfinite(params.temperature):
                raise BadRequest(f"temperature: got {params.temperature}; must be 0 (greedy) or a positive number")
            try:
                params.check(self.vocab)
            except ValueError as e:
                raise BadRequest(str(e)) from None
            end_ids = tuple(self.bundle.end_ids)
            if cols["end_id"][i] is not None:
                e = int(cols["end_id"][i])
                if not 0 <= e < self.vocab:
                    raise BadRequest(f"end_id: got {e}; must be a token id between 0 and {self.vocab - 1}")
                end_ids = (e,)
            if self._words(bads, "bad_words", i):
                raise BadRequest("bad_words: not supported by the torch backend; send an empty list or omit it")
            stop = [self.tok(w, add_special_tokens=False)["input_ids"] for w in self._words(stops, "stop_words", i)]
            job.reqs.append(Request(ids, n, params, stop=[s for s in stop if s], end_ids=end_ids))
        return job

    # ---- execution ----------------------------------------------------------------------------

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self.inbox.put(self._parse(request, sender))
            except BadRequest as e:
                self._fail(sender, str(e), "errors", "invalid")
            except Exception as e:  # noqa: BLE001 - a bad request must never take the model down
                self._fail(sender, f"could not parse the request: {type(e).__name__}: {e}", "errors", "invalid")
        return None

    # ---- the decode worker ----------------------------------------------------------------------

    def _serve(self) -> None:
        while not self.stopping:
            if not self.waiting and not self.pool.rows:
                try:
                    self.waiting.append(self.inbox.get(timeout=0.1))
                except queue.Empty:
                    continue
            self._collect()
            try:
                self._schedule()
            except Exception as e:  # noqa: BLE001 - fail what was running, keep serving
                pb_utils.Logger.log_error(f"decode worker: {type(e).__name__}: {e}")
                self._abort_pool(f"decoding failed: {type(e).__name__}: {e}")

    def _collect(self) -> None:
        """Move everything `execute` queued into the worker's waiting list (worker thread only)."""
        try:
            while True:
                self.waiting.append(self.inbox.get_nowait())
        except queue.Empty:
            pass

    def _busy(self, key: tuple, rows: int) -> bool:
        """Polled between speculative rounds: have requests arrived that bring the load to disable_at_batch
        (the rows go plain), or that can join this batch (same group, resumable, room left)?"""
        from pipeline.runtime.decode import speculation_off

        self._collect()
        if not self.waiting:
            return False
        method, disable_at_batch = key[0], key[3]
        if speculation_off(self.bundle, method, rows + sum(len(j.reqs) for j in self.waiting), disable_at_batch):
            return True
        return _resumable_method(method) and any(
            self._group(j) == key and not j.cancelled and rows + len(j.reqs) <= self.max_batch_size
            for j in self.waiting)

    def _schedule(self) -> None:
        """One scheduling round: drop cancelled work, then run a speculative batch or one continuous step."""
        from pipeline.runtime.decode import speculation_off

        pending = self.waiting
        for job in [j for j in pending if self._is_cancelled(j)]:
            pending.remove(job)
            self._fail(job.sender, "request cancelled by the client", "cancelled", job.method, "CANCELLED")
        gone = {id(t.job) for t in self.pool.tags() if self._is_cancelled(t.job)}
        if gone:
            jobs = {id(t.job): t.job for t, _ in self.pool.remove(lambda t: id(t.job) in gone)}
            for job in jobs.values():
                self._fail(job.sender, "request cancelled by the client", "cancelled", job.method, "CANCELLED")
        load = len(self.pool.rows) + sum(len(j.reqs) for j in pending)
        spec = []
        for j in pending:
            j.plain = j.method != "baseline" and speculation_off(self.bundle, j.method, load, j.disable_at_batch)
            if j.method != "baseline" and not j.plain:
                spec.append(j)
        if spec and not self.pool.rows:
            key = self._group(spec[0])
            rows = []
            for j in self._pack([j for j in spec if self._group(j) == key], self.max_batch_size):
                pending.remove(j)
                j.rows, j.results = [Row(j, i) for i in range(len(j.reqs))], [None] * len(j.reqs)
                rows += j.rows
            self._run(key, rows)
            return
        if spec and self._join(self._group(spec[0]), spec):
            return
        if not pending and self._resume():
            return
        if not spec:
            for job in list(pending):
                if len(job.reqs) > self.pool.free:
                    break
                pending.remove(job)
                job.rows = [Row(job, i) for i in range(len(job.reqs))]
                job.results = [None] * len(job.reqs)
                self._finished(self.pool.admit(job.reqs, job.rows, self._emit))
        if self.pool.rows:
            for t in self.pool.tags():
                if t.job.method != "baseline":
                    t.plain = t.job.plain = True  # a speculative request decoding plainly, wholly or in part
            self._finished(self.pool.step(self._emit))

    @staticmethod
    def _group(job: Job) -> tuple:
        """Requests that can share one speculative batch: (method, k, use_draft_logits, disable_at_batch)."""
        return job.method, job.k, job.use_draft_logits, job.disable_at_batch

    def _resumable(self, key: tuple, rows: int) -> bool:
        """Every row of the continuous batch belongs to group `key`, which can continue handed-off rows
        (draft_target, prompt_lookup, medusa), and `rows` of them stay below its disable_at_batch."""
        from pipeline.runtime.decode import speculation_off

        return (_resumable_method(key[0]) and all(self._group(t.job) == key for t in self.pool.tags())
                and not speculation_off(self.bundle, key[0], rows, key[3]))

    def _resume(self) -> bool:
        """With nothing waiting, take the continuous batch's rows back into speculation when they all belong to
        one resumable group and are fewer than its disable_at_batch."""
        tags = self.pool.tags()
        keys = {self._group(t.job) for t in tags}
        if len(keys) != 1:
            return False
        key = keys.pop()
        if not self._resumable(key, len(tags)):
            return False
        self._speculate_pool(key)
        return True

    def _join(self, key: tuple, spec: list[Job]) -> bool:
        """Speculative batching across arrivals: when the continuous batch holds only rows of group `key` (a
        speculative batch that yielded for the newcomers), admit the waiting jobs of that group next to them
        (prefill and first token), then speculate on all of them together."""
        if not self.pool.rows:
            return False
        jobs = [j for j in spec if self._group(j) == key]
        jobs = self._pack(jobs, self.pool.free) if jobs and len(jobs[0].reqs) <= self.pool.free else []
        if not jobs or not self._resumable(key, len(self.pool.rows) + sum(len(j.reqs) for j in jobs)):
            return False
        for job in jobs:
            self.waiting.remove(job)
            job.rows, job.results = [Row(job, i) for i in range(len(job.reqs))], [None] * len(job.reqs)
            self._finished(self.pool.admit(job.reqs, job.rows, self._emit))
        if self.pool.rows:
            self._speculate_pool(key)
        return True

    def _speculate_pool(self, key: tuple) -> None:
        """Release every row of the continuous batch into one speculative batch of group `key`; rows that were
        plain because of the load count as resumed."""
        back = self.pool.release(lambda t: True)
        rows = [t for t, _ in back]
        if any(r.plain for r in rows):
            self._count("resumed", key[0], sum(r.plain for r in rows))
        for r in rows:
            r.plain = False
        self._run(key, rows, [h for _, h in back])

    def _emit(self, row: Row, toks: list[int]) -> None:
        row.tokens.extend(toks)
        job = row.job
        if self._is_cancelled(job) or not job.stream:
            return
        self._stream(job, row)

    def _stream(self, job: Job, row: Row) -> None:
        """Send the new text of a streamed row, decoding only a window of recent tokens (a long stream
        costs linear time, not quadratic); hold back a trailing partial UTF-8 character."""
        before = self._decode_text(row.tokens[row.prefix:row.read])
        text = self._decode_text(row.tokens[row.prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd") or not text.startswith(before):
            return
        piece = text[len(before):]
        row.sent += piece
        row.prefix, row.read = row.read, len(row.tokens)
        try:
            self._send(job, [piece])
        except Exception:  # noqa: BLE001 - the client went away: treat as cancelled
            job.cancelled = True

    def _finished(self, done: list) -> None:
        for row, result in done:
            job = row.job
            result.speculation_off = job.plain
            job.results[row.index] = result
            if all(r is not None for r in job.results):
                self._complete(job, job.method, job.results, job.rows)

    def _abort_pool(self, msg: str) -> None:
        from pipeline.runtime.batcher import ContinuousBatch

        jobs = {id(t.job): t.job for t in self.pool.tags()}
        self.pool = ContinuousBatch(self.bundle.target, self.max_batch_size)
        for job in jobs.values():
            self._fail(job.sender, msg, "errors", job.method)

    @staticmethod
    def _pack(jobs: list[Job], limit: int) -> list[Job]:
        out, n = [], 0
        for j in jobs:
            if out and n + len(j.reqs) > limit:
                break
            out.append(j)
            n += len(j.reqs)
        return out

    def _fail(self, sender, msg: str, counter: str, method: str, code: str | None = None) -> None:
        self._count(counter, method, 1)
        code = getattr(pb_utils.TritonError, code, None) if code else None
        err = pb_utils.TritonError(msg) if code is None else pb_utils.TritonError(msg, code)
        try:
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=err), flags=FINAL)
        except Exception as e:  # noqa: BLE001 - the client may be gone
            pb_utils.Logger.log_warn(f"could not send an error response: {e}")

    def _is_cancelled(self, job: Job) -> bool:
        if job.cancelled:
            return True
        now = time.monotonic()
        if now - job.checked_at < CANCEL_CHECK_S:
            return False
        job.checked_at = now
        try:
            job.cancelled = bool(job.sender.is_cancelled())
        except Exception:  # noqa: BLE001
            job.cancelled = bool(getattr(job.request, "is_cancelled", lambda: False)())
        return job.cancelled

    def _send(self, job: Job, texts: list[str], results=None, final: bool = False) -> None:
        out = [pb_utils.Tensor("text_output", np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_))]
        if results is not None and job.perf:
            col = lambda vals, dt: np.array([[v] for v in vals], dtype=dt)
            out += [
                pb_utils.Tensor("acceptance_rate", col([r.acceptance_rate for r in results], np.float32)),
                pb_utils.Tensor("total_accepted_draft_tokens", col([r.draft_accepted for r in results], np.int32)),
                pb_utils.Tensor("total_draft_tokens", col([r.draft_proposed for r in results], np.int32)),
                pb_utils.Tensor("num_input_tokens", col([r.num_input_tokens for r in results], np.int32)),
                pb_utils.Tensor("num_output_tokens", col([len(r.tokens) for r in results], np.int32)),
            ]
        job.sender.send(pb_utils.InferenceResponse(output_tensors=out), flags=FINAL if final else 0)

    def _decode_text(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _run(self, key: tuple, rows: list[Row], resume: list | None = None) -> None:
        """Decode `rows` (one speculative group) as a batch, from their prompts or, with `resume`, from the
        Handoffs the continuous batch released. Rows still running when requests arrive that bring the load
        to disable_at_batch move to the continuous batch; finished ones complete their jobs."""
        from pipeline.runtime.decode import decode
        from pipeline.runtime.generate import Handoff

        method, k, use_logits, disable_at_batch = key
        reqs = [r.job.reqs[r.index] for r in rows]
        jobs = list({id(r.job): r.job for r in rows}.values())

        def on_emit(b: int, toks: list[int]) -> None:
            row = rows[b]
            row.tokens.extend(toks)
            job = row.job
            if self._is_cancelled(job):
                # The runtime finishes this row at its next step; its batch-mates run on untouched.
                job.reqs[row.index].max_new_tokens = min(job.reqs[row.index].max_new_tokens, len(row.tokens) + 1)
                if all(r.job.cancelled for r in rows):
                    raise Cancelled()
                return
            if job.stream:
                self._stream(job, row)

        opts, runtime_method = {}, method
        if method == "draft_target":
            opts["use_draft_logits"] = use_logits
        if method == "medusa_typical":
            runtime_method, opts["acceptance"] = "medusa", "typical"
        if resume:
            opts["resume"] = resume
        answered: set[int] = set()

        def busy() -> bool:
            # Also yield once half the batch has finished, so the rest resume without the finished rows:
            # they would otherwise ride along in every verify pass until the longest row ends.
            return self._busy(key, len(rows) - len(answered)) or (
                _resumable_method(method) and bool(answered) and 2 * len(answered) >= len(rows))

        def on_finish(b: int, result) -> None:
            answered.add(b)  # a finished row is answered now, not when the batch's longest row ends
            self._finished([(rows[b], result)])

        try:
            results = decode(self.bundle, runtime_method, reqs, on_emit, num_draft_tokens=k or None,
                             disable_at_batch=disable_at_batch, yield_to=busy, on_finish=on_finish, **opts)
        except Cancelled:
            for j in self._unanswered(jobs):
                self._fail(j.sender, "request cancelled by the client", "cancelled", method, "CANCELLED")
            return
        except Exception as e:  # noqa: BLE001 - report to the clients, keep serving
            pb_utils.Logger.log_error(f"decode failed ({method}, k={k}): {type(e).__name__}: {e}")
            for j in self._unanswered(jobs):
                self._fail(j.sender, f"decoding failed ({method}): {type(e).__name__}: {e}", "errors", method)
            return
        handed = [(row, r) for row, r in zip(rows, results, strict=True) if isinstance(r, Handoff)]
        self.pool.adopt([h for _, h in handed], [row for row, _ in handed])
        self._finished([(row, r) for b, (row, r) in enumerate(zip(rows, results, strict=True))
                        if not isinstance(r, Handoff) and b not in answered])

    @staticmethod
    def _unanswered(jobs: list[Job]) -> list[Job]:
        """Jobs whose final response has not gone out (rows answered as they finished may have completed some)."""
        return [j for j in jobs if any(r is None for r in j.results)]

    def _complete(self, job: Job, method: str, res: list, rws: list[Row]) -> None:
        """Count a finished request and send its final response (or its cancellation)."""
        if job.cancelled:
            self._fail(job.sender, "request cancelled by the client", "cancelled", method, "CANCELLED")
            return
        for r in res:
            self._count("requests", method, 1)
            self._count("proposed", method, r.draft_proposed)
            self._count("accepted", method, r.draft_accepted)
            self._count("output", method, len(r.tokens))
            self._count("steps", method, r.steps)
            self._count("plain", method, int(r.speculation_off))
        texts = [self._decode_text(r.tokens) for r in res]
        if job.stream:
            texts = [t[len(rw.sent):] if t.startswith(rw.sent) else t for t, rw in zip(texts, rws)]
        elif not job.exclude_input:
            texts = [p + t for p, t in zip(job.texts, texts)]
        try:
            self._send(job, texts, res, final=True)
        except Exception as e:  # noqa: BLE001
            pb_utils.Logger.log_warn(f"could not send the final response: {e}")

    def finalize(self) -> None:
        self.stopping = True
        self.worker.join(timeout=10)
        self.bundle = None

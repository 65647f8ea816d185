"""The served model's scheduler: one worker thread decodes every request; no Triton import.

`pipeline/triton/model.py` (the Triton adapter) parses requests with `pipeline.triton.parse` and
hands each to `Scheduler.submit` with a `Responder`, the only way the scheduler answers: `send`
(text pieces, and the Results for the perf outputs), `error` (final, or a cancellation) and
`cancelled` (has the client gone). Tests drive the scheduler in-process with a fake Responder.

Plain requests (baseline, and speculative ones whose load reaches `disable_at_batch`) join a
continuous batch (`pipeline.runtime.batcher`): rows are admitted (all that fit, in one prefill)
and retired at every step. Speculative requests run as batches grouped by (method, draft length,
use_draft_logits, disable_at_batch) through `pipeline.runtime.decode.decode` when the continuous
batch is empty (new plain rows wait meanwhile, so neither kind starves). Between speculative rounds
the worker looks at what has arrived: once the load reaches `disable_at_batch`, the running rows
hand their KV cache over to the continuous batch and finish there, plainly, next to the newcomers;
below it, newcomers of the same group join the running batch: its rows step aside into the
continuous batch, the newcomers are prefilled next to them, and all speculate on together. Each row
is answered as it finishes.

Every scheduling round that decodes runs under the `gate` (pipeline/triton/gate.py: the step lock the
served models share, so their kernels never run at once), and a speculative batch pauses on it between
rounds, so the other model takes its step when it waits; without a gate (tests) nothing waits.

Faults: a row whose sampling fails in the continuous batch is answered with an error and leaves;
the others step on. A speculative batch that raises is not failed as a whole: its unanswered rows
are re-admitted to the continuous batch one by one, continuing after the tokens they already
emitted, so the row that caused it fails alone (or, if the fault was in speculation only, finishes
plainly). Only a failed forward step of the continuous batch fails its rows (`_abort_pool`), and
the server keeps serving. Cancellation: a cancelled client (gRPC cancel, deadline, disconnect) or a
`stop` request naming the request id stops its row at the next step; running rows are checked every
`CANCEL_CHECK_S`, queued ones every `QUEUED_CHECK_S` and once more as they are admitted (each check is
a round trip to Triton, so hundreds of queued requests must not be polled at every step).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pipeline.runtime.batcher import ContinuousBatch, RowFailure
from pipeline.triton.gate import NoGate
from pipeline.triton.parse import Parsed

CANCEL_CHECK_S = 0.02
QUEUED_CHECK_S = 1.0
QUEUED_POLLS_PER_S = 32.0  # a long queue is polled no more often than this in all (each poll is a round trip)
STOP_MEMORY_S = 120.0  # a `stop` may arrive before the request it names; remember it this long


class Responder(Protocol):
    def send(self, texts: list[str], results: list | None, final: bool) -> None: ...

    def error(self, message: str, cancelled: bool = False) -> None: ...

    def cancelled(self) -> bool: ...


# New tokens per method of the warm-up decode each served model runs before it reports ready (model parameter
# `warmup_tokens`; 0: none), on a prompt of up to WARMUP_PROMPT_TOKENS.
WARMUP_TOKENS = 32
WARMUP_PROMPT_TOKENS = 96
WARMUP_TEXT = ("Write a Python function that reads a CSV file of orders, groups the orders by customer, and returns "
               "the total amount per customer, sorted from the largest total to the smallest. Add type hints and a "
               "docstring, and explain how it handles a missing amount or a malformed line. ")


def warmup_request(bundle, new: int) -> tuple[list[int], int]:
    """The warm-up's prompt (a chat-formatted coding request, cut to fit the engine) and its token budget."""
    from pipeline.common import chat_ids

    bc = bundle.config["build_config"]
    max_in, max_seq = int(bc["max_input_len"]), int(bc["max_seq_len"])
    prompt = chat_ids(bundle.tokenizer, WARMUP_TEXT * 2)[: min(WARMUP_PROMPT_TOKENS, max(1, max_in // 2))]
    return prompt, max(1, min(new, max_seq - len(prompt) - bundle.max_draft_len - 2))


class Cancelled(Exception):
    """Every row of a speculative batch was cancelled by its client."""


@dataclass
class Job:
    """One request being served: what was parsed and how to answer it."""

    p: Parsed
    out: Responder
    cancelled: bool = False
    failed: bool = False  # answered with an error or a cancellation: its rows stop
    answered: bool = False  # its final response (or error) went out
    checked_at: float = 0.0
    rows: list = field(default_factory=list)
    results: list = field(default_factory=list)
    plain: bool = False  # a speculative request decoded plainly (load at or above disable_at_batch)

    @property
    def reqs(self) -> list:
        return self.p.reqs

    @property
    def method(self) -> str:
        return self.p.method

    @property
    def stream(self) -> bool:
        return self.p.stream

    @property
    def done(self) -> bool:
        return self.answered


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


def _log(level: str, msg: str) -> None:
    print(f"[{level}] {msg}", flush=True)


class Scheduler:
    def __init__(self, bundle, max_batch_size: int, count: Callable[[str, str, float], None] | None = None,
                 log: Callable[[str, str], None] = _log, gate=None):
        self.bundle, self.tok = bundle, bundle.tokenizer
        self.gate = gate or NoGate()  # held around every decoding step (pipeline.triton.gate)
        self.max_batch_size = max_batch_size
        self.count = count or (lambda what, method, value: None)
        self.log = log
        self.pool = ContinuousBatch(bundle.target, max_batch_size)
        self.inbox: queue.Queue = queue.Queue()
        self.waiting: list[Job] = []  # submitted jobs the worker has not started (worker thread only)
        self._stops: dict[str, float] = {}
        self._stops_lock = threading.Lock()
        self.stopping = False
        self.worker: threading.Thread | None = None
        self.cancel_check_s, self.queued_check_s = CANCEL_CHECK_S, QUEUED_CHECK_S

    # ---- the adapter's side ------------------------------------------------------------------------

    def start(self) -> Scheduler:
        self.worker = threading.Thread(target=self._serve, name="decode", daemon=True)
        self.worker.start()
        return self

    @classmethod
    def on_own_thread(cls, setup: Callable[[], Scheduler]) -> Scheduler:
        """Run `setup` (load the models, build the scheduler) on a new thread, then serve on that same thread.

        One thread must run every OpenMP region of the process. libgomp keeps a worker team per thread that
        starts parallel regions, and once the process holds more OpenMP threads than cores it stops spinning
        between regions and sleeps instead; a model loaded on one thread (torch's parallel copies) and decoded
        on another ran the int4 draft step ~40% slower on 2 cores (experiments/serving_log.md)."""
        box: dict = {}
        ready = threading.Event()

        def main() -> None:
            try:
                box["scheduler"] = sched = setup()
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                box["error"] = e
                ready.set()
                return
            ready.set()
            sched._serve()

        worker = threading.Thread(target=main, name="decode", daemon=True)
        worker.start()
        ready.wait()
        if "error" in box:
            raise box["error"]
        box["scheduler"].worker = worker
        return box["scheduler"]

    def warm_up(self, prompt: list[int], new: int, methods: list[str]) -> dict[str, float]:
        """Decode one request of `new` tokens per method through the serving path itself (the continuous batch, the
        speculative batches), answering nobody and counting nothing, before the model reports ready: what the first
        request would otherwise pay (the OpenMP team of this thread, first touch of the caches and the per-step
        buffers, lazily built tables, first calls into the kernels) is paid here. Returns seconds per method."""
        from pipeline.runtime.generate import Request

        class _Nobody:
            def send(self, texts, results, final) -> None:
                pass

            def error(self, message: str, cancelled: bool = False) -> None:
                pass

            def cancelled(self) -> bool:
                return False

        count, self.count = self.count, (lambda what, method, value: None)
        took = {}
        try:
            for m in methods:
                t = time.perf_counter()
                self.submit(Parsed(f"warm-up-{m}", texts=[""], reqs=[Request(list(prompt), new)], method=m),
                            _Nobody())
                while not self.idle():
                    self.tick()
                took[m] = time.perf_counter() - t
        finally:
            self.count = count
        return took

    def close(self, timeout: float = 10.0) -> None:
        self.stopping = True
        if self.worker is not None:
            self.worker.join(timeout=timeout)

    def submit(self, parsed: Parsed, out: Responder) -> None:
        """Queue a parsed request (any thread). A `stop` request marks its target at once; every response,
        its own included, goes out from the worker thread (the python backend's stub deadlocked when execute's
        thread sent a response while the worker sent pieces)."""
        if parsed.stop:
            now = time.monotonic()
            with self._stops_lock:
                self._stops = {k: t for k, t in self._stops.items() if now - t < STOP_MEMORY_S}
                self._stops[parsed.request_id] = now
            self.inbox.put(lambda: self._answer(out, lambda: out.send([], None, final=True)))
            return
        self.inbox.put(Job(parsed, out))

    def reject(self, out: Responder, message: str) -> None:
        """Answer a request the parser refused (any thread; sent from the worker)."""
        self.count("errors", "invalid", 1)
        self.inbox.put(lambda: self._answer(out, lambda: out.error(message)))

    def _answer(self, out: Responder, send: Callable[[], None]) -> None:
        try:
            send()
        except Exception as e:  # noqa: BLE001 - the client may be gone
            self.log("warn", f"could not send a response: {type(e).__name__}: {e}")

    # ---- the decode worker ---------------------------------------------------------------------------

    def _serve(self) -> None:
        while not self.stopping:
            self.tick(timeout=0.1)

    def tick(self, timeout: float = 0.0) -> bool:
        """One scheduling round (worker thread, or a test driving it); False when there was nothing to do."""
        if not self.waiting and not self.pool.rows:
            try:
                self._take(self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait())
            except queue.Empty:
                return False
        self._collect()
        if not self.waiting and not self.pool.rows:
            return True
        try:
            with self.gate:  # one step (or one speculative batch, which pauses between its rounds)
                self._schedule()
        except Exception as e:  # noqa: BLE001 - a failed step fails the rows it held; keep serving
            self.log("error", f"decode worker: {type(e).__name__}: {e}")
            self._abort_pool(f"decoding failed: {type(e).__name__}: {e}")
        return True

    def idle(self) -> bool:
        return not self.waiting and not self.pool.rows and self.inbox.empty()

    def _collect(self) -> None:
        """Move everything `submit` queued into the worker's waiting list (worker thread only)."""
        try:
            while True:
                self._take(self.inbox.get_nowait())
        except queue.Empty:
            pass

    def _take(self, item) -> None:
        if isinstance(item, Job):
            self.waiting.append(item)
        else:
            item()  # an answer to send from this thread

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
        every = max(self.queued_check_s, len(pending) / QUEUED_POLLS_PER_S)
        for job in [j for j in pending if self._is_cancelled(j, every)]:
            pending.remove(job)
            self._cancel(job)
        gone = {id(t.job) for t in self.pool.tags() if self._is_cancelled(t.job)}
        if gone:
            jobs = {id(t.job): t.job for t, _ in self.pool.remove(lambda t: id(t.job) in gone)}
            for job in jobs.values():
                self._cancel(job)
        load = len(self.pool.rows) + sum(len(j.reqs) for j in pending)
        spec = []
        for j in pending:
            j.plain = j.method != "baseline" and speculation_off(self.bundle, j.method, load, j.p.disable_at_batch)
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
            admit = []
            free = self.pool.free
            for job in list(pending):
                if len(job.reqs) > free:
                    break
                pending.remove(job)
                if self._is_cancelled(job, 0.0):  # asked afresh: a queued request is polled only every second
                    self._cancel(job)
                    continue
                job.rows, job.results = [Row(job, i) for i in range(len(job.reqs))], [None] * len(job.reqs)
                admit.append(job)
                free -= len(job.reqs)
            self._admit(admit)
        if self.pool.rows:
            for t in self.pool.tags():
                if t.job.method != "baseline":
                    t.plain = t.job.plain = True  # a speculative request decoding plainly, wholly or in part
            self._finished(self.pool.step(self._emit))

    def _admit(self, jobs: list[Job], prefixes: dict | None = None) -> None:
        """Prefill the jobs' rows into the continuous batch in one forward; if that fails, one job at a time,
        so a job whose prefill fails is answered with the error and the others are admitted."""
        if not jobs:
            return
        rows = [r for j in jobs for r in j.rows]
        pre = [(prefixes or {}).get(id(r), []) for r in rows]
        try:
            self._finished(self.pool.admit([r.job.reqs[r.index] for r in rows], rows, self._emit, pre))
            return
        except Exception as e:  # noqa: BLE001
            if len(jobs) == 1:
                self.log("error", f"prefill failed ({jobs[0].method}): {type(e).__name__}: {e}")
                self._fail(jobs[0], f"decoding failed ({jobs[0].method}): prefill: {type(e).__name__}: {e}")
                return
        for job in jobs:
            self._admit([job], prefixes)

    @staticmethod
    def _group(job: Job) -> tuple:
        """Requests that can share one speculative batch: (method, k, use_draft_logits, disable_at_batch)."""
        return job.method, job.p.k, job.p.use_draft_logits, job.p.disable_at_batch

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
        self._admit(jobs)
        if self.pool.rows:
            self._speculate_pool(key)
        return True

    def _speculate_pool(self, key: tuple) -> None:
        """Release every row of the continuous batch into one speculative batch of group `key`; rows that were
        plain because of the load count as resumed."""
        back = self.pool.release(lambda t: True)
        rows = [t for t, _ in back]
        if any(r.plain for r in rows):
            self.count("resumed", key[0], sum(r.plain for r in rows))
        for r in rows:
            r.plain = False
        self._run(key, rows, [h for _, h in back])

    def _emit(self, row: Row, toks: list[int]) -> None:
        row.tokens.extend(toks)
        job = row.job
        if job.failed or self._is_cancelled(job) or not job.stream:
            return
        self._stream(job, row)

    def _stream(self, job: Job, row: Row) -> None:
        """Send the new text of a streamed row, decoding only a window of recent tokens (a long stream
        costs linear time, not quadratic); hold back a trailing partial UTF-8 character."""
        before = self._decode_text(row.tokens[row.prefix:row.read])
        piece_text = self._decode_text(row.tokens[row.prefix:])
        if len(piece_text) <= len(before) or piece_text.endswith("\ufffd") or not piece_text.startswith(before):
            return
        piece = piece_text[len(before):]
        row.sent += piece
        row.prefix, row.read = row.read, len(row.tokens)
        try:
            job.out.send([piece], None, final=False)
        except Exception as e:  # noqa: BLE001 - the client went away: stop its work as for a cancel
            self.log("warn", f"request {job.p.request_id or '(no id)'}: could not send a piece ({type(e).__name__}: "
                     f"{e}); treating it as cancelled")
            job.cancelled = True

    def _finished(self, done: list) -> None:
        """Results (or RowFailures) from the runtime: complete the jobs whose rows are all done."""
        for row, result in done:
            job = row.job
            if job.answered:
                continue
            if isinstance(result, RowFailure):
                self.log("error", f"request {job.p.request_id or '(no id)'} row {row.index} failed ({job.method}): "
                         f"{result}")
                self._fail(job, f"decoding failed ({job.method}): {result}")
                self.pool.remove(lambda t, job=job: t.job is job)  # its other rows stop costing work
                continue
            result.speculation_off = job.plain
            job.results[row.index] = result
            if all(r is not None for r in job.results):
                self._complete(job)

    def _abort_pool(self, msg: str) -> None:
        """A continuous-batch step failed: its rows' cache can no longer be trusted; answer them with `msg`."""
        jobs = {id(t.job): t.job for t in self.pool.clear()}
        self.pool = ContinuousBatch(self.bundle.target, self.max_batch_size)
        for job in jobs.values():
            if not job.done:
                self._fail(job, msg)

    @staticmethod
    def _pack(jobs: list[Job], limit: int) -> list[Job]:
        out, n = [], 0
        for j in jobs:
            if out and n + len(j.reqs) > limit:
                break
            out.append(j)
            n += len(j.reqs)
        return out

    def _answer_error(self, job: Job, msg: str, cancelled: bool) -> None:
        try:
            job.out.error(msg, cancelled)
        except Exception as e:  # noqa: BLE001 - the client may be gone
            self.log("warn", f"request {job.p.request_id or '(no id)'}: could not send an error response: {e}")

    def _fail(self, job: Job, msg: str) -> None:
        if job.answered:
            return
        job.answered = job.failed = True
        self.count("errors", job.method, 1)
        self._answer_error(job, msg, False)

    def _cancel(self, job: Job) -> None:
        if job.answered:
            return
        job.answered = job.failed = True
        self.count("cancelled", job.method, 1)
        self.count("cancelled_tokens", job.method, sum(len(r.tokens) for r in job.rows))
        self._answer_error(job, "request cancelled by the client", True)

    def _stopped(self, job: Job) -> bool:
        rid = job.p.request_id
        if not rid or not self._stops:
            return False
        with self._stops_lock:
            return rid in self._stops

    def _is_cancelled(self, job: Job, every: float | None = None) -> bool:
        if job.cancelled or job.answered:  # never ask Triton about a request answered already: it is freed
            return True
        now = time.monotonic()
        if now - job.checked_at < (self.cancel_check_s if every is None else every):
            return False
        job.checked_at = now
        if self._stopped(job):
            job.cancelled = True
            return True
        try:
            job.cancelled = bool(job.out.cancelled())
        except Exception as e:  # noqa: BLE001 - cannot ask Triton: the request is gone with its client
            self.log("warn", f"request {job.p.request_id or '(no id)'}: cancellation check failed "
                     f"({type(e).__name__}: {e}); treating it as cancelled")
            job.cancelled = True
        return job.cancelled

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

        def on_emit(b: int, toks: list[int]) -> None:
            row = rows[b]
            row.tokens.extend(toks)
            job = row.job
            if job.failed or self._is_cancelled(job):
                # The runtime finishes this row at its next step; its batch-mates run on untouched.
                job.reqs[row.index].max_new_tokens = min(job.reqs[row.index].max_new_tokens, len(row.tokens) + 1)
                if all(r.job.cancelled or r.job.failed for r in rows):
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
            self.gate.pause()  # between rounds: the other served model takes its step if it waits
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
            for j in {id(r.job): r.job for r in rows}.values():
                if j.cancelled:
                    self._cancel(j)  # no-op for a job already answered
            return
        except Exception as e:  # noqa: BLE001 - recover row by row, keep serving
            self.log("error", f"speculative batch failed ({method}, k={k}, {len(rows)} rows): {type(e).__name__}: "
                     f"{e}; continuing its rows one by one in the continuous batch")
            self._recover([r for b, r in enumerate(rows) if b not in answered])
            return
        handed = [(row, r) for row, r in zip(rows, results, strict=True) if isinstance(r, Handoff)]
        self.pool.adopt([h for _, h in handed], [row for row, _ in handed])
        self._finished([(row, r) for b, (row, r) in enumerate(zip(rows, results, strict=True))
                        if not isinstance(r, Handoff) and b not in answered])

    def _recover(self, rows: list[Row]) -> None:
        """The rows of a failed speculative batch continue plainly after the tokens they emitted, each admitted
        alone: the row whose fault it was fails by itself, the others finish (greedy: the same tokens)."""
        from pipeline.runtime.generate import Sequence, finish

        for row in rows:
            job = row.job
            if job.failed:
                continue
            if job.cancelled:
                self._cancel(job)
                continue
            req = job.reqs[row.index]
            if len(row.tokens) >= req.max_new_tokens:
                seq = Sequence(req)
                seq.tokens, seq.finish_reason = list(row.tokens), "length"
                self._finished([(row, finish([seq], time.perf_counter())[0])])
                continue
            if self.pool.free < 1:
                self._fail(job, f"decoding failed ({job.method}) and the continuous batch is full; retry")
                continue
            try:
                self._finished(self.pool.admit([req], [row], self._emit, [list(row.tokens)]))
            except Exception as e:  # noqa: BLE001
                self._fail(job, f"decoding failed ({job.method}): {type(e).__name__}: {e}")

    def _complete(self, job: Job) -> None:
        """Count a finished request and send its final response (or its cancellation)."""
        if job.answered:
            return
        if job.cancelled:
            self._cancel(job)
            return
        job.answered = True
        method, res = job.method, job.results
        for r in res:
            self.count("requests", method, 1)
            self.count("proposed", method, r.draft_proposed)
            self.count("accepted", method, r.draft_accepted)
            self.count("output", method, len(r.tokens))
            self.count("steps", method, r.steps)
            self.count("plain", method, int(r.speculation_off))
        texts = [self._decode_text(r.tokens) for r in res]
        if job.stream:
            texts = [t[len(rw.sent):] if t.startswith(rw.sent) else t for t, rw in zip(texts, job.rows)]
        elif not job.p.exclude_input:
            texts = [p + t for p, t in zip(job.p.texts, texts)]
        try:
            job.out.send(texts, res if job.p.perf else None, final=True)
        except Exception as e:  # noqa: BLE001
            self.log("warn", f"request {job.p.request_id or '(no id)'}: could not send the final response: {e}")

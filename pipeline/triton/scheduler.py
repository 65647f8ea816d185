"""The served model's scheduler: one worker thread decodes every request; no Triton import.

`pipeline/triton/model.py` (the Triton adapter) parses requests with `pipeline.triton.parse` and
hands each to `Scheduler.submit` with a `Responder`, the only way the scheduler answers: `send`
(text pieces, and the Results for the perf outputs), `error` (final, or a cancellation) and
`cancelled` (has the client gone), all of it through `Replies` (pipeline/triton/replies.py: responses,
counts and cancellation checks). Tests drive the scheduler in-process with a fake Responder.

Plain requests (baseline, and speculative ones whose load reaches `disable_at_batch` or, with `draft_length: load`,
the rows at which the load policy drafts nothing: `Scheduler.off`) join a
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

from pipeline.common import chat_ids
from pipeline.runtime.batcher import ContinuousBatch, RowFailure
from pipeline.runtime.decode import RESUMABLE, decode, plain_rows
from pipeline.runtime.generate import Handoff, Request, Sequence, finish
from pipeline.triton.gate import NoGate
from pipeline.triton.parse import Parsed
from pipeline.triton.replies import CANCEL_CHECK_S, Job, Replies, Responder, Row

__all__ = ["CANCEL_CHECK_S", "QUEUED_CHECK_S", "QUEUED_POLLS_PER_S", "Job", "Responder", "Row", "Scheduler"]

QUEUED_CHECK_S = 1.0
# Rows go back from the continuous batch into speculation only with at least this many tokens left a row on
# average: a resume copies their K/V out and has the draft catch up on each row's context (the flagship's 0.5B at
# about 2 ms a token: a 150-token chat prompt is some 10 target steps), which pays back only over tens of tokens.
# validate's curve at 4 clients of 32 tokens had resumed its last rows for their last few tokens at every level.
RESUME_MIN_LEFT = 32
QUEUED_POLLS_PER_S = 32.0  # a long queue is polled no more often than this in all (each poll is a round trip)


# New tokens per method of the warm-up decode each served model runs before it reports ready (model parameter
# `warmup_tokens`; 0: none), on a prompt of up to WARMUP_PROMPT_TOKENS.
WARMUP_TOKENS = 32
WARMUP_PROMPT_TOKENS = 96
WARMUP_TEXT = ("Write a Python function that reads a CSV file of orders, groups the orders by customer, and returns "
               "the total amount per customer, sorted from the largest total to the smallest. Add type hints and a "
               "docstring, and explain how it handles a missing amount or a malformed line. ")


def warmup_request(bundle, new: int) -> tuple[list[int], int]:
    """The warm-up's prompt (a chat-formatted coding request, cut to fit the engine) and its token budget."""

    bc = bundle.config["build_config"]
    max_in, max_seq = int(bc["max_input_len"]), int(bc["max_seq_len"])
    prompt = chat_ids(bundle.tokenizer, WARMUP_TEXT * 2)[: min(WARMUP_PROMPT_TOKENS, max(1, max_in // 2))]
    return prompt, max(1, min(new, max_seq - len(prompt) - bundle.max_draft_len - 2))


class _Nobody:
    """The warm-up's Responder: answers nobody."""

    def send(self, texts, results, final) -> None:
        pass

    def error(self, message: str, cancelled: bool = False) -> None:
        pass

    def cancelled(self) -> bool:
        return False


def _warm_up(sched: Scheduler, prompt: list[int], new: int, methods: list[str]) -> dict[str, float]:
    """Scheduler.warm_up: one request per method through the continuous batch and the speculative batches,
    answering nobody and counting nothing, before the model reports ready. What the first request would otherwise
    pay (the OpenMP team of this thread, first touch of the caches and the per-step buffers, lazily built tables,
    first calls into the kernels) is paid here. Returns seconds per method."""

    count, sched.replies.count = sched.replies.count, (lambda what, method, value: None)
    took = {}
    try:
        for m in methods:
            t = time.perf_counter()
            sched.submit(Parsed(f"warm-up-{m}", texts=[""], reqs=[Request(list(prompt), new)], method=m), _Nobody())
            while sched.waiting or sched.pool.busy or not sched.inbox.empty():
                sched.tick()
            took[m] = time.perf_counter() - t
    finally:
        sched.replies.count = count
    return took


class Cancelled(Exception):
    """Every row of a speculative batch was cancelled by its client."""


def _resumable_method(method: str) -> bool:
    """Rows of this method can step aside into the continuous batch and speculate again (`resume=`)."""
    return method in RESUMABLE or method == "medusa_typical"


def group(job: Job) -> tuple:
    """Requests that can share one speculative batch: (method, k, use_draft_logits, disable_at_batch)."""
    return job.method, job.p.k, job.p.use_draft_logits, job.p.disable_at_batch


def pack(jobs: list[Job], limit: int) -> list[Job]:
    """The leading jobs whose rows fit in `limit` (at least the first)."""
    out, n = [], 0
    for j in jobs:
        if out and n + len(j.reqs) > limit:
            break
        out.append(j)
        n += len(j.reqs)
    return out


def _runtime_options(method: str, use_logits: bool, resume: list | None) -> tuple[str, dict]:
    """The runtime method and decode options of a speculative group (medusa_typical is Medusa's typical rule)."""
    opts, runtime_method = {}, method
    if method in ("draft_target", "hybrid"):
        opts["use_draft_logits"] = use_logits
    if method == "medusa_typical":
        runtime_method, opts["acceptance"] = "medusa", "typical"
    if resume:
        opts["resume"] = resume
    return runtime_method, opts


def _log(level: str, msg: str) -> None:
    print(f"[{level}] {msg}", flush=True)


class Scheduler:
    """The served model's queue and its one decode worker: `submit` (any thread) queues, `tick` (the worker) runs
    one scheduling round (`_schedule_round`), `_finished` answers the jobs whose rows are all done."""

    def __init__(self, bundle, max_batch_size: int, count: Callable[[str, str, float], None] | None = None,
                 log: Callable[[str, str], None] = _log, gate=None):
        self.bundle = bundle
        self.gate = gate or NoGate()  # held around every decoding step (pipeline.triton.gate)
        self.max_batch_size = max_batch_size
        self.log = log
        self.replies = Replies(bundle.tokenizer, count or (lambda what, method, value: None), log)
        self.kv_bytes, self.prefill_chunk = 0, 0  # spec kv_cache: configure_kv
        self.pool = ContinuousBatch(bundle.target, max_batch_size, prompt_cache=bundle.prompt_cache)
        self.inbox: queue.Queue = queue.Queue()
        self.waiting: list[Job] = []  # submitted jobs the worker has not started (worker thread only)
        self.stopping = False
        self.worker: threading.Thread | None = None
        self.queued_check_s = QUEUED_CHECK_S
        self._plain_from: dict[str, int | None] = {}  # method -> rows from which the load policy drafts nothing

    def off(self, method: str, rows: int, disable_at_batch: int | None, resuming: bool = False) -> bool:
        """Should `rows` requests of `method` decode plainly? At the spec's or the request's `disable_at_batch`; and,
        for a method whose rounds take the load policy (`draft_length: load`), from the rows at which the policy
        drafts nothing (`decode.plain_rows`: a chain drafter's stored costs and prior acceptance, Medusa's tree as its
        build timed it), whatever disable_at_batch
        says: there a speculative batch would only step plainly, and the continuous batch admits and retires rows
        at every step where a speculative batch does not (`experiments/closed_loop.py`, 4 clients of the flagship's
        default method: 1.04-1.05x baseline against 0.97-1.00x without this). `resuming` (rows taken back from
        the continuous batch): the policy's rows count as off above half that point, a band against flapping: closed-
        loop clients at 4 rows had resumed at every finish (3 rows), the draft catching up on every row, and handed
        off again at the next arrival (validate's curve at 4 clients: hybrid 0.86x baseline)."""
        if self.bundle.spec.off_at(method, rows, disable_at_batch):
            return True
        if method == "baseline" or self.bundle.spec.draft_length != "load":
            return False
        if method not in self._plain_from:
            runtime_method = _runtime_options(method, False, None)[0]  # medusa_typical runs Medusa's rounds
            self._plain_from[method] = plain_rows(self.bundle, runtime_method, self.max_batch_size)
        at = self._plain_from[method]
        return at is not None and (rows > at // 2 if resuming else rows >= at)

    @property
    def cancel_check_s(self) -> float:
        """How often a running request's client is asked whether it is still there."""
        return self.replies.cancel_check_s

    @cancel_check_s.setter
    def cancel_check_s(self, seconds: float) -> None:
        self.replies.cancel_check_s = seconds

    # ---- the adapter's side ------------------------------------------------------------------------

    def start(self) -> Scheduler:
        self.worker = threading.Thread(target=self._serve, name="decode", daemon=True)
        self.worker.start()
        return self

    @classmethod
    def on_own_thread(cls, setup: Callable[[], Scheduler]) -> Scheduler:
        """Run `setup` (load the models, build the scheduler) on a new thread, then serve on that same thread
        (why one thread: _serve_on_own_thread)."""
        return _serve_on_own_thread(setup)

    def warm_up(self, prompt: list[int], new: int, methods: list[str]) -> dict[str, float]:
        """Decode one request of `new` tokens per method through the serving path itself, answering nobody and
        counting nothing, before the model reports ready (what the first request would otherwise pay: _warm_up).
        Returns seconds per method."""
        return _warm_up(self, prompt, new, methods)

    def use_prompt_cache(self, cache) -> None:
        """Serve with this prompt cache (pipeline/runtime/prompt_cache.py; None: none) from the next request on: every
        method's prefill and the continuous batch share it."""
        self.bundle.prompt_cache = self.pool.prompt_cache = self.replies.prompt_cache = cache

    def configure_kv(self, kv_bytes: int, prefill_chunk: int) -> None:
        """Spec `kv_cache`: the running rows' K/V byte budget the continuous batch admits within, and the prompt
        tokens it prefills per step beside running rows (0: a prompt runs whole when admitted)."""
        self.kv_bytes, self.prefill_chunk = kv_bytes, prefill_chunk
        self.pool.kv_bytes, self.pool.prefill_chunk = kv_bytes, prefill_chunk

    def close(self, timeout: float = 10.0) -> None:
        self.stopping = True
        if self.worker is not None:
            self.worker.join(timeout=timeout)

    def submit(self, parsed: Parsed, out: Responder) -> None:
        """Queue a parsed request (any thread). A `stop` request marks its target at once; every response,
        its own included, goes out from the worker thread (the python backend's stub deadlocked when execute's
        thread sent a response while the worker sent pieces)."""
        if parsed.stop:
            self.replies.remember_stop(parsed.request_id)
            self.inbox.put(lambda: self.replies.send(out, lambda: out.send([], None, final=True)))
            return
        self.inbox.put(Job(parsed, out))

    def reject(self, out: Responder, message: str) -> None:
        """Answer a request the parser refused (any thread; sent from the worker)."""
        self.replies.count("errors", "invalid", 1)
        self.inbox.put(lambda: self.replies.send(out, lambda: out.error(message)))

    # ---- the decode worker: one scheduling round -----------------------------------------------------

    def _serve(self) -> None:
        while not self.stopping:
            self.tick(timeout=0.1)

    def tick(self, timeout: float = 0.0) -> bool:
        """One scheduling round (worker thread, or a test driving it); False when there was nothing to do."""
        if not self.waiting and not self.pool.busy:
            try:
                self._take(self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait())
            except queue.Empty:
                return False
        self._collect()
        if not self.waiting and not self.pool.busy:
            return True
        try:
            with self.gate:  # one step (or one speculative batch, which pauses between its rounds)
                _schedule_round(self)
        except Exception as e:  # noqa: BLE001 - a failed step fails the rows it held; keep serving
            self.log("error", f"decode worker: {type(e).__name__}: {e}")
            self._abort_pool(f"decoding failed: {type(e).__name__}: {e}")
        return True

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

    # ---- results from the runtime ----------------------------------------------------------------------

    def _emit(self, row: Row, toks: list[int]) -> None:
        row.tokens.extend(toks)
        job = row.job
        if job.failed or self.replies.is_cancelled(job) or not job.stream:
            return
        self.replies.stream(job, row)

    def _finished(self, done: list) -> None:
        """Results (or RowFailures) from the runtime: complete the jobs whose rows are all done."""
        for row, result in done:
            job = row.job
            if job.answered:
                continue
            if isinstance(result, RowFailure):
                self.log("error", f"request {job.p.request_id or '(no id)'} row {row.index} failed ({job.method}): "
                         f"{result}")
                self.replies.fail(job, f"decoding failed ({job.method}): {result}")
                self.pool.remove(lambda t, job=job: t.job is job)  # its other rows stop costing work
                continue
            result.speculation_off = job.plain
            job.results[row.index] = result
            if all(r is not None for r in job.results):
                self.replies.complete(job)

    def _abort_pool(self, msg: str) -> None:
        """A continuous-batch step failed: its rows' cache can no longer be trusted; answer them with `msg`."""
        jobs = {id(t.job): t.job for t in self.pool.clear()}
        self.pool = ContinuousBatch(self.bundle.target, self.max_batch_size, prompt_cache=self.bundle.prompt_cache,
                                    kv_bytes=self.kv_bytes, prefill_chunk=self.prefill_chunk)
        for job in jobs.values():
            if not job.done:
                self.replies.fail(job, msg)


def _serve_on_own_thread(setup: Callable[[], Scheduler]) -> Scheduler:
    """Scheduler.on_own_thread: run `setup` on a new thread, then serve on that same thread; an error in `setup` is
    raised on the caller's.

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


# ---- one scheduling round: where each waiting job goes (worker thread only) ------------------------------


def _schedule_round(sched: Scheduler) -> None:
    """One scheduling round: drop cancelled work, then run a speculative batch or one continuous step."""
    _drop_cancelled(sched)
    spec = _speculative_waiting(sched)
    if spec and not sched.pool.busy:
        _start_speculative(sched, spec)
        return
    if spec and _join(sched, group(spec[0]), spec):
        return
    if not sched.waiting and _resume(sched):
        return
    if not spec or _other_group_running(sched, spec):
        _admit_waiting(sched)
    if sched.pool.busy:
        _step_pool(sched)


def _other_group_running(sched: Scheduler, spec: list[Job]) -> bool:
    """The continuous batch holds speculative rows (handed off by a batch that yielded) and a waiting speculative
    job is of another group: it joins them plainly rather than wait for their longest row (fairness); they all
    speculate again once one group is left (_resume)."""
    keys = {group(t.job) for t in sched.pool.tags() if t.job.method != "baseline"}
    return bool(keys) and any(group(j) not in keys for j in spec)


def _drop_cancelled(sched: Scheduler) -> None:
    """Answer the waiting and running jobs whose clients have gone; their rows stop costing work."""
    pending = sched.waiting
    every = max(sched.queued_check_s, len(pending) / QUEUED_POLLS_PER_S)
    for job in [j for j in pending if sched.replies.is_cancelled(j, every)]:
        pending.remove(job)
        sched.replies.cancel(job)
    gone = {id(t.job) for t in sched.pool.tags() if sched.replies.is_cancelled(t.job)}
    if gone:
        jobs = {id(t.job): t.job for t, _ in sched.pool.remove(lambda t: id(t.job) in gone)}
        for job in jobs.values():
            sched.replies.cancel(job)


def _speculative_waiting(sched: Scheduler) -> list[Job]:
    """The waiting jobs that speculate at the current load (the others decode plainly: `job.plain`)."""
    load = sched.pool.load + sum(len(j.reqs) for j in sched.waiting)
    spec = []
    for j in list(sched.waiting):
        try:
            j.plain = j.method != "baseline" and sched.off(j.method, load, j.p.disable_at_batch)
        except Exception as e:  # noqa: BLE001 - a request the scheduler cannot place fails alone; the others go on
            sched.waiting.remove(j)
            sched.log("error", f"scheduling a {j.method} request: {type(e).__name__}: {e}")
            sched.replies.fail(j, f"the server could not schedule method {j.method!r} ({type(e).__name__}: {e})")
            continue
        if j.method != "baseline" and not j.plain:
            spec.append(j)
    return spec


def _step_pool(sched: Scheduler) -> None:
    """One step of the continuous batch."""
    for t in sched.pool.tags():
        if t.job.method != "baseline":
            t.plain = t.job.plain = True  # a speculative request decoding plainly, wholly or in part
    sched._finished(sched.pool.step(sched._emit))


def _start_speculative(sched: Scheduler, spec: list[Job]) -> None:
    """The continuous batch is empty: run the first waiting speculative group (as many as fit) as a batch."""
    key = group(spec[0])
    rows = []
    for j in pack([j for j in spec if group(j) == key], sched.max_batch_size):
        sched.waiting.remove(j)
        rows += j.start()
    SpeculativeBatch(sched, key, rows).run()


def _admit_waiting(sched: Scheduler) -> None:
    """Admit waiting jobs, in order, while their rows fit in the continuous batch."""
    admit = []
    free = sched.pool.free
    for job in list(sched.waiting):
        if len(job.reqs) > free or not sched.pool.fits([r for j in admit for r in j.reqs] + job.reqs):
            break  # rows, or the K/V byte budget (kv_cache.bytes): it waits for rows to finish
        sched.waiting.remove(job)
        if sched.replies.is_cancelled(job, 0.0):  # asked afresh: a queued request is polled only every second
            sched.replies.cancel(job)
            continue
        job.start()
        admit.append(job)
        free -= len(job.reqs)
    _admit(sched, admit)


def _admit(sched: Scheduler, jobs: list[Job], prefixes: dict | None = None, chunked: bool = True) -> None:
    """Prefill the jobs' rows into the continuous batch in one forward; if that fails, one job at a time,
    so a job whose prefill fails is answered with the error and the others are admitted."""
    if not jobs:
        return
    rows = [r for j in jobs for r in j.rows]
    pre = [(prefixes or {}).get(id(r), []) for r in rows]
    try:
        sched._finished(sched.pool.admit([r.job.reqs[r.index] for r in rows], rows, sched._emit, pre, chunked))
        return
    except Exception as e:  # noqa: BLE001
        if len(jobs) == 1:
            sched.log("error", f"prefill failed ({jobs[0].method}): {type(e).__name__}: {e}")
            sched.replies.fail(jobs[0], f"decoding failed ({jobs[0].method}): prefill: {type(e).__name__}: {e}")
            return
    for job in jobs:
        _admit(sched, [job], prefixes, chunked)


def _resumable(sched: Scheduler, key: tuple, rows: int, resuming: bool = False) -> bool:
    """Every row of the continuous batch belongs to group `key`, which can continue handed-off rows
    (draft_target, prompt_lookup, medusa, suffix, hybrid), and `rows` of them still speculate (`Scheduler.off`)."""
    return (_resumable_method(key[0]) and all(group(t.job) == key for t in sched.pool.tags())
            and not sched.off(key[0], rows, key[3], resuming))


def _resume(sched: Scheduler) -> bool:
    """With nothing waiting, take the continuous batch's rows back into speculation when they all belong to
    one resumable group that speculates at their number (`Scheduler.off`, resuming) and they have RESUME_MIN_LEFT
    tokens a row left on average."""
    tags = sched.pool.tags()
    if sched.pool.pending:  # a prompt is being prefilled beside the running rows: they stay until it joins
        return False
    keys = {group(t.job) for t in tags}
    if len(keys) != 1:
        return False
    key = keys.pop()
    left = sum(max(0, r.seq.req.max_new_tokens - len(r.seq.tokens)) for r in sched.pool.rows)
    if left < RESUME_MIN_LEFT * len(sched.pool.rows) or not _resumable(sched, key, len(tags), resuming=True):
        return False
    _speculate_pool(sched, key)
    return True


def _join(sched: Scheduler, key: tuple, spec: list[Job]) -> bool:
    """Speculative batching across arrivals: when the continuous batch holds only rows of group `key` (a
    speculative batch that yielded for the newcomers), admit the waiting jobs of that group next to them
    (prefill and first token), then speculate on all of them together."""
    if not sched.pool.rows or sched.pool.pending:
        return False
    jobs = [j for j in spec if group(j) == key]
    jobs = pack(jobs, sched.pool.free) if jobs and len(jobs[0].reqs) <= sched.pool.free else []
    if not jobs or not _resumable(sched, key, len(sched.pool.rows) + sum(len(j.reqs) for j in jobs)):
        return False
    for job in jobs:
        sched.waiting.remove(job)
        job.start()
    # They speculate with the running rows next: prefilled now, unless a prompt is longer than the prefill chunk
    # (kv_cache.prefill_chunk): then in chunks beside the running rows' plain steps, so a burst of long prompts
    # does not stall the streams, and the rows speculate again once it has joined (_resume).
    chunk = sched.prefill_chunk
    _admit(sched, jobs, chunked=bool(chunk) and any(len(r.prompt) > chunk for j in jobs for r in j.reqs))
    if sched.pool.rows and not sched.pool.pending:
        _speculate_pool(sched, key)
    return True


def _speculate_pool(sched: Scheduler, key: tuple) -> None:
    """Release every row of the continuous batch into one speculative batch of group `key`; rows that were
    plain because of the load count as resumed."""
    back = sched.pool.release(lambda t: True)
    rows = [t for t, _ in back]
    if any(r.plain for r in rows):
        sched.replies.count("resumed", key[0], sum(r.plain for r in rows))
    for r in rows:
        r.plain = False
    SpeculativeBatch(sched, key, rows).run([h for _, h in back])


# ---- a speculative batch -------------------------------------------------------------------------------


class SpeculativeBatch:
    """One speculative batch of the scheduler: `rows` of group `key` decoded together through `decode`, from
    their prompts or, with `resume`, from the Handoffs the continuous batch released. Each row is answered as
    it finishes; rows still running when requests arrive that bring the load to disable_at_batch (or that can
    join the batch) move to the continuous batch; a failure continues the unanswered rows there one by one."""

    def __init__(self, sched: Scheduler, key: tuple, rows: list[Row]):
        self.sched, self.key, self.rows = sched, key, rows
        self.answered: set[int] = set()

    def on_emit(self, b: int, toks: list[int]) -> None:
        row = self.rows[b]
        row.tokens.extend(toks)
        job = row.job
        if job.failed or self.sched.replies.is_cancelled(job):
            # The runtime finishes this row at its next step; its batch-mates run on untouched.
            job.reqs[row.index].max_new_tokens = min(job.reqs[row.index].max_new_tokens, len(row.tokens) + 1)
            if all(r.job.cancelled or r.job.failed for r in self.rows):
                raise Cancelled()
            return
        if job.stream:
            self.sched.replies.stream(job, row)

    def yield_to(self) -> bool:
        """Between rounds: should the running rows step aside into the continuous batch?"""
        self.sched.gate.pause()  # the other served model takes its step if it waits
        # Also yield once half the batch has finished, so the rest resume without the finished rows:
        # they would otherwise ride along in every verify pass until the longest row ends.
        done, n = len(self.answered), len(self.rows)
        return self._busy(n - done) or (_resumable_method(self.key[0]) and done > 0 and 2 * done >= n)

    def _busy(self, rows: int) -> bool:
        """Polled between speculative rounds: have requests arrived that bring the load to disable_at_batch
        (the rows go plain), or that can join this batch (same group, resumable, room left)?"""
        sched, key = self.sched, self.key
        sched._collect()
        if not sched.waiting:
            return False
        method, disable_at_batch = key[0], key[3]
        if sched.off(method, rows + sum(len(j.reqs) for j in sched.waiting), disable_at_batch):
            return True
        # Fairness: a request of another group (baseline, another k or method) never waits for this batch's
        # longest row; the rows step aside and decode beside it in the continuous batch, speculating again once it
        # is gone (_resume).
        return any(not j.cancelled and (group(j) != key or _resumable_method(method))
                   and rows + len(j.reqs) <= sched.max_batch_size for j in sched.waiting)

    def on_finish(self, b: int, result) -> None:
        self.answered.add(b)  # a finished row is answered now, not when the batch's longest row ends
        self.sched._finished([(self.rows[b], result)])

    def run(self, resume: list | None = None) -> None:
        sched, rows = self.sched, self.rows
        method, k, use_logits, disable_at_batch = self.key
        runtime_method, opts = _runtime_options(method, use_logits, resume)
        try:
            results = decode(sched.bundle, runtime_method, [r.job.reqs[r.index] for r in rows], self.on_emit,
                             num_draft_tokens=k or None, disable_at_batch=disable_at_batch, yield_to=self.yield_to,
                             on_finish=self.on_finish, **opts)
        except Cancelled:
            for j in {id(r.job): r.job for r in rows}.values():
                if j.cancelled:
                    sched.replies.cancel(j)  # no-op for a job already answered
            return
        except Exception as e:  # noqa: BLE001 - recover row by row, keep serving
            sched.log("error", f"speculative batch failed ({method}, k={k}, {len(rows)} rows): {type(e).__name__}: "
                      f"{e}; continuing its rows one by one in the continuous batch")
            self._recover([r for b, r in enumerate(rows) if b not in self.answered])
            return
        handed = [(row, r) for row, r in zip(rows, results, strict=True) if isinstance(r, Handoff)]
        sched.pool.adopt([h for _, h in handed], [row for row, _ in handed])
        sched._finished([(row, r) for b, (row, r) in enumerate(zip(rows, results, strict=True))
                         if not isinstance(r, Handoff) and b not in self.answered])

    def _recover(self, rows: list[Row]) -> None:
        """The rows of a failed speculative batch continue plainly after the tokens they emitted, each admitted
        alone: the row whose fault it was fails by itself, the others finish (greedy: the same tokens)."""
        sched = self.sched
        for row in rows:
            job = row.job
            if job.failed:
                continue
            if job.cancelled:
                sched.replies.cancel(job)
                continue
            req = job.reqs[row.index]
            if len(row.tokens) >= req.max_new_tokens:
                seq = Sequence(req)
                seq.tokens, seq.finish_reason = list(row.tokens), "length"
                sched._finished([(row, finish([seq], time.perf_counter())[0])])
                continue
            if sched.pool.free < 1:
                sched.replies.fail(job, f"decoding failed ({job.method}) and the continuous batch is full; retry")
                continue
            try:
                sched._finished(sched.pool.admit([req], [row], sched._emit, [list(row.tokens)]))
            except Exception as e:  # noqa: BLE001
                sched.replies.fail(job, f"decoding failed ({job.method}): {type(e).__name__}: {e}")

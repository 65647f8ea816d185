"""Responses and cancellation for the served model's scheduler (pipeline/triton/scheduler.py); no Triton import.

`Replies` is the only part of the scheduler that talks to clients: it streams a row's new text, sends a
job's final response or its error, counts what it answers, and answers whether a client has gone (gRPC
cancel, deadline, disconnect, or a `stop` request naming the request id), polling Triton no more often
than `cancel_check_s` per request (each check is a round trip). `Outbox` and `PostedResponder` take those round
trips off the decode thread (the served model wraps each request's responder in one).
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pipeline.triton.parse import Parsed

try:  # a fast tokenizer's incremental decoder (tokenizers 0.21+, transformers' own dependency)
    from tokenizers.decoders import DecodeStream
except ImportError:  # older tokenizers: Replies.stream decodes windows of tokens instead
    DecodeStream = None

CANCEL_CHECK_S = 0.02
# A streamed piece goes out at most this often per request (spec `triton.stream_interval_ms`, written into each served
# model's parameters); pieces that come sooner are held and joined to the next (the first at once, a held one within
# this of the last send). Each piece is a round trip through Triton's python backend, the server and the client's gRPC
# stream, on the cores that decode, about 1.4 ms of a 2-core Zen 4's time: SmolLM2-135M's baseline streamed 16% slower
# than it answered unstreamed with a piece a token (129 a request), 7% at 20 ms (27) and 3% at 50 ms (11), while
# llama-server's SSE cost it nothing (experiments/serving_log.md, 2026-12-07). 50 ms is 20 updates a second; the
# flagship's draft_target rounds (about 55 ms) seldom wait on it.
STREAM_GAP_S = 0.05
STOP_MEMORY_S = 120.0  # a `stop` may arrive before the request it names; remember it this long


class Responder(Protocol):
    def send(self, texts: list[str], results: list | None, final: bool) -> None: ...

    def error(self, message: str, cancelled: bool = False) -> None: ...

    def cancelled(self) -> bool: ...


class Outbox:
    """One thread that makes every round trip to the server in order (sends and cancellation checks; the served model
    posts its metrics' counts here too), so the decode thread never waits on them. Through Triton's python backend
    each is an IPC round trip: a streamed piece took 0.46 ms and a cancellation check 0.3 ms on the 2-core Zen 4, at
    every step for every row (at 4 clients about 3 ms of a 40 ms step that nothing decoded). One thread, not one per
    request: the stub hung when two threads made these calls at once (responses from execute's thread and the
    worker's, 2026-12-01; sends here beside counts on the worker, one CI run of 885a841)."""

    def __init__(self, log: Callable[[str, str], None] = lambda level, msg: None):
        self.log = log
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._timers: list = []  # (due, order, fn, failed), the outbox thread's own
        self._order = itertools.count()
        self._thread = threading.Thread(target=self._run, name="responses", daemon=True)
        self._thread.start()

    def post(self, fn: Callable[[], None], failed: Callable[[Exception], None]) -> None:
        """Run `fn` on the outbox's thread after everything posted before it; `failed(e)` if it raises."""
        self._q.put((fn, failed))

    def post_at(self, due: float, fn: Callable[[], None], failed: Callable[[Exception], None]) -> None:
        """Run `fn` on the outbox's thread once `time.monotonic()` reaches `due` (at the latest when it closes)."""
        self._q.put((due, fn, failed))

    def _run(self) -> None:
        while True:
            wait = max(0.0, self._timers[0][0] - time.monotonic()) if self._timers else None
            try:
                item = self._q.get(timeout=wait)
            except queue.Empty:
                item = ()
            if item is None:
                break
            if len(item) == 3:
                heapq.heappush(self._timers, (item[0], next(self._order), item[1], item[2]))
            elif item:
                self._call(*item)
            while self._timers and self._timers[0][0] <= time.monotonic():
                self._call(*heapq.heappop(self._timers)[2:])
        while self._timers:  # closing: what is held goes out now
            self._call(*heapq.heappop(self._timers)[2:])

    def _call(self, fn: Callable[[], None], failed: Callable[[Exception], None]) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the client may be gone: its responder hears of it
            try:
                failed(e)
            except Exception as e2:  # noqa: BLE001 - the thread serves every request: it never stops
                self.log("warn", f"outbox: {type(e2).__name__}: {e2}")

    def close(self, timeout: float = 10.0) -> None:
        """Send what is posted (held pieces too), then stop the thread."""
        self._q.put(None)
        self._thread.join(timeout)


class PostedResponder:
    """A Responder whose sends and cancellation checks run on an Outbox: `send` and `error` return at once (in the
    order they were called, so a final response follows the pieces), and `cancelled` answers from the last
    check and posts the next one (a client that left is seen one check later: `cancel_check_s` more work at
    most). A send that fails marks the client gone, as a synchronous send's exception did. Streamed pieces closer
    than `gap_s` to the last one sent are held and joined to the next send, or go out `gap_s` after the last."""

    def __init__(self, inner: Responder, outbox: Outbox, gap_s: float = STREAM_GAP_S):
        self.inner, self.outbox, self.gap_s = inner, outbox, gap_s
        self.gone = False  # a send failed or the last check said so
        self._checking = False
        self._lock = threading.Lock()  # `held` is joined on the decode thread and flushed on the outbox's
        self.held: list[str] | None = None
        self.sent_at = float("-inf")
        self._flush_due = False

    def _failed(self, e: Exception) -> None:
        self.gone = True
        self.outbox.log("warn", f"a response or cancellation check failed: {type(e).__name__}: {e}; treating the "
                        "client as gone")

    def send(self, texts: list[str], results: list | None, final: bool) -> None:
        with self._lock:
            if self.held is not None:
                texts, self.held = _joined(self.held, texts), None
            now = time.monotonic()
            if not final and now - self.sent_at < self.gap_s:
                self.held = texts
                if not self._flush_due:
                    self._flush_due = True
                    self.outbox.post_at(self.sent_at + self.gap_s, self._flush, self._failed)
                return
            self.sent_at = now
        self.outbox.post(lambda: self.inner.send(texts, results, final), self._failed)

    def _flush(self) -> None:
        """On the outbox's thread, at its time: the held piece, unless a later send took it along."""
        with self._lock:
            texts, self.held, self._flush_due = self.held, None, False
            if texts is None:
                return
            self.sent_at = time.monotonic()
        self.inner.send(texts, None, False)

    def error(self, message: str, cancelled: bool = False) -> None:
        with self._lock:
            texts, self.held = self.held, None
        if texts is not None:  # what the client was owed goes out before the error
            self.outbox.post(lambda: self.inner.send(texts, None, False), self._failed)
        self.outbox.post(lambda: self.inner.error(message, cancelled), self._failed)

    def cancelled(self) -> bool:
        if not self.gone and not self._checking:
            self._checking = True
            self.outbox.post(self._check, self._failed)
        return self.gone

    def _check(self) -> None:
        try:
            self.gone = self.gone or bool(self.inner.cancelled())
        finally:
            self._checking = False


def _joined(a: list[str], b: list[str]) -> list[str]:
    """Two sends' texts as one, row by row (a final response may carry no text)."""
    return [(a[i] if i < len(a) else "") + (b[i] if i < len(b) else "") for i in range(max(len(a), len(b)))]


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

    def start(self) -> list[Row]:
        """Make the job's rows (one per request row) as it leaves the queue."""
        self.rows, self.results = [Row(self, i) for i in range(len(self.reqs))], [None] * len(self.reqs)
        return self.rows


@dataclass
class Row:
    job: Job
    index: int
    tokens: list[int] = field(default_factory=list)
    sent: str = ""  # text streamed so far
    prefix: int = 0  # streaming window: tokens[prefix:read] decoded to the end of `sent`
    read: int = 0
    decoder: object = None  # the tokenizer's own incremental decoder (Replies.stream), fed tokens[:read]
    plain: bool = False  # took plain steps in the continuous batch since it last speculated


class Replies:
    """Everything the scheduler sends, and whether a client is still there (any thread may `remember_stop`)."""

    def __init__(self, tokenizer, count: Callable[[str, str, float], None], log: Callable[[str, str], None]):
        self.tok, self.count, self.log = tokenizer, count, log
        self.cancel_check_s = CANCEL_CHECK_S
        self.prompt_cache = None  # the scheduler's (Scheduler.use_prompt_cache): its figures are counted per request
        self._stops: dict[str, float] = {}
        self._stops_lock = threading.Lock()

    # ---- cancellation ---------------------------------------------------------------------------------

    def remember_stop(self, request_id: str) -> None:
        """A `stop` request named `request_id` (it may arrive before the request itself)."""
        now = time.monotonic()
        with self._stops_lock:
            self._stops = {k: t for k, t in self._stops.items() if now - t < STOP_MEMORY_S}
            self._stops[request_id] = now

    def _stopped(self, job: Job) -> bool:
        rid = job.p.request_id
        if not rid or not self._stops:
            return False
        with self._stops_lock:
            return rid in self._stops

    def is_cancelled(self, job: Job, every: float | None = None) -> bool:
        """Has the job's client gone? Asks Triton at most every `every` seconds (default cancel_check_s)."""
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

    # ---- responses ------------------------------------------------------------------------------------

    def send(self, out: Responder, send: Callable[[], None]) -> None:
        try:
            send()
        except Exception as e:  # noqa: BLE001 - the client may be gone
            self.log("warn", f"could not send a response: {type(e).__name__}: {e}")

    def decode_text(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def stream(self, job: Job, row: Row) -> None:
        """Send the new text of a streamed row; hold back a trailing partial UTF-8 character. A fast tokenizer's
        own incremental decoder (`tokenizers.decoders.DecodeStream`) takes each new token once; otherwise a window of
        recent tokens is decoded twice (either way a long stream costs linear time, not quadratic)."""
        piece = self._increment(row) if self._incremental(row) else self._window(row)
        if not piece:
            return
        row.sent += piece
        try:
            job.out.send([piece], None, final=False)
        except Exception as e:  # noqa: BLE001 - the client went away: stop its work as for a cancel
            self.log("warn", f"request {job.p.request_id or '(no id)'}: could not send a piece ({type(e).__name__}: "
                     f"{e}); treating it as cancelled")
            job.cancelled = True

    def _incremental(self, row: Row) -> bool:
        """Give the row the tokenizer's incremental decoder unless it has one or fell back to the window."""
        if row.decoder is None:
            inner = getattr(self.tok, "_tokenizer", None)  # a transformers fast tokenizer's tokenizers.Tokenizer
            row.decoder = DecodeStream(skip_special_tokens=True) if inner is not None and DecodeStream else False
        return row.decoder is not False

    def _increment(self, row: Row) -> str:
        """The text the row's new tokens complete, one step of the incremental decoder per token (its text joins
        to `decode_text` of all of them, as the window's does: tests/test_scheduler.py)."""
        inner, parts = self.tok._tokenizer, []
        try:
            for t in row.tokens[row.read:]:
                part = row.decoder.step(inner, t)
                if part:
                    parts.append(part)
        except Exception:  # noqa: BLE001 - the decoder raised (it skips ids past the vocabulary, as decode does, so
            row.decoder = False  # not for those): the window takes over from the tokens fed before this call
            return self._window(row)
        row.prefix, row.read = row.read, len(row.tokens)  # the window's context, should it ever take over
        return "".join(parts)

    def _window(self, row: Row) -> str:
        """The text of tokens[prefix:] past that of tokens[prefix:read], unless it ends in a partial character."""
        before = self.decode_text(row.tokens[row.prefix:row.read])
        piece_text = self.decode_text(row.tokens[row.prefix:])
        if len(piece_text) <= len(before) or piece_text.endswith("\ufffd") or not piece_text.startswith(before):
            return ""
        row.prefix, row.read = row.read, len(row.tokens)
        return piece_text[len(before):]

    def _error(self, job: Job, msg: str, cancelled: bool) -> None:
        try:
            job.out.error(msg, cancelled)
        except Exception as e:  # noqa: BLE001 - the client may be gone
            self.log("warn", f"request {job.p.request_id or '(no id)'}: could not send an error response: {e}")

    def fail(self, job: Job, msg: str) -> None:
        if job.answered:
            return
        job.answered = job.failed = True
        self.count("errors", job.method, 1)
        self._error(job, msg, False)

    def cancel(self, job: Job) -> None:
        if job.answered:
            return
        job.answered = job.failed = True
        self.count("cancelled", job.method, 1)
        self.count("cancelled_tokens", job.method, sum(len(r.tokens) for r in job.rows))
        self._error(job, "request cancelled by the client", True)

    def _count_cache(self, method: str, r) -> None:
        """A finished request's prompt-cache figures (reused / computed tokens and blocks), and the cache's gauges."""
        pc = self.prompt_cache
        if pc is None:
            return
        bt = pc.block_tokens
        self.count("prompt_reused", method, r.cached_tokens)
        self.count("prompt_computed", method, r.num_input_tokens - r.cached_tokens)
        self.count("kv_reused_blocks", method, r.cached_tokens // bt)
        self.count("kv_missed_blocks", method, r.num_input_tokens // bt - r.cached_tokens // bt)
        self.count("kv_cache_bytes", "", pc.bytes)
        self.count("kv_cache_hit_rate", "", pc.stats.hit_rate)

    def complete(self, job: Job) -> None:
        """Count a finished request and send its final response (or its cancellation)."""
        if job.answered:
            return
        if job.cancelled:
            self.cancel(job)
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
            self._count_cache(method, r)
        texts = [self.decode_text(r.tokens) for r in res]
        if job.stream:
            texts = [t[len(rw.sent):] if t.startswith(rw.sent) else t for t, rw in zip(texts, job.rows)]
        elif not job.p.exclude_input:
            texts = [p + t for p, t in zip(job.p.texts, texts)]
        try:
            job.out.send(texts, res if job.p.perf else None, final=True)
        except Exception as e:  # noqa: BLE001
            self.log("warn", f"request {job.p.request_id or '(no id)'}: could not send the final response: {e}")

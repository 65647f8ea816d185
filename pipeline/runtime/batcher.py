"""Continuous batching for plain decoding: rows join and leave the running batch at every step.

`generate` decodes a batch to completion before the next can start, so clients that arrive at
different times wait behind each other. `ContinuousBatch` owns one static KV cache and keeps its
active rows in cache rows 0..n-1: a step is one forward over that block, new rows are prefilled
into the rows after it and join the next step, and a finished row's place is taken by the last
active row (its K/V copied into the hole). Each row's arithmetic depends only on its own cache row
and position, so its tokens equal `generate`'s for the same request. `adopt` takes over rows a
speculative loop handed off mid-request (their K/V copied in), which is how a server turns
speculation off for a running request once others arrive; `release` gives rows back (K/V copied
out) so speculation can resume when the load drops again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.runtime.generate import Handoff, Request, Result, Sequence, finish, prefill
from pipeline.runtime.model import Transformer
from pipeline.runtime.prompt_cache import PromptCache, keep_rows, prefill_cached, rows_to_run
from pipeline.runtime.sampling import next_token

RowEmit = Callable[[Any, list[int]], None]


@dataclass
class RowFailure:
    """In place of a Result: this row could not continue (the error), its batch-mates were not affected."""

    error: BaseException

    def __str__(self) -> str:
        return f"{type(self.error).__name__}: {self.error}"


@dataclass
class _Row:
    tag: Any
    seq: Sequence
    gen: torch.Generator
    cur: int  # position (and cache slot) of `token`, the next token to feed
    token: int
    start: float
    stats: dict | None = None  # a row adopted from a speculative loop: its statistics so far
    base: int = 0  # tokens it had when adopted
    draft: tuple | None = None  # the draft model's cache state, kept for resuming (Handoff.draft)
    exact_kv: bool = True  # its K/V may enter the prompt cache when it finishes (Handoff.exact_kv)


@dataclass
class _Pending:
    """A row whose prompt is being prefilled in chunks between the running rows' steps, in a cache of its own."""

    row: _Row
    ids: list[int]  # prompt (+ tokens already emitted) to prefill
    cache: Any  # KVCache, one row
    done: int  # tokens whose K/V the cache holds
    parked: bool = False  # a running row taken out to hold the K/V budget: it rejoins with its pending token
    hidden: Any = None  # the last prompt token's hidden state, once the prefill is whole (it waits to join)


class ContinuousBatch:
    """Plain decoding of up to `max_rows` requests, admitted and retired between steps.

    With `prefill_chunk` > 0, a prompt admitted while other rows decode is prefilled `prefill_chunk` tokens per step
    (before each of their steps), in a cache of its own; it joins once its last token has run, so running streams keep
    flowing while a long prompt arrives. The kernels give the same bits chunked or not, so its tokens are unchanged.
    """

    def __init__(self, model: Transformer, max_rows: int, length: int = 256, prompt_cache: PromptCache | None = None,
                 kv_bytes: int = 0, prefill_chunk: int = 0):
        self.model, self.max_rows = model, max_rows
        self.prefill_chunk = prefill_chunk  # tokens of a waiting prompt run per step beside running rows (0: at once)
        self.pending: list[_Pending] = []
        self.prompt_cache = prompt_cache  # prompts start from their cached prefix; finished rows are kept
        self.kv_bytes = kv_bytes  # admit while the rows' K/V fit (0: rows alone bound it); see `fits`
        self.start_length = length
        with torch.inference_mode():
            self.cache = model.new_cache(1, length)  # rows and slots are taken as requests come and grow
        self.rows: list[_Row] = []
        self.dev = model.embed.weight.device

    def tags(self) -> list:
        return [r.tag for r in self.rows] + [p.row.tag for p in self.pending]

    @property
    def free(self) -> int:
        return self.max_rows - len(self.rows) - len(self.pending)

    @property
    def busy(self) -> bool:
        """Rows decoding or prompts being prefilled."""
        return bool(self.rows or self.pending)

    @property
    def load(self) -> int:
        return len(self.rows) + len(self.pending)

    def token_bytes(self) -> int:
        """K/V bytes of one token of one row (all layers)."""
        c = self.cache
        return 2 * c.k.shape[0] * c.k.shape[2] * c.k.shape[4] * c.k.element_size()

    def fits(self, reqs: list[Request]) -> bool:
        """Would `reqs` join within the K/V byte budget (`kv_bytes`)? Counts the rows' slots as they are now (pending
        ones too) and the new prompts'; as rows grow while decoding, `_park_over_budget` keeps the bound. An empty batch
        admits anything: a request alone always runs."""
        if not self.kv_bytes or not self.busy or not reqs:
            return True
        need = max([self.cache.length] + [len(p.ids) + 2 for p in self.pending] + [len(r.prompt) + 2 for r in reqs])
        return (self.load + len(reqs)) * need * self.token_bytes() <= self.kv_bytes

    def _ensure(self, need: int, rows: int | None = None) -> None:
        """Room for `rows` rows (default: those active) of `need` slots: rows and slots grow by half again at least
        (contents kept), so K/V is taken as requests join and sequences grow, not max_rows x max_seq_len up front."""
        old, n = self.cache, len(self.rows)
        rows = n if rows is None else rows
        if need <= old.length and rows <= old.batch:
            return
        length = self._grown_length(need)
        # rows grow by half again too, unless the slots grow: then the rows are reallocated anyway, as many as needed
        batch = rows if length > old.length else min(self.max_rows, max(rows, old.batch * 3 // 2))
        self.cache = old.resized(max(batch, rows), length, n, old.length)

    def _grown_length(self, need: int) -> int:
        old = self.cache.length
        return old if need <= old else (max(need, old * 3 // 2) + 63) // 64 * 64

    def _room_for(self, rows: int, need: int) -> bool:
        """Would `rows` rows of `need` slots (or the batch's length, if longer) stay within `kv_bytes`?"""
        return not self.kv_bytes or rows * self._grown_length(need) * self.token_bytes() <= self.kv_bytes

    def _park_over_budget(self) -> None:
        """Before the rows grow past `kv_bytes`: the youngest rows (all but one) step out into pending, their K/V into
        the prompt cache (where enabled), and rejoin, prefilled again from it, once the batch has room; their tokens,
        random state and statistics go with them, so their answers are unchanged."""
        parked = False
        while len(self.rows) > 1 and not self._room_for(len(self.rows), max(r.cur for r in self.rows) + 1):
            parked = True
            i = max(range(len(self.rows)), key=lambda j: self.rows[j].start)
            r = self.rows[i]
            ctx = (r.seq.req.prompt + r.seq.tokens)[:r.cur]
            if r.seq.req.cache_prompt and r.exact_kv:
                keep_rows(self.prompt_cache, "target", [ctx], self.cache.rows(i, i + 1), held=[r.cur])
            self._drop(i)
            cache = self.model.new_cache(1, (len(ctx) + 2 + 63) // 64 * 64)
            (done,) = rows_to_run(self.prompt_cache, "target", [ctx], cache, [r.seq.req.cache_prompt])
            self.pending.insert(0, _Pending(r, ctx, cache, done, parked=True))
        if parked and self.cache.nbytes > self.kv_bytes:  # give the parked rows' memory back now
            n = len(self.rows)
            self.cache = self.cache.resized(n, self.cache.length, n, self.cache.length)

    def _shrink_if_idle(self) -> None:
        """With no rows left, give the K/V memory back (a long request's rows must not stay allocated)."""
        if not self.rows and (self.cache.batch > 1 or self.cache.length > self.start_length):
            self.cache = self.model.new_cache(1, self.start_length)

    def _drop(self, i: int) -> _Row:
        """Take row i out; the last active row moves into its cache row."""
        r = self.rows[i]
        last = len(self.rows) - 1
        if i != last:
            self.cache.copy_row(i, self.cache, last, self.rows[last].cur)
            self.rows[i] = self.rows[last]
        self.rows.pop()
        return r

    @staticmethod
    def _stats(r: _Row) -> dict:
        stats = dict(r.stats or {})
        stats["steps"] = stats.get("steps", 0) + len(r.seq.tokens) - r.base
        return stats

    def _keep(self, r: _Row, i: int) -> None:
        """A row that finished normally: its prompt + answer (the K/V it holds) into the prompt cache."""
        pc = self.prompt_cache
        if pc is None or not pc.budget or not r.seq.req.cache_prompt or not r.exact_kv:
            return
        full = r.seq.req.prompt + r.seq.tokens
        keep_rows(pc, "target", [full], self.cache.rows(i, i + 1), held=[r.cur])
        if r.draft is not None:
            cache, row, fed = r.draft
            keep_rows(pc, "draft", [full], cache.rows(row, row + 1), held=[min(fed, r.cur)])

    def _retire(self, done: list[int], failed: dict[int, BaseException] | None = None,
                keep: bool = False) -> list[tuple[Any, Any]]:
        """Take out the finished rows (their Results; `keep`: they finished normally and enter the prompt cache) and
        the failed ones (a RowFailure each)."""
        failed = failed or {}
        out = []
        if keep:
            for i in done:
                if i not in failed:
                    self._keep(self.rows[i], i)
        for i in sorted(set(done) | set(failed), reverse=True):
            r = self._drop(i)
            out.append((r.tag, RowFailure(failed[i]) if i in failed else finish([r.seq], r.start, [self._stats(r)])[0]))
        self._shrink_if_idle()
        return out[::-1]

    def _take(self, logits: torch.Tensor, rows: list[int], on_emit: RowEmit | None) -> list[tuple[Any, Any]]:
        """Sample each row's next token from its logits; retire (and return) the rows that finished or failed."""
        done, failed = [], {}
        for j, i in enumerate(rows):
            r = self.rows[i]
            try:
                t = next_token(logits[j], r.seq.req.params, r.gen)
            except Exception as e:  # noqa: BLE001 - this row's distribution is broken; the others go on
                failed[i] = e
                continue
            emitted = r.seq.extend([t])
            r.token = t
            if emitted and on_emit:
                on_emit(r.tag, emitted)
            if r.seq.done:
                done.append(i)
        return self._retire(done, failed, keep=True)

    @torch.inference_mode()
    def admit(self, reqs: list[Request], tags: list, on_emit: RowEmit | None = None,
              prefixes: list[list[int]] | None = None, chunked: bool = True) -> list[tuple[Any, Any]]:
        """Prefill `reqs` into free rows and sample their first tokens; returns rows already finished (or failed).

        With `prefixes`, row b continues after prefixes[b], tokens it already emitted (counted in its budget
        and stop rules, not emitted again). A prefill that raises leaves the batch as it was. With `prefill_chunk` set
        and rows running, a prompt longer than a chunk becomes a pending row instead (`chunked=False`: never)."""
        if len(reqs) > self.free:
            raise ValueError(f"{len(reqs)} rows do not fit: {self.free} of {self.max_rows} are free")
        if not reqs:
            return []
        prefixes = prefixes or [[] for _ in reqs]
        if chunked and self.prefill_chunk > 0 and self.busy:
            later = [b for b, (r, p) in enumerate(zip(reqs, prefixes)) if len(r.prompt) + len(p) > self.prefill_chunk]
            for b in later:
                self._queue_prefill(reqs[b], tags[b], prefixes[b])
            keep = [b for b in range(len(reqs)) if b not in later]
            reqs, tags, prefixes = [reqs[b] for b in keep], [tags[b] for b in keep], [prefixes[b] for b in keep]
            if not reqs:
                return []
        self._ensure(max(len(r.prompt) + len(p) for r, p in zip(reqs, prefixes)) + 2, len(self.rows) + len(reqs))
        n = len(self.rows)
        now = time.perf_counter()
        for req, tag, pre in zip(reqs, tags, prefixes, strict=True):
            seq = Sequence(req)
            seq.tokens = list(pre)
            self.rows.append(_Row(tag, seq, req.params.generator(), len(req.prompt) + len(pre), 0, now, base=len(pre)))
        try:
            h, reused = prefill_cached(self.model, self.cache.rows(n, n + len(reqs)),
                                       [r.prompt + list(p) for r, p in zip(reqs, prefixes)], self.prompt_cache,
                                       "target", [r.cache_prompt for r in reqs])
            logits = self.model.logits(h, all(r.params.greedy for r in reqs))
        except BaseException:
            del self.rows[n:]
            raise
        for r, m in zip(self.rows[n:], reused):
            r.seq.cached = m
        return self._take(logits, list(range(n, n + len(reqs))), on_emit)

    def _queue_prefill(self, req: Request, tag, pre: list[int]) -> None:
        """Take `req` in as a pending row: its cached prefix is copied now, the rest runs a chunk per step."""
        seq = Sequence(req)
        seq.tokens = list(pre)
        ids = req.prompt + list(pre)
        cache = self.model.new_cache(1, (len(ids) + 2 + 63) // 64 * 64)
        (done,) = rows_to_run(self.prompt_cache, "target", [ids], cache, [req.cache_prompt])
        seq.cached = done
        row = _Row(tag, seq, req.params.generator(), len(ids), 0, time.perf_counter(), base=len(pre))
        self.pending.append(_Pending(row, ids, cache, done))

    def _prefill_chunk(self, on_emit: RowEmit | None) -> list[tuple[Any, Any]]:
        """Run the next chunk of the first pending prompt; when it was the last, the row joins (first token sampled).
        A chunk that raises fails that row alone (its batch-mates' K/V are untouched; nothing enters the cache)."""
        p = self.pending[0]
        if p.done < len(p.ids):
            # with no row decoding beside it (they finished meanwhile), the rest runs at once
            chunk = self.prefill_chunk if self.rows and self.prefill_chunk else None
            stop = min(len(p.ids), p.done + chunk) if chunk else len(p.ids)
            try:
                h = prefill(self.model, p.cache, [p.ids[:stop]], [p.done], chunk=chunk)
            except Exception as e:  # noqa: BLE001
                self.pending.pop(0)
                return [(p.row.tag, RowFailure(e))]
            p.done = stop
            if stop < len(p.ids):
                return []
            p.hidden = h
            if not p.parked:
                keep_rows(self.prompt_cache, "target", [p.ids], p.cache, [p.row.seq.req.cache_prompt])
        n = len(self.rows)
        if n and not self._room_for(n + 1, max([len(p.ids) + 2] + [r.cur + 1 for r in self.rows])):
            return []  # whole, it waits for rows to finish (kv_cache.bytes); a row alone always runs
        self.pending.pop(0)
        self._ensure(len(p.ids) + 2, n + 1)
        self.cache.copy_row(n, p.cache, 0, len(p.ids))
        self.rows.append(p.row)
        if p.parked:
            return []  # it feeds its pending token at the next step, as before it stepped out
        return self._take(self.model.logits(p.hidden, p.row.seq.req.params.greedy), [n], on_emit)

    @torch.inference_mode()
    def adopt(self, handoffs: list[Handoff], tags: list) -> None:
        """Continue rows a speculative loop handed off: copy their K/V into free rows; they join the next step."""
        if len(handoffs) > self.free:
            raise ValueError(f"{len(handoffs)} rows do not fit: {self.free} of {self.max_rows} are free")
        if not handoffs:
            return
        self._ensure(max(h.cur for h in handoffs) + 2, len(self.rows) + len(handoffs))
        for h, tag in zip(handoffs, tags, strict=True):
            self.cache.copy_row(len(self.rows), h.cache, h.row, h.cur)
            self.rows.append(_Row(tag, h.seq, h.gen, h.cur, h.token, h.start, h.stats, len(h.seq.tokens), h.draft,
                                  h.exact_kv))

    @torch.inference_mode()
    def release(self, take: Callable[[Any], bool]) -> list[tuple[Any, Handoff]]:
        """Hand the rows whose tag `take` selects back to a speculative loop (`resume`), K/V copied out."""
        picked = [i for i, r in enumerate(self.rows) if take(r.tag)]
        if not picked:
            return []
        length = max(self.rows[i].cur for i in picked) + 1
        cache = self.model.new_cache(len(picked), length)
        out = []
        for j, i in enumerate(picked):
            r = self.rows[i]
            cache.copy_row(j, self.cache, i, r.cur)
            out.append((r.tag, Handoff(r.seq, r.gen, cache, j, r.cur, r.token, self._stats(r), r.start, r.draft,
                                       r.exact_kv)))
        for i in sorted(picked, reverse=True):
            self._drop(i)
        self._shrink_if_idle()
        return out

    @torch.inference_mode()
    def step(self, on_emit: RowEmit | None = None) -> list[tuple[Any, Result]]:
        """One token for every active row (after a chunk of the first pending prompt, if any); returns (tag, result)
        for the rows that finished (or failed)."""
        joined = self._prefill_chunk(on_emit) if self.pending else []
        n = len(self.rows)
        if not n:
            return joined
        return joined + self._decode(on_emit)

    def _decode(self, on_emit: RowEmit | None) -> list[tuple[Any, Result]]:
        self._park_over_budget()
        n = len(self.rows)
        self._ensure(max(r.cur for r in self.rows) + 1)  # K/V taken as the rows advance
        toks = torch.tensor([[r.token] for r in self.rows], device=self.dev)
        pos = torch.tensor([[r.cur] for r in self.rows], device=self.dev)
        h = self.model(toks, pos, self.cache.rows(0, n))
        for r in self.rows:
            r.cur += 1
        greedy = all(r.seq.req.params.greedy for r in self.rows)  # argmax only: the head's screen may serve it
        return self._take(self.model.logits(h[:, 0], greedy), list(range(n)), on_emit)

    @torch.inference_mode()
    def remove(self, drop: Callable[[Any], bool]) -> list[tuple[Any, Result]]:
        """Drop the rows whose tag `drop` selects (cancelled requests) between steps; a pending prompt is dropped with
        what it had computed (nothing of it enters the prompt cache)."""
        gone = [p for p in self.pending if drop(p.row.tag)]
        self.pending = [p for p in self.pending if not drop(p.row.tag)]
        out = [(p.row.tag, finish([p.row.seq], p.row.start, [self._stats(p.row)])[0]) for p in gone]
        return out + self._retire([i for i, r in enumerate(self.rows) if drop(r.tag)])

    def clear(self) -> list:
        """Forget every row (after a failed step, whose cache contents can no longer be trusted); their tags."""
        tags = self.tags()
        self.rows, self.pending = [], []
        return tags

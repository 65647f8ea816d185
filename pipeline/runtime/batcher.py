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

from pipeline.runtime.generate import Handoff, Request, Result, Sequence, finish
from pipeline.runtime.model import Transformer
from pipeline.runtime.prompt_cache import PromptCache, keep_rows, prefill_cached
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


class ContinuousBatch:
    """Plain decoding of up to `max_rows` requests, admitted and retired between steps."""

    def __init__(self, model: Transformer, max_rows: int, length: int = 256, prompt_cache: PromptCache | None = None):
        self.model, self.max_rows = model, max_rows
        self.prompt_cache = prompt_cache  # prompts start from their cached prefix; finished rows are kept
        with torch.inference_mode():
            self.cache = model.new_cache(max_rows, length)
        self.rows: list[_Row] = []
        self.dev = model.embed.weight.device

    def tags(self) -> list:
        return [r.tag for r in self.rows]

    @property
    def free(self) -> int:
        return self.max_rows - len(self.rows)

    def _ensure(self, need: int) -> None:
        """Grow the cache (doubling, contents kept) when an admitted row needs more slots than it has."""
        old = self.cache
        if need <= old.length:
            return
        length = max((need + 63) // 64 * 64, 2 * old.length)
        new = self.model.new_cache(self.max_rows, length)
        n = len(self.rows)
        new.k[:, :n, :, :old.length] = old.k[:, :n]
        new.v[:, :n, :, :old.length] = old.v[:, :n]
        self.cache = new

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
              prefixes: list[list[int]] | None = None) -> list[tuple[Any, Any]]:
        """Prefill `reqs` into free rows and sample their first tokens; returns rows already finished (or failed).

        With `prefixes`, row b continues after prefixes[b], tokens it already emitted (counted in its budget
        and stop rules, not emitted again). A prefill that raises leaves the batch as it was."""
        if len(reqs) > self.free:
            raise ValueError(f"{len(reqs)} rows do not fit: {self.free} of {self.max_rows} are free")
        if not reqs:
            return []
        prefixes = prefixes or [[] for _ in reqs]
        self._ensure(max(len(r.prompt) + r.max_new_tokens for r in reqs) + 2)
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
            logits = self.model.logits(h)
        except BaseException:
            del self.rows[n:]
            raise
        for r, m in zip(self.rows[n:], reused):
            r.seq.cached = m
        return self._take(logits, list(range(n, n + len(reqs))), on_emit)

    @torch.inference_mode()
    def adopt(self, handoffs: list[Handoff], tags: list) -> None:
        """Continue rows a speculative loop handed off: copy their K/V into free rows; they join the next step."""
        if len(handoffs) > self.free:
            raise ValueError(f"{len(handoffs)} rows do not fit: {self.free} of {self.max_rows} are free")
        if not handoffs:
            return
        self._ensure(max(len(h.seq.req.prompt) + h.seq.req.max_new_tokens for h in handoffs) + 2)
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
        return out

    @torch.inference_mode()
    def step(self, on_emit: RowEmit | None = None) -> list[tuple[Any, Result]]:
        """One token for every active row; returns (tag, result) for the rows that finished."""
        n = len(self.rows)
        if not n:
            return []
        toks = torch.tensor([[r.token] for r in self.rows], device=self.dev)
        pos = torch.tensor([[r.cur] for r in self.rows], device=self.dev)
        h = self.model(toks, pos, self.cache.rows(0, n))
        for r in self.rows:
            r.cur += 1
        return self._take(self.model.logits(h[:, 0]), list(range(n)), on_emit)

    @torch.inference_mode()
    def remove(self, drop: Callable[[Any], bool]) -> list[tuple[Any, Result]]:
        """Drop the rows whose tag `drop` selects (cancelled requests) between steps."""
        return self._retire([i for i, r in enumerate(self.rows) if drop(r.tag)])

    def clear(self) -> list:
        """Forget every row (after a failed step, whose cache contents can no longer be trusted); their tags."""
        tags = self.tags()
        self.rows = []
        return tags

"""Plain (baseline) decoding and the request bookkeeping every method shares.

A method produces tokens for each row; `Sequence.extend` applies the stopping rules (EOS, stop
word sequences, token budget) identically whether tokens arrive one at a time or k+1 at a time,
so speculative output can equal baseline output token for token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from pipeline.figures import mean_accepted_len
from pipeline.runtime.model import KVCache, Transformer, prefill  # noqa: F401 (prefill: callers import it from here)
from pipeline.runtime.prompt_cache import keep_rows, prefill_cached
from pipeline.runtime.sampling import SamplingParams, next_token


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: list[list[int]] = field(default_factory=list)
    end_ids: tuple[int, ...] = ()
    cache_prompt: bool = True  # reuse (and keep) prompt K/V in the prompt cache (pipeline/runtime/prompt_cache.py)
    prediction: list[int] | None = None  # Predicted Outputs: tokens the answer likely repeats (runtime/suffix.py)


@dataclass
class Result:
    tokens: list[int]
    finish_reason: str
    num_input_tokens: int
    steps: int = 0
    draft_proposed: int = 0
    draft_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    proposed_per_position: list[int] = field(default_factory=list)
    first_token_s: float = 0.0
    elapsed_s: float = 0.0
    speculation_off: bool = False  # the batch was at or above speculation.disable_at_batch
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prompt cache (not computed)

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens (0 when nothing was proposed)."""
        return self.draft_accepted / self.draft_proposed if self.draft_proposed else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Tokens emitted per target forward pass after prefill (accepted drafts + the target's own)."""
        return mean_accepted_len(len(self.tokens), self.steps)


Emit = Callable[[int, list[int]], None]
YieldTo = Callable[[], bool]
OnFinish = Callable[[int, "Result"], None]


class Sequence:
    """One row's output so far and its stopping rules."""

    def __init__(self, req: Request):
        self.req = req
        self.tokens: list[int] = []
        self.done = False
        self.finish_reason = ""
        self.first_token_at = 0.0
        self.cached = 0  # prompt tokens reused from the prompt cache

    def extend(self, new: list[int]) -> list[int]:
        """Append tokens up to the first stop condition; return the ones actually emitted."""
        out = []
        for t in new:
            if self.done:
                break
            if t in self.req.end_ids:
                self.done, self.finish_reason = True, "eos"
                break
            self.tokens.append(t)
            out.append(t)
            if any(s and self.tokens[-len(s):] == s for s in self.req.stop):
                self.done, self.finish_reason = True, "stop"
            elif len(self.tokens) >= self.req.max_new_tokens:
                self.done, self.finish_reason = True, "length"
        if out and not self.first_token_at:
            self.first_token_at = time.perf_counter()
        return out


@dataclass
class Handoff:
    """An unfinished row a speculative loop gave up when its `yield_to` said so (the server got busy).

    Plain decoding continues it: cache row `row` of `cache` holds its K/V for slots before `cur`,
    and `token` (already emitted) is the next one to feed, at position `cur`. `draft` (draft-model
    loops) is (draft cache, row, slots fed): resuming copies it back, so the draft only catches up
    on the tokens decoded plainly meanwhile instead of the whole context.
    """

    seq: Sequence
    gen: torch.Generator
    cache: KVCache
    row: int
    cur: int
    token: int
    stats: dict
    start: float
    draft: tuple[KVCache, int, int] | None = None
    exact_kv: bool = True  # its K/V are what a prefill would write (not Medusa's tree-mask verification): cacheable


def finish_or_hand_off(seqs: list[Sequence], start: float | list[float], stats: list[dict],
                       gens: list[torch.Generator], cache: KVCache, cur: list[int],
                       tokens: list[int], drafts: list | None = None) -> list[Result | Handoff]:
    """Results for the finished rows, Handoffs for the others (a speculative loop stopping early)."""
    starts = start if isinstance(start, list) else [start] * len(seqs)
    done = finish(seqs, starts, stats)
    return [r if s.done else Handoff(s, gens[b], cache, b, cur[b], tokens[b], stats[b], starts[b],
                                     drafts[b] if drafts else None)
            for b, (s, r) in enumerate(zip(seqs, done, strict=True))]


def row_stats(carried: dict, width: int) -> dict:
    """A speculative row's statistics: fresh (prefill counted as one step), or continuing those a handoff
    carried (speculative rounds, then plain steps counted in `steps`); per-position lists at least `width` long."""
    def per(key: str) -> list[int]:
        got = list(carried.get(key) or [])
        return got + [0] * (width - len(got))

    return {"steps": carried.get("steps", 1), "draft_proposed": carried.get("draft_proposed", 0),
            "draft_accepted": carried.get("draft_accepted", 0), "accepted_per_position": per("accepted_per_position"),
            "proposed_per_position": per("proposed_per_position")}


def report_finished(seqs: list[Sequence], reported: list[bool], start: float | list[float],
                    stats: Callable[[int], dict], on_finish: OnFinish | None) -> None:
    """Give `on_finish` each row's Result as soon as the row is done, once, while its batch-mates run on (a
    server answers a short request without waiting for the longest one in its batch)."""
    if on_finish is None:
        return
    for b, s in enumerate(seqs):
        if s.done and not reported[b]:
            reported[b] = True
            on_finish(b, finish([s], [start[b] if isinstance(start, list) else start], [stats(b)])[0])


def resume_cache(model: Transformer, handoffs: list[Handoff], length: int) -> KVCache:
    """A fresh cache holding each handed-off row's K/V (slots before its `cur`), one row per handoff."""
    cache = model.new_cache(len(handoffs), length)
    for b, h in enumerate(handoffs):
        cache.copy_row(b, h.cache, h.row, h.cur)
    return cache


def cache_length(reqs: list[Request], extra: int) -> int:
    """Slots needed: the longest prompt plus its output plus a verify window, rounded up."""
    n = max(len(r.prompt) + r.max_new_tokens for r in reqs) + extra + 1
    return (n + 63) // 64 * 64


GROW_SLOTS = 256  # slots a cache holds past what its rows need now; it grows by half again as they advance


def start_length(reqs: list[Request], extra: int, held: int = 0) -> int:
    """Slots a loop's cache starts with: what the longest prompt (or `held` context) needs now plus GROW_SLOTS, never
    more than `cache_length` (the whole budget): K/V is taken as sequences grow, not max_new_tokens up front (a
    client that omits max_tokens asks for the whole context, 32k slots a row on the flagship)."""
    n = max([held] + [len(r.prompt) for r in reqs]) + extra + 1 + GROW_SLOTS
    return min((n + 63) // 64 * 64, cache_length(reqs, extra))


def grow(cache: KVCache, need: int) -> KVCache:
    """`cache`, or a longer copy of it when a row needs slot `need - 1` (half again as long at least, so a sequence
    growing a token at a time copies its K/V a logarithmic number of times)."""
    if need <= cache.length:
        return cache
    n = max(need, cache.length * 3 // 2)
    return cache.resized(cache.batch, (n + 63) // 64 * 64, cache.batch, cache.length)


def finish(seqs: list[Sequence], start: float | list[float], stats: list[dict] | None = None) -> list[Result]:
    """Results with timings from `start` (one time, or one per row: rows resumed from handoffs began earlier)."""
    end = time.perf_counter()
    starts = start if isinstance(start, list) else [start] * len(seqs)
    out = []
    for i, s in enumerate(seqs):
        t0 = starts[i]
        r = Result(tokens=s.tokens, finish_reason=s.finish_reason or "length", num_input_tokens=len(s.req.prompt),
                   first_token_s=(s.first_token_at - t0) if s.first_token_at else 0.0, elapsed_s=end - t0,
                   cached_tokens=s.cached)
        if stats:
            for k, v in stats[i].items():
                setattr(r, k, v)
        out.append(r)
    return out


Step = Callable[[int, Tensor, Tensor, int], None]


@torch.inference_mode()
def generate(model: Transformer, reqs: list[Request], on_emit: Emit | None = None,
             on_step: Step | None = None, prompt_cache=None) -> list[Result]:
    """Baseline decoding: one target forward per token, all rows of the batch in step.

    `on_step(row, hidden, logits, token)` sees every token a live row picks (an end token too, before the
    stopping rules drop it) with the final normed hidden state and the logits it was picked from: the
    training data builders (draft distillation, Medusa self-distillation) record what they need through it
    instead of running decode loops of their own. `prompt_cache` (pipeline/runtime/prompt_cache.py): prompts
    start from their cached prefix, and prompt + answer are kept when the batch ends."""

    start = time.perf_counter()
    dev = model.embed.weight.device
    seqs = [Sequence(r) for r in reqs]
    gens = [r.params.generator() for r in reqs]
    cache = model.new_cache(len(reqs), start_length(reqs, 0))
    use = [r.cache_prompt for r in reqs]
    hidden, reused = prefill_cached(model, cache, [r.prompt for r in reqs], prompt_cache, "target", use)
    for s, n in zip(seqs, reused):
        s.cached = n
    greedy = on_step is None and all(r.params.greedy for r in reqs)  # argmax only: the head's screen may serve it
    logits = model.logits(hidden, greedy)
    cur = [len(r.prompt) for r in reqs]
    while True:
        nxt = []
        for b, s in enumerate(seqs):
            if s.done:
                nxt.append(0)
                continue
            t = next_token(logits[b], s.req.params, gens[b])
            if on_step is not None:
                on_step(b, hidden[b], logits[b], t)
            emitted = s.extend([t])
            if emitted and on_emit:
                on_emit(b, emitted)
            nxt.append(t)
        if all(s.done for s in seqs):
            break
        active = [b for b, s in enumerate(seqs) if not s.done]
        cache = grow(cache, max(cur) + 1)  # K/V taken as the rows advance
        pos = torch.tensor([[min(c, cache.length - 1)] for c in cur], device=dev)
        hidden = model(torch.tensor(nxt, device=dev)[:, None], pos, cache)[:, 0]
        logits = model.logits(hidden, greedy)
        for b in active:
            cur[b] += 1
    keep_rows(prompt_cache, "target", [r.prompt + s.tokens for r, s in zip(reqs, seqs)], cache, use, cur)
    return finish(seqs, start, [{"steps": len(s.tokens)} for s in seqs])

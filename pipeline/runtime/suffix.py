"""Suffix drafting: the continuation of the longest earlier match of the context's end, model-free.

Where a coding assistant repeats what it has seen (an edit returning the file, an agent quoting tool output, an
answer quoting the question's code), that text is the best draft there is. Each round, for each row, the drafter
looks for the context's newest tokens earlier in three sources and proposes what followed them there:

1. the request's **prediction** (OpenAI Predicted Outputs), kept aligned to the output so far and re-synced after a
   mismatch; while aligned it is weighed against the best match of the other two (its odds are its request's own,
   and forget a miss as its tokens are accepted); what the output wrote in place of the prediction's tokens between a
   mismatch and the re-sync (a renamed identifier) is applied to the rest of it as a substitution; an answer that
   opens the way the prompt leads into its copy of the prediction (a code fence) is aligned from its first token;
2. the request's own **prompt and output so far**;
3. a bounded **store of recent outputs** of this deployment (`SuffixStore`: token ids only, at most
   `speculation.suffix_store_bytes` bytes, oldest dropped first).

A match is found from an index of every `ANCHOR`-token window and extended backwards token by token (SuffixDecoding
keeps suffix trees; an anchor index with backward extension finds the same longest match among the latest
`MAX_CANDIDATES` occurrences, in a few lines). Its draft length follows the match's odds and the measured verify
cost: the drafter keeps, per match-length bucket, how many of its drafted tokens the target accepted, and drafts
the L that maximises expected tokens per verify cost, (1 - p^(L+1)) / (1 - p) / cost(L + 1), where cost(S) is the
cost of verifying S tokens in one-token steps (`VERIFY_COST`, or the curve bench measured on this machine). Where
verification is nearly flat (16 tokens at 4 one-token steps on a 2-core Zen 4), a long match drafts 16-32 tokens.

Exact like every method here: the drafts are deterministic (q one-hot), so greedy rows accept on equality with the
target's argmax and sampled rows on equality with the target's own sample (`speculative.match_accept`). Neither the
store nor the odds can change an answer, only how many tokens a round commits.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import chain

import torch
from torch import Tensor

from pipeline.runtime.generate import Handoff, Request
from pipeline.runtime.loadpolicy import plain_from
from pipeline.runtime.speculative import _ModelDrafter, speculate

ANCHOR = 2  # tokens one index key holds: matches start from this many tokens
MAX_CANDIDATES = 16  # latest occurrences of an anchor whose backward match is measured
MAX_MATCH = 64  # a backward match is not extended further (longer ones draft the same length)
RESYNC = 3  # a prediction that diverged is re-aligned only at a match this long
# After a long match's draft is rejected (an edit: a renamed identifier, a changed operator), the output soon returns
# to the source a few tokens on. For RESYNC_SPAN output tokens after the mismatch, a row without a long enough match
# looks for its last token in the source from the mismatch on (as far as the tokens since it plus RESYNC_SLACK) and
# drafts what follows it there ("resync": its own odds, learnt like the others) instead of a plain step: in the suffix
# method, and in the hybrid while its draft model waits for its prefill (`weak`); where the draft model drafts, it
# keeps the row. Only after matches of at least RESYNC_FROM tokens (or a prediction): a short match that fails says
# nothing about where the text goes next.
# Where the output's last token is nowhere near in the source, the row guesses that what the output wrote replaced
# the mismatched token and drafts the source from the token after it ("skip", its own odds): a one-for-one fix ("and"
# -> "or") then continues drafted at once, and a renamed identifier from its last piece on.
RESYNC_FROM, RESYNC_SPAN, RESYNC_SLACK = 8, 24, 8
TOKEN_BYTES = 4  # the store keeps int32 token ids
# An edit that renames repeats itself: where the output left the prediction and came back to it, what it wrote instead
# (`new`) of what the prediction held there (`old`) is a substitution, and the rest of the prediction is drafted with
# it applied at each later occurrence of `old`, so a renamed identifier misses once, not at every use. Only
# replacements of at most SUB_MAX tokens each way (an insertion or a deletion has nothing to repeat); at most
# SUB_KEEP a request (the newest replaces an older one with the same `old`); one that the output declines (the
# original kept where it applied: the rename's scope ended, or an "and" -> "or" fix that was not a pattern) is
# dropped, and a draft rejected at its substituted token does not lower the prediction's odds.
SUB_MAX, SUB_KEEP = 8, 8
# A prediction's misses cluster where the edits are; past them it is the text again. So its odds forget a miss as the
# target accepts its tokens (each accepted token scales the earlier misses by this: half a miss after 23), where one
# early miss used to hold its drafts at 7-9 tokens for the rest of the answer. An unrelated prediction accepts
# little, so its misses stay.
PREDICTION_FORGET = 0.97
# A client sends a prediction to have it repeated, so an aligned one starts from these odds (its first draft 11 tokens
# on the Zen 4 curve; from 0.9 the first drafts ramped 3, 3, 7, 9); an unrelated one's own misses shorten it.
PREDICTION_PRIOR = 0.97
# An answer that repeats a prediction the prompt quotes often opens the way the prompt quotes it (a chat client pastes
# the file as "```python\n" + file, and the model answers "```python\n" + the edited file): the prompt's last
# LEAD_MAX tokens before its copy of the prediction's first LEAD_PROBE tokens are kept, and an answer whose first
# token is among them has the prediction drafted from there in its first round, not after two rounds of short context
# matches (the main job's predicted edits spent 66 ms on those, about 5% of an answer).
LEAD_MAX, LEAD_PROBE = 8, 8

# Verifying S tokens in one forward, in one-token steps (S = 1..): make bench's curve on the 2-core Zen 4 the issue
# names (8: 1.57, 12: 2.14, 16: 3.93), linear between the points and past 16 at the 12-16 slope. A deployment's
# own curve (bench.json's verify_cost_ms relative, or `Bundle.verify_cost`) replaces it.
_POINTS = ((1, 1.0), (8, 1.57), (12, 2.14), (16, 3.93))


def _interpolated(points: tuple[tuple[int, float], ...], n: int) -> list[float]:
    out = []
    for s in range(1, n + 1):
        lo = max((p for p in points if p[0] <= s), key=lambda p: p[0])
        hi = min((p for p in points if p[0] >= s), key=lambda p: p[0], default=None)
        if hi is None:  # past the last point: the last segment's slope
            (s0, c0), (s1, c1) = points[-2], points[-1]
            out.append(c1 + (s - s1) * (c1 - c0) / (s1 - s0))
        elif hi[0] == lo[0]:
            out.append(lo[1])
        else:
            out.append(lo[1] + (s - lo[0]) * (hi[1] - lo[1]) / (hi[0] - lo[0]))
    return out


VERIFY_COST: tuple[float, ...] = tuple(_interpolated(_POINTS, 64))


def best_draft(p: float, cap: int, cost: tuple[float, ...] | list[float]) -> tuple[int, float]:
    """The draft length L in 0..cap that maximises expected committed tokens per verify cost when each drafted
    token is accepted with probability p (independently): (1 - p^(L+1)) / (1 - p) tokens for cost[L] (the cost of
    verifying L + 1 tokens, cost[0] = 1), and those tokens per one-token step (L = 0, 1.0: no draft beats a plain
    step)."""
    best, best_l = 1.0, 0
    e, pk = 1.0, 1.0
    for L in range(1, min(cap, len(cost) - 1) + 1):
        pk *= p
        e += pk
        v = e / cost[L]
        if v > best:
            best, best_l = v, L
    return best_l, best


@dataclass
class Odds:
    """Drafted tokens the target accepted, per source and match-length bucket; the estimate starts from a prior
    that grows with the match (a long match repeats more often than a short one) and learns from every round."""

    accepted: dict[tuple[str, int], float] = field(default_factory=dict)
    tested: dict[tuple[str, int], float] = field(default_factory=dict)
    prior_n: float = 4.0  # the prior counts as this many tested tokens
    forget: float = 1.0  # < 1: each accepted token scales the earlier misses by this (PREDICTION_FORGET)

    @staticmethod
    def bucket(m: int) -> int:
        return min(m, MAX_MATCH).bit_length()

    def p(self, source: str, m: int) -> float:
        key = (source, self.bucket(m))
        prior = PREDICTION_PRIOR if source == "prediction" else m / (m + 2.0)
        return (self.accepted.get(key, 0) + self.prior_n * prior) / (self.tested.get(key, 0) + self.prior_n)

    def add(self, source: str, m: int, drafted: int, accepted: int) -> None:
        key = (source, self.bucket(m))
        a, t = self.accepted.get(key, 0), self.tested.get(key, 0)
        if self.forget < 1.0 and accepted:
            t = a + (t - a) * self.forget ** accepted
        self.accepted[key] = a + accepted
        self.tested[key] = t + accepted + (1 if accepted < drafted else 0)


class _Index:
    """Every ANCHOR-token window of a growing token list, by the position after it."""

    def __init__(self) -> None:
        self.toks: list[int] = []
        self.at: dict[tuple[int, ...], list[int]] = {}

    def extend(self, toks: list[int]) -> None:
        own = self.toks
        for t in toks:
            own.append(t)
            n = len(own)
            if n >= ANCHOR:
                self.at.setdefault(tuple(own[n - ANCHOR:]), []).append(n)

    def best(self, ctx: list[int], min_end: int = 0, near: int | None = None) -> tuple[int, int]:
        """(match length, position after the match) of the longest match of ctx's end among the latest
        occurrences ending before the list's end and at or after min_end; (0, -1) when none. Equal matches go to
        the latest occurrence, or with `near` to the first at or after it (then the last before it): an edit is
        local, so the output rejoins a prediction just past where it left it, not at a later line that also
        ends in "year % 4"."""
        if len(ctx) < ANCHOR:
            return 0, -1
        ends = self.at.get(tuple(ctx[-ANCHOR:]))
        if not ends:
            return 0, -1
        toks, L = self.toks, len(ctx)
        best_m, best_e = 0, -1
        seen = 0
        if near is None:
            order: Iterable[int] = reversed(ends)
        else:  # the occurrences nearest after `near` first, then those before it, nearest first
            i = bisect_left(ends, near)
            order = chain(ends[i:], reversed(ends[:i]))
        for e in order:
            if e >= len(toks) or e < min_end:
                continue
            m = ANCHOR
            while m < MAX_MATCH and m < e and m < L and toks[e - 1 - m] == ctx[L - 1 - m]:
                m += 1
            if m > best_m:  # ties keep the first in `order`: the latest, or the nearest to `near`
                best_m, best_e = m, e
            seen += 1
            if seen >= MAX_CANDIDATES or best_m >= MAX_MATCH:
                break
        return best_m, best_e


class SuffixStore:
    """Recent outputs of one deployment, token ids only, bounded to `budget` bytes (TOKEN_BYTES per token; the
    oldest outputs go first). Shared by every request of a served model; it changes which drafts are proposed,
    never which tokens are accepted, so answers do not depend on what was served before."""

    def __init__(self, budget: int):
        self.budget = int(budget)
        self.docs: deque[tuple[int, array]] = deque()
        self.tokens = 0
        self.next_id = 0
        self.at: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self.entries = 0
        self.odds = Odds()

    @property
    def bytes(self) -> int:
        return self.tokens * TOKEN_BYTES

    def add(self, toks: list[int]) -> None:
        """Keep one output (nothing when it alone exceeds the budget); drop the oldest until it fits."""
        if len(toks) < ANCHOR + 1 or len(toks) * TOKEN_BYTES > self.budget:
            return
        while self.docs and (self.tokens + len(toks)) * TOKEN_BYTES > self.budget:
            _, old = self.docs.popleft()
            self.tokens -= len(old)
        doc = array("i", toks)
        i = self.next_id
        self.next_id += 1
        self.docs.append((i, doc))
        self.tokens += len(doc)
        for n in range(ANCHOR, len(doc)):  # windows with a continuation after them
            self.at.setdefault(tuple(doc[n - ANCHOR:n]), []).append((i, n))
        self.entries += len(doc) - ANCHOR
        if self.entries > 2 * self.tokens + 64:  # dropped outputs' entries outnumber the live ones: rebuild
            live = {d for d, _ in self.docs}
            self.at = {k: kept for k, v in self.at.items() if (kept := [x for x in v if x[0] in live])}
            self.entries = sum(len(v) for v in self.at.values())

    def best(self, ctx: list[int]) -> tuple[int, list[int]]:
        """(match length, continuation of up to MAX_MATCH tokens) of the longest match of ctx's end."""
        if len(ctx) < ANCHOR or not self.docs:
            return 0, []
        ends = self.at.get(tuple(ctx[-ANCHOR:]))
        if not ends:
            return 0, []
        first = self.docs[0][0]
        docs = {i: d for i, d in self.docs}
        L = len(ctx)
        best_m, best = 0, None
        seen = 0
        for i, e in reversed(ends):
            if i < first:
                continue
            doc = docs[i]
            m = ANCHOR
            while m < MAX_MATCH and m < e and m < L and doc[e - 1 - m] == ctx[L - 1 - m]:
                m += 1
            if m > best_m:
                best_m, best = m, (doc, e)
            seen += 1
            if seen >= MAX_CANDIDATES:
                break
        if best is None:
            return 0, []
        doc, e = best
        return best_m, list(doc[e:e + 64])


def _lead_in(prompt: list[int], pred: list[int]) -> list[int]:
    """The prompt's tokens just before its last copy of the prediction's start (at most LEAD_MAX; none where the
    prompt does not quote it): what an answer quoting the prediction as the prompt does opens with."""
    n = min(len(pred), LEAD_PROBE)
    if n < ANCHOR:
        return []
    first, key = pred[0], pred[:n]
    for s in range(len(prompt) - n, 0, -1):
        if prompt[s] == first and prompt[s:s + n] == key:
            return prompt[max(0, s - LEAD_MAX):s]
    return []


class _Row:
    """One request's sources: its context index, its prediction and where the output is in it."""

    def __init__(self, req: Request):
        self.prompt_len = len(req.prompt)
        self.index = _Index()
        self.pred = list(req.prediction or [])
        self.lead = _lead_in(req.prompt, self.pred)  # the prompt's opening before its copy of the prediction
        self.pred_index = _Index()
        self.pred_index.extend(self.pred)
        self.pp: int | None = 0 if self.pred else None  # output so far == pred[:pp] (aligned), None: diverged
        # this request's own odds for its prediction: how good a prediction is belongs to the request that sent it
        # (the deployment's odds, shared by every request, had an unrelated file's rejections shorten the next
        # request's drafts from a right one, and the right one's acceptances lengthen a wrong one's)
        self.pred_odds = Odds(forget=PREDICTION_FORGET)
        self.seen = 0  # output tokens taken into pp
        self.subs: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # (old, new) substitutions, oldest first
        self.div: tuple[int, int] | None = None  # (prediction position, output index) of the last divergence
        self.last_sub = -1  # where the last prediction draft's first substituted token was (-1: none)
        # (source, match, draft, context length then, the source's tokens or None, where the draft starts in them)
        self.last: tuple[str, int, list[int], int, list[int] | None, int] | None = None
        self.resync: tuple[list[int], int, int] | None = None  # (source tokens, mismatch there, context length then)


class SuffixDrafter:  # a Drafter
    """Drafts the continuation of an aligned prediction or of the longest context or store match, whichever promises
    more a step, at the length the match's odds and the verify cost make best, at most `k` tokens. `min_match` > 0:
    rows whose best match (outside an aligned prediction) is shorter draft nothing (the hybrid's draft model takes
    them)."""

    def __init__(self, reqs: list[Request], k: int, dev, store: SuffixStore | None = None,
                 cost: tuple[float, ...] | list[float] = VERIFY_COST, min_match: int = ANCHOR, beat: float = 0.0):
        self.k, self.dev, self.store, self.cost, self.min_match = k, dev, store, cost, max(min_match, ANCHOR)
        # the hybrid's draft model's expected tokens per target step: a context or store draft expected to commit
        # fewer per step leaves its row to the model (0: every match long enough drafts)
        self.beat = beat
        self.width = k
        self.odds = store.odds if store is not None else Odds()
        self.rows = [_Row(r) for r in reqs]
        # `cache_prompt: false`: this request neither drafts from earlier requests' outputs nor leaves its own
        self.use_store = [r.cache_prompt for r in reqs]

    def prefill(self, prompts: list[list[int]]) -> None:
        pass

    def resume(self, handoffs: list[Handoff]) -> None:
        pass  # every row's state is rebuilt from its context on the first round

    def hand_off(self) -> None:
        return None

    def remember(self, outputs: list[list[int]]) -> None:
        """Finished rows' outputs into the store (not those of rows sent with `cache_prompt: false`)."""
        if self.store is not None:
            for t, use in zip(outputs, self.use_store, strict=True):
                if use:
                    self.store.add(t)

    def _update(self, row: _Row, c: list[int]) -> None:
        if row.last is not None:
            source, m, draft, at, toks, e = row.last
            new = c[at:at + len(draft)]
            n = 0
            while n < len(draft) and n < len(new) and draft[n] == new[n]:
                n += 1
            # n == len(new): the round verified fewer tokens than drafted (the load policy cut it): no rejection seen
            odds = row.pred_odds if source == "prediction" else self.odds
            if source == "prediction" and n == row.last_sub:
                odds.add(source, m, n, n)  # a substitution tried and declined: not the prediction's miss
            else:
                odds.add(source, m, len(draft) if n < len(new) else n, n)
            if toks is not None and (m >= RESYNC_FROM or source in ("prediction", "resync")):
                # the first mismatch with the source in what the target committed, its own token after the draft too
                n = 0
                while at + n < len(c) and e + n < len(toks) and n <= len(draft) and toks[e + n] == c[at + n]:
                    n += 1
                # a mismatch: re-sync from it; none (all the draft and the target's own token agreed): the row is
                # aligned again, and an older mismatch's point would only search behind it
                row.resync = (toks, e + n, at + n) if at + n < len(c) and n <= len(draft) else None
            row.last = None
        if row.pred:
            out = c[row.prompt_len:]
            if row.lead and out:
                self._open(row, out[0])
            j = row.seen
            while j < len(out) and row.pp is not None:
                step = self._advance(row, out, j)
                if step is None:  # the output is inside a substitution's `new`: wait for the rest
                    break
                if step == 0:
                    row.div, row.pp = (row.pp, j), None
                    break
                j += step
            row.seen = j if row.pp is not None else len(out)
            if row.pp is None or row.pp >= len(row.pred):
                m, e = row.pred_index.best(c, near=row.div[0] if row.div is not None else None)
                if m >= RESYNC:
                    self._learn(row, out, m, e)
                    row.pp, row.seen = e, len(out)
                else:
                    row.pp = None
        row.index.extend(c[len(row.index.toks):])

    def row_draft(self, b: int, c: list[int], min_match: int = 0) -> list[int]:
        """Row b's draft for context c (empty: no match worth drafting, or its best length is 0); `min_match` > 0
        replaces the drafter's own threshold for this call.

        An aligned prediction and the longest context or store match are both weighed: the one whose odds and the
        verify curve promise more tokens a step drafts (the prediction where they tie), so a prediction that keeps
        failing (an unrelated file realigned on a common trigram) no longer takes the rounds from a long match of the
        prompt or from the draft model."""
        row = self.rows[b]
        self._update(row, c)
        mm = min_match or self.min_match
        cands: list[tuple[str, int, list[int], list[int] | None, int]] = []  # (source, match, cont, toks, start)
        row.last_sub = -1
        if row.pp is not None and row.pp < len(row.pred):
            exp, sub_at = self._expected(row, len(c) - row.prompt_len - row.seen,
                                         self.k + RESYNC_SPAN + RESYNC_SLACK)
            if exp:
                cands.append(("prediction", MAX_MATCH, exp[:self.k], exp, 0))
        # after a mismatch with the context, equal matches go to the one nearest past it (as a prediction re-aligns)
        near = row.resync[1] if row.resync is not None and row.resync[0] is row.index.toks else None
        m1, e1 = row.index.best(c, near=near)
        m2, cont2 = self.store.best(c) if self.store is not None and self.use_store[b] else (0, [])
        if max(m1, m2) >= mm:
            if m1 >= m2:
                cands.append(("context", m1, row.index.toks[e1:e1 + self.k], row.index.toks, e1))
            else:
                cands.append(("store", m2, cont2[:self.k], None, 0))
        elif not cands and row.resync is not None and mm <= ANCHOR:  # not where the hybrid's draft model would draft
            rejoin = self._rejoin(row, c)
            if rejoin is not None:
                source, toks, j = rejoin
                cands.append((source, 1, toks[j:j + self.k], toks, j))
        best: tuple[float, int, tuple] | None = None
        for cand in cands:
            source, m, cont = cand[:3]
            if not cont:
                continue
            odds = row.pred_odds if source == "prediction" else self.odds
            L, value = best_draft(odds.p(source, m), min(len(cont), self.k), self.cost)
            if not min_match and source in ("context", "store") and value < self.beat:
                continue  # the draft model expects more from this round than this match does
            if L and (best is None or value > best[0]):
                best = (value, L, cand)
        if best is None:
            return []
        _, L, (source, m, cont, toks, e) = best
        draft = cont[:L]
        row.last = (source, m, draft, len(c), toks, e)
        if source == "prediction" and 0 <= sub_at < L:
            row.last_sub = sub_at
        return draft

    @staticmethod
    def _open(row: _Row, first: int) -> None:
        """At the answer's first token (the lead-in is read once, before anything is aligned): where the prediction
        does not start with it but the prompt's lead-in to its copy of the prediction holds it, the rest of that
        lead-in goes before the prediction (aligned at once)."""
        lead, row.lead = row.lead, []
        if first != row.pred[0] and first in lead:
            i = len(lead) - 1 - lead[::-1].index(first)
            row.pred = lead[i:] + row.pred
            row.pred_index = _Index()
            row.pred_index.extend(row.pred)

    @staticmethod
    def _advance(row: _Row, out: list[int], j: int) -> int | None:
        """Output tokens from out[j] that follow the aligned prediction at row.pp (advancing it): a substitution's
        `new` for its `old`, else one token; 0 where the output leaves the prediction; None where out ends inside a
        substitution's `new`. A substitution whose `old` was kept instead is dropped."""
        pred, pp = row.pred, row.pp
        for i, (old, new) in enumerate(row.subs):
            if tuple(pred[pp:pp + len(old)]) != old:
                continue
            got = tuple(out[j:j + len(new)])
            if got == new:
                row.pp = pp + len(old)
                return len(new)
            if len(got) < len(new) and got == new[:len(got)]:
                return None
            if tuple(out[j:j + len(old)]) == old or (len(out) - j < len(old) and pred[pp] == out[j]):
                del row.subs[i]  # the original kept here
                break
        if pp < len(pred) and pred[pp] == out[j]:
            row.pp = pp + 1
            return 1
        return 0

    @staticmethod
    def _learn(row: _Row, out: list[int], m: int, e: int) -> None:
        """After a divergence, the output back on the prediction (its last m tokens = pred[e - m:e]): what it wrote
        between the two, in place of what the prediction held, becomes a substitution (SUB_MAX)."""
        if row.div is None:
            return
        (dp, dj), row.div = row.div, None
        po, oo = e - m, len(out) - m
        if po < dp or oo < dj:
            return
        old, new = tuple(row.pred[dp:po]), tuple(out[dj:oo])
        if not (1 <= len(old) <= SUB_MAX and 1 <= len(new) <= SUB_MAX) or old == new:
            return
        row.subs = [s for s in row.subs if s[0] != old][-(SUB_KEEP - 1):] + [(old, new)]

    @staticmethod
    def _expected(row: _Row, pending: int, n: int) -> tuple[list[int], int]:
        """Up to n tokens the aligned prediction says come next, substitutions applied, past the `pending` output
        tokens already inside one; and where the first substituted token is among them (-1: none)."""
        pred, i, toks, first = row.pred, row.pp, [], -1
        if not row.subs and not pending:  # the common case: the prediction as it is
            return pred[i:i + n], -1
        while len(toks) < n + pending and i < len(pred):
            for old, new in row.subs:
                if tuple(pred[i:i + len(old)]) == old:
                    if first < 0 and len(toks) >= pending:
                        first = len(toks) - pending
                    toks.extend(new)
                    i += len(old)
                    break
            else:
                toks.append(pred[i])
                i += 1
        return toks[pending:pending + n], first

    @staticmethod
    def _rejoin(row: _Row, c: list[int]) -> tuple[str, list[int], int] | None:
        """Where in the source the output goes on after a mismatch, for RESYNC_SPAN tokens (then the mismatch is
        forgotten), looking from the mismatch to RESYNC_SLACK past the tokens written since: ("resync", source, just
        past the first occurrence of the output's last token there); else, while no token written since the mismatch
        is there, ("skip", source, just past the mismatched token): the guess that what the output wrote replaced it
        ("and" -> "or", the last piece of a renamed identifier); None otherwise."""
        toks, e0, at = row.resync
        since = len(c) - at
        if since > RESYNC_SPAN:
            row.resync = None
            return None
        near = range(e0, min(len(toks) - 1, e0 + since + RESYNC_SLACK))
        j = next((i + 1 for i in near if toks[i] == c[-1]), -1)
        if j >= 0:
            return "resync", toks, j
        if e0 + 1 < len(toks) and not {toks[i] for i in near}.intersection(c[at:]):
            return "skip", toks, e0 + 1
        return None

    def lookup_rows(self, ctx: list[list[int]]) -> list[list[int]]:
        return [self.row_draft(b, c) for b, c in enumerate(ctx)]

    def weak(self, b: int, c: list[int]) -> list[int]:
        """Row b's draft from any match (ANCHOR tokens on), for a round it would otherwise take as a plain step (the
        hybrid's draft model not yet prefilled): verifying a few tokens costs about one step, so a short match's
        odds still pay. Call after lookup_rows found this row nothing in the same round."""
        return self.row_draft(b, c, ANCHOR)

    def propose(self, ctx: list[list[int]], pos: Tensor, gens: list[torch.Generator]):
        found = self.lookup_rows(ctx)
        out = torch.zeros(len(found), max([0] + [len(f) for f in found]), dtype=torch.long)
        for b, f in enumerate(found):
            out[b, :len(f)] = torch.tensor(f, dtype=torch.long)
        return out.to(self.dev), None, [len(f) for f in found]


def suffix_store(b) -> SuffixStore | None:
    """The deployment's store of recent outputs (made on first use from speculation.suffix_store_bytes)."""
    budget = b.spec.suffix_store_bytes
    if budget <= 0:
        return None
    if b.suffix_store is None or b.suffix_store.budget != budget:
        b.suffix_store = SuffixStore(budget)
    return b.suffix_store


def _loop_opts(opts: dict, rows: int) -> dict:
    """speculate's options. The load policy (loadpolicy.py) only where rows share the batch: it caps every row at
    the draft model's k, and a lone row's long match should draft what its odds and the verify curve say."""
    out = {k: opts[k] for k in ("yield_to", "resume", "on_finish", "prompt_cache") if k in opts}
    if rows > 1 and opts.get("policy") is not None:
        out["policy"] = opts["policy"]
    return out


class Suffix:
    """`decode`'s suffix: the suffix drafter alone (a row without a match decodes a plain step that round)."""

    name, resumable = "suffix", True
    adaptive = True  # decode passes the load policy (used from two rows up)
    policy_from_rows = 2  # a lone row drafts what its odds and the verify curve say (`_loop_opts`)

    def available(self, b) -> bool:
        return b.max_draft_len > 0

    @torch.inference_mode()
    def run(self, b, reqs: list[Request], k: int, on_emit, **opts):
        drafter = SuffixDrafter(reqs, k, b.target.embed.weight.device, suffix_store(b), b.verify_cost)
        return speculate(b.target, reqs, k, on_emit, drafter, **_loop_opts(opts, len(reqs)))


class Hybrid:
    """`decode`'s hybrid: per round and row, the suffix draft where its match is at least speculation.suffix_min_match
    tokens (or the prediction is aligned), the draft model's k tokens elsewhere; both exact (deterministic drafts
    accepted by matching, the draft model's by Leviathan's rule when sampling)."""

    name, resumable = "hybrid", True
    adaptive = True
    policy_from_rows = 2  # a lone row: the suffix's drafts by their odds, the model's unless the policy rules it out

    def available(self, b) -> bool:
        return b.draft is not None and b.max_draft_len > 0

    @torch.inference_mode()
    def run(self, b, reqs: list[Request], k: int, on_emit, **opts):
        sp = b.spec
        if b.draft.cfg.vocab_size != b.target.cfg.vocab_size:
            raise ValueError(f"draft vocab_size {b.draft.cfg.vocab_size} differs from the target's "
                             f"{b.target.cfg.vocab_size}; the draft must share the target's tokenizer")
        # pick-k's expected tokens per target step for the draft model at its k (the stored table): a suffix match
        # expected to commit less per step leaves the row to the model (validate's chat prompts: short matches of
        # code quoted from the question drafted at p 0.3-0.5, where the model's drafts were accepted 0.84)
        beat = float(((b.draft_config or {}).get("speculation") or {}).get("expected_speedup") or 0.0)
        lookup = SuffixDrafter(reqs, sp.max_draft_len, b.target.embed.weight.device, suffix_store(b), b.verify_cost,
                               sp.suffix_min_match, beat)
        # A lone row takes no load policy (`_loop_opts`), but where the policy's prior says the draft model cannot
        # pay even there, its rounds draft from the suffix alone and step plainly elsewhere: the small spec's hybrid
        # had been sent to plain steps whole (the scheduler's `off`), its edits at 0.4-0.5x the suffix's speed.
        model_off = len(reqs) == 1 and plain_from(opts.get("policy"), 1) == 1
        drafter = _ModelDrafter(b.draft, reqs, k, b.target.cfg.vocab_size, lookup, opts.get("draft_confidence",
                                sp.draft_confidence), opts.get("use_draft_logits", sp.use_draft_logits),
                                opts.get("prompt_cache"), model_off)
        return speculate(b.target, reqs, k, on_emit, drafter, **_loop_opts(opts, len(reqs)))


SUFFIX, HYBRID = Suffix(), Hybrid()

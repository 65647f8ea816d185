"""Draft-target speculative decoding and prompt lookup on the static-cache runtime.

Each round a drafter proposes up to k tokens per row, the target verifies [last, d1..dk] in one
forward pass, and every row keeps its own number of tokens: positions are per row and stale K/V
past a row's position is invisible, so rejection needs no cleanup.

Notation follows Leviathan et al. and Hugging Face: p = target, q = draft. Greedy rows accept
while the draft token equals the target's argmax; sampling rows use the rejection rule
(`leviathan_accept`) with the same warping (`sampling.warp`) on both sides, so the output
distribution is the target's. Prompt lookup's drafts are deterministic (q is one-hot), so
sampling the target and accepting on equality (`match_accept`) is exact.

The draft keeps its own cache at the same positions. Its first step of every round feeds the two
newest committed tokens [prev, last] together: this fills the hole left when all k drafts were
accepted (the draft never saw d_k) at no extra forward, and merely rewrites an existing slot
otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from pipeline.runtime import kernels, quant
from pipeline.runtime.engine_io import load_model_dir
from pipeline.runtime.generate import (
    Emit,
    Handoff,
    OnFinish,
    Request,
    Result,
    Sequence,
    YieldTo,
    finish,
    finish_or_hand_off,
    grow,
    prefill,
    report_finished,
    resume_cache,
    row_stats,
    start_length,
)
from pipeline.runtime.gguf_weights import GGUFLinear
from pipeline.runtime.loadpolicy import DraftPolicy
from pipeline.runtime.model import Transformer
from pipeline.runtime.prompt_cache import PromptCache, keep_rows, prefill_cached, rows_to_run
from pipeline.runtime.quant import QLinear
from pipeline.runtime.sampling import SamplingParams, greedy, next_token, sample, warp
from pipeline.runtime.specconfig import Drafter

Residual = Callable[[Tensor, Tensor], Tensor]

DRAFT_HEAD_FILE = "draft_head.safetensors"
# A draft model behind a lookup (hybrid) prefills a long prompt only once the lookup keeps failing: an editor's
# request (a file, then the file again with an edit) is mostly drafted from the prompt itself, and the 0.5B draft's
# prefill of a 500-token file cost about 1 s of a 2.4 s answer (edit set, 2026-12-04). Ski rental: a row whose
# uncached prompt has at least DEFER_MIN tokens takes plain steps in the rounds the lookup finds nothing, for one such
# round per DEFER_RATE uncached tokens (the draft's prefill costs about 2 ms a token here, and the draft model saves
# about half of a 35 ms target step per token it drafts), then prefills and drafts as usual; shorter prompts prefill
# in the first round that drafts (as every row does without a lookup). Speed only: drafts never change the output.
DEFER_MIN, DEFER_RATE = 256, 8
CATCH_UP_CHUNK = 64  # a row further behind than this is caught up by a chunked prefill before the padded forward


@kernels.torch_on_caller()
def residual(p: Tensor, q: Tensor) -> Tensor:
    """Leviathan's correction distribution norm(max(p - q, 0)); p itself if that vanishes (fp underflow). On the
    calling thread alone, as sampling.warp."""
    r = (p - q).clamp_min(0)
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 0, r / s.clamp_min(1e-30), p)


@dataclass
class DraftProbs:
    """One row's draft distributions, as leviathan_accept reads them: `at` [k], each draft token's own probability,
    and `rows` [k, R] over the draft head's vocabulary, whose tokens are `ids` [R] in the target's (None: the same
    vocabulary of `vocab`). Only the first rejection's row is expanded to the target's vocabulary (`row`): all k had
    been, a [k, 151,936] fill and copy a round, 3.5% of draft_target's time at T = 1 on the flagship."""

    at: Tensor
    rows: Tensor
    ids: Tensor | None
    vocab: int

    def row(self, i: int) -> Tensor:
        r = self.rows[i]
        if self.ids is None:
            return r
        with kernels.torch_on_caller():
            return torch.zeros(self.vocab, dtype=r.dtype, device=r.device).index_copy_(0, self.ids, r)


def leviathan_accept(p: Tensor, q: Tensor | DraftProbs, drafts: Tensor, g: torch.Generator,
                     residual_fn: Residual = residual) -> tuple[int, int]:
    """One row: target probs p [k+1, V], draft probs q [k, V] (or a DraftProbs), drafts [k] sampled from q.

    Accept d_i with probability min(1, p_i(d_i)/q_i(d_i)); at the first rejection sample from
    residual_fn(p_i, q_i); when all k pass, the bonus token comes from p_{k+1}.
    Returns (accepted count n, the token committed after them).
    """
    k = drafts.shape[0]
    idx = torch.arange(k)
    if not isinstance(q, DraftProbs):
        q = DraftProbs(q[idx, drafts], q, None, q.shape[-1])
    pd, qd = p[idx, drafts], q.at[:k]
    u = torch.rand(k, generator=g)
    ok = (u * qd <= pd).to(torch.int64)
    n = int(ok.cumprod(0).sum())
    if n == k:
        return n, int(sample(p[k], g))
    return n, int(sample(residual_fn(p[n], q.row(n)), g))


def match_accept(p: Tensor, drafts: list[int], g: torch.Generator) -> tuple[int, int]:
    """One row with deterministic drafts: sample the target position by position, accept while equal."""
    for i, d in enumerate(drafts):
        t = int(sample(p[i], g))
        if t != d:
            return i, t
    return len(drafts), int(sample(p[len(drafts)], g))


def attach_draft_head(model: Transformer, weight: Tensor | QLinear, ids: Tensor) -> Transformer:
    """Give a draft a reduced-vocabulary head: logits over `ids` only (the draft's q is 0 elsewhere).

    `weight` is a [len(ids), H] tensor or an already quantized QLinear head.
    """
    if isinstance(weight, QLinear):
        model.lm_head = weight
        model.vocab_ids = ids.to(device=weight.qweight.device, dtype=torch.long)
    else:
        head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        head.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        model.lm_head = head
        model.vocab_ids = ids.to(device=weight.device, dtype=torch.long)
    if model.vocab_ids.device.type == "cpu" and kernels.available():
        quant.tile_model(model)  # the head in the layout the CPU kernels read, as the model's own layers
    return model


def load_draft(engine_dir: Path, device: str = "cpu", verify: bool = True) -> tuple[Transformer, dict]:
    """Load engines/<name>/draft, with its reduced-vocabulary head when the build made one."""
    model, cfg = load_model_dir(engine_dir, device, verify=verify)
    if (engine_dir / DRAFT_HEAD_FILE).is_file():
        st = load_file(str(engine_dir / DRAFT_HEAD_FILE))
        dev = model.embed.weight.device
        head = (QLinear(st["qweight"].to(dev), st["scales"].to(dev),
                        act8=quant.int8_activations(cfg) and st["qweight"].dtype == torch.uint8) if "qweight" in st
                else GGUFLinear(st["gguf_w"].to(dev), st["gguf_parts"]) if "gguf_w" in st  # a GGUF head's own rows
                else st["weight"].to(device=dev, dtype=model.embed.weight.dtype))
        attach_draft_head(model, head, st["ids"])
    return model, cfg


class _Stats:
    def __init__(self, k: int, carried: dict | None = None):
        d = row_stats(carried or {}, k)
        self.steps, self.proposed, self.accepted = d["steps"], d["draft_proposed"], d["draft_accepted"]
        self.acc_pos, self.prop_pos = d["accepted_per_position"], d["proposed_per_position"]

    def add(self, proposed: int, accepted: int) -> None:
        grow = proposed - len(self.prop_pos)
        if grow > 0:
            self.prop_pos += [0] * grow
            self.acc_pos += [0] * grow
        self.steps += 1
        self.proposed += proposed
        self.accepted += accepted
        for i in range(proposed):
            self.prop_pos[i] += 1
        for i in range(accepted):
            self.acc_pos[i] += 1

    def as_dict(self) -> dict:
        return {"steps": self.steps, "draft_proposed": self.proposed, "draft_accepted": self.accepted,
                "accepted_per_position": self.acc_pos, "proposed_per_position": self.prop_pos}


class _ModelDrafter:  # a Drafter
    """k sequential draft steps per round; returns drafts [B, k] and, for sampling rows, q [k, V].

    `fed[b]` counts the context tokens the draft's cache holds for row b. A round first feeds the
    ones it lacks (usually the token the target just committed, two when all drafts were accepted)
    in one padded forward, then drafts. The drafts it fed on the way (`sent[b]`) count as held once
    the target commits them, so accepted drafts are never fed twice. With `lookup`, a row whose
    context ends in an n-gram of at least `lookup.min_ngram` tokens seen earlier takes the
    prompt-lookup continuation instead (q is one-hot, so acceptance is by matching), and the draft
    model does not run at all when every row found one; its cache catches up on the next model round.
    """

    def __init__(self, draft: Transformer, reqs: list[Request], k: int, vocab: int,
                 lookup: _LookupDrafter | None = None, confidence: float = 0.0, keep_q: bool = True,
                 prompt_cache: PromptCache | None = None, model_off: bool = False):
        self.model, self.k, self.vocab, self.lookup, self.confidence = draft, k, vocab, lookup, confidence
        self.model_off = model_off  # drafts from the lookup alone: a row it finds nothing for steps plainly
        self.k_max = k  # the most it drafts; `k` is this round's width when a DraftPolicy sets one (`narrow`)
        self.prompt_cache = prompt_cache  # the draft's K/V is cached next to the target's (kind "draft")
        self.use = [r.cache_prompt for r in reqs]
        self.keep_q = keep_q  # False: sampled rows are accepted by matching, so q is not needed
        self.width = max(k, lookup.k if lookup else 0)
        self.cache = draft.new_cache(len(reqs), start_length(reqs, self.width + 2))
        self.ids = getattr(draft, "vocab_ids", None)
        self.dev = draft.embed.weight.device
        self.sampled = [b for b, r in enumerate(reqs) if not r.params.greedy]
        self.params = [r.params for r in reqs]
        self.fed = [0] * len(reqs)
        self.sent: list[list[int]] = [[] for _ in reqs]
        self.wait = [0] * len(reqs)  # lookup-less rounds a row still takes without its prefill (DEFER_MIN)

    def prefill(self, prompts: list[list[int]]) -> None:
        """Load each row's cached prefix; the rest of the prompt runs when the draft model first drafts (`_catch_up`,
        in prefill's chunks), so a batch the load policy keeps on plain steps never pays the draft's prefill (four
        chat requests at once did, about 15% of their time), and with a lookup a long prompt waits (DEFER_MIN)."""
        self.sent = [[] for _ in prompts]
        self.fed = rows_to_run(self.prompt_cache, "draft", prompts, self.cache, self.use)
        if self.lookup is not None:
            self.wait = [(len(p) - f) // DEFER_RATE if len(p) - f >= DEFER_MIN else 0
                         for p, f in zip(prompts, self.fed)]

    def _fill(self, b: int, ctx: list[int], upto: int) -> None:
        """Row b's K/V for ctx[fed:upto], in prefill's chunks (a deferred prompt, a long catch-up)."""
        if upto > self.fed[b]:
            prefill(self.model, self.cache.rows(b, b + 1), [ctx[:upto]], [self.fed[b]])
            self.fed[b] = upto

    def keep(self, ctx: list[list[int]], done: list[bool]) -> None:
        """Finished rows' context (prompt + answer, as far as this cache holds it) into the prompt cache."""
        keep_rows(self.prompt_cache, "draft", ctx, self.cache, [u and d for u, d in zip(self.use, done)], self.fed)

    def resume(self, handoffs: list[Handoff]) -> None:
        """Take back the draft K/V rows handed off with the target's; prefill rows that bring none (requests
        that joined through the continuous batch) on their own, so the first round's catch-up stays short
        for every row instead of padding all of them to the longest context."""
        self.sent, self.wait = [[] for _ in handoffs], [0] * len(handoffs)
        self.cache = grow(self.cache, max(h.cur for h in handoffs) + self.width + 2)
        for b, h in enumerate(handoffs):
            if h.draft is not None:
                cache, row, fed = h.draft
                fed = min(fed, h.cur, self.cache.length)
                self.cache.copy_row(b, cache, row, fed)
                self.fed[b] = fed
            elif h.cur > 0:
                ctx, row = [(h.seq.req.prompt + h.seq.tokens)[:h.cur]], self.cache.rows(b, b + 1)
                prefill(self.model, row, ctx, rows_to_run(self.prompt_cache, "draft", ctx, row, [self.use[b]]))
                self.fed[b] = h.cur

    def hand_off(self) -> list[tuple]:
        """Each row's draft state for its Handoff: (cache, row, context tokens whose K/V it holds)."""
        return [(self.cache, b, f) for b, f in enumerate(self.fed)]

    def narrow(self, k: int) -> None:
        """Draft at most `k` (1..k_max) tokens this round (the draft steps are the round's cost)."""
        self.k = max(1, min(k, self.k_max))

    def _catch_up(self, ctx: list[list[int]], pos: Tensor) -> Tensor:
        """Feed every row's missing context tokens (rows with fewer re-feed earlier ones: same K/V); return
        each row's hidden state at its newest token."""
        m, dev = self.model, self.dev
        P = pos.tolist()
        for b, sent in enumerate(self.sent):
            f = self.fed[b]
            for t in sent:
                if f >= P[b] or ctx[b][f] != t:  # the newest token is always fed: its hidden state drafts
                    break
                f += 1
            self.fed[b], self.sent[b] = f, []
            if P[b] - f > CATCH_UP_CHUNK:  # far behind (a deferred prefill, many plain steps): chunked, row alone
                self._fill(b, ctx[b], P[b])
        G = max(p + 1 - f for p, f in zip(P, self.fed))
        toks, at, where = [], [], []
        for b, p in enumerate(P):
            s = max(0, p + 1 - G)
            seg = ctx[b][s:p + 1]
            pad = G - len(seg)
            toks.append(seg + [0] * pad)
            at.append(list(range(s, p + 1)) + [min(p + 1 + j, self.cache.length - 1) for j in range(pad)])
            where.append(p - s)
            self.fed[b] = p + 1
        h = m(torch.tensor(toks, device=dev), torch.tensor(at, device=dev), self.cache)
        return h[torch.arange(len(P), device=dev), torch.tensor(where, device=dev)]

    def propose(self, ctx: list[list[int]], pos: Tensor, gens: list[torch.Generator]):
        self.cache = grow(self.cache, int(pos.max()) + self.width + 2)  # K/V taken as the rows advance
        m, k, dev = self.model, self.k, self.dev
        B = len(ctx)
        found = self.lookup.lookup_rows(ctx) if self.lookup is not None else [[]] * B
        if any(self.wait):
            idle = [b for b in range(B) if not found[b] and self.wait[b]]  # deferred rows the lookup left
            if any(not found[b] and not self.wait[b] for b in range(B)):
                self.wait = [0] * B  # the model runs this round anyway: every row is caught up and drafts with it
            else:
                weak = getattr(self.lookup, "weak", None)  # the suffix drafter's short matches (not prompt lookup's)
                for b in idle:
                    self.wait[b] -= 1
                    if weak is not None:
                        found[b] = weak(b, ctx[b])
                return _padded(found, dev), {}, [len(f) for f in found]
        if all(found) or self.model_off:
            return _padded(found, dev), {}, [len(f) for f in found]
        h = self._catch_up(ctx, pos)
        w = max([k] + [len(f) for f in found])
        drafts = torch.zeros(B, w, dtype=torch.long, device=dev)
        qs = {b: [] for b in self.sampled if not found[b]}
        limit = [len(f) or k for f in found]
        going = [not f for f in found]
        fed = 0
        for i in range(k):
            logits = m.logits(h)
            d, top = kernels.argmax_prob(logits, with_prob=self.confidence > 0)
            for b in qs:
                q = warp(logits[b], self.params[b])
                d[b] = sample(q, gens[b])
                qs[b].append((q, int(d[b])))
            if self.ids is not None:
                d = self.ids[d]
            drafts[:, i] = d
            if self.confidence > 0:
                # stop a row after the first draft token the draft itself doubts (dynamic draft length)
                low = (top < self.confidence).tolist()
                for b in range(B):
                    if going[b] and low[b]:
                        going[b], limit[b] = False, i + 1
                if not any(going):
                    break
            if i + 1 < k:
                h = m(d[:, None], (pos + 1 + i)[:, None], self.cache)[:, 0]
                fed += 1
        self.sent = drafts[:, :fed].tolist()
        if any(found):
            looked = torch.tensor([bool(f) for f in found], device=dev)[:, None]
            drafts = torch.where(looked, _padded(found, dev, w), drafts)
        drafts = drafts[:, :max(limit)]
        full = {}
        for b, q in qs.items() if self.keep_q else ():
            rs, ts = zip(*q[:limit[b]])
            rows = torch.stack(rs)
            at = rows[torch.arange(rows.shape[0]), torch.tensor(ts)]
            full[b] = DraftProbs(at, rows, self.ids, self.vocab)
        return drafts, full, limit


def _padded(found: list[list[int]], dev, width: int = 0) -> Tensor:
    """Per-row token lists as a zero-padded [B, max(width, longest)] tensor."""
    out = torch.zeros(len(found), max([width] + [len(f) for f in found]), dtype=torch.long)
    for b, f in enumerate(found):
        out[b, :len(f)] = torch.tensor(f, dtype=torch.long)
    return out.to(dev)


class _LookupDrafter:  # a Drafter
    """Prompt lookup: the continuation after the latest earlier occurrence of the context's last n-gram."""

    def __init__(self, k: int, max_ngram: int, dev, min_ngram: int = 1):
        self.k, self.max_ngram, self.dev, self.min_ngram = k, max_ngram, dev, min_ngram
        self.width = k  # the widest proposal, for sizing the target's cache

    def prefill(self, prompts: list[list[int]]) -> None:
        pass

    def resume(self, handoffs: list[Handoff]) -> None:
        pass

    def keep(self, ctx: list[list[int]], done: list[bool]) -> None:
        pass

    def hand_off(self) -> None:
        return None

    def lookup_rows(self, ctx: list[list[int]]) -> list[list[int]]:
        return [self.lookup(c) for c in ctx]

    def lookup(self, ctx: list[int]) -> list[int]:
        L = len(ctx)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            tail = ctx[L - n:]
            first = tail[0]
            for s in range(L - n - 1, -1, -1):
                if ctx[s] == first and ctx[s:s + n] == tail:
                    return ctx[s + n:s + n + self.k]
        return []

    def propose(self, ctx: list[list[int]], pos: Tensor, gens: list[torch.Generator]):
        found = [self.lookup(c) for c in ctx]
        return _padded(found, self.dev), None, [len(f) for f in found]


def speculate(target: Transformer, reqs: list[Request], k: int, on_emit: Emit | None, drafter: Drafter,
              residual_fn: Residual = residual, yield_to: YieldTo | None = None,
              resume: list[Handoff] | None = None, on_finish: OnFinish | None = None,
              prompt_cache: PromptCache | None = None, policy: DraftPolicy | None = None) -> list[Result | Handoff]:
    """The shared loop. A sampled row the drafter returns no q for is accepted by matching the target's own
    sample (deterministic drafts, or use_draft_logits=false): exact too, with lower acceptance than
    Leviathan's rule. When `yield_to()` turns true between rounds, unfinished rows come back as Handoffs;
    `resume` (Handoffs, with `reqs` their requests) continues such rows speculatively from their K/V.
    `on_finish(b, result)` hears of each row as it finishes (the returned list has its Result too).
    `prompt_cache`: prompts start from their cached prefix (target and draft), and finished rows' prompt + answer
    are kept when the loop ends (rows handed off are kept by the continuous batch that finishes them).
    `policy` (pipeline.runtime.loadpolicy): each round's per-row draft lengths (at most k, 0 = that row only
    verifies its last token; all 0 = a plain step without the drafter) from the batch's rows, the measured costs and
    each row's running acceptance; None: every row drafts k every round."""
    dev = target.embed.weight.device
    B = len(reqs)
    all_greedy = all(r.params.greedy for r in reqs)
    length = start_length(reqs, drafter.width + 2, max(h.cur for h in resume) if resume else 0)
    if resume:
        start: float | list[float] = [h.start for h in resume]
        seqs, gens = [h.seq for h in resume], [h.gen for h in resume]
        stats = [_Stats(k, h.stats) for h in resume]
        cache = resume_cache(target, resume, length)
        drafter.resume(resume)  # draft K/V handed off with the rows; round one feeds what it lacks
        ctx = [h.seq.req.prompt + h.seq.tokens for h in resume]
        pos = torch.tensor([h.cur for h in resume], device=dev)
    else:
        start = time.perf_counter()
        seqs = [Sequence(r) for r in reqs]
        gens = [r.params.generator() for r in reqs]
        stats = [_Stats(k) for _ in reqs]
        prompts = [r.prompt for r in reqs]
        cache = target.new_cache(B, length)
        hidden, reused = prefill_cached(target, cache, prompts, prompt_cache, "target", [r.cache_prompt for r in reqs])
        logits = target.logits(hidden, all_greedy)
        for s, n in zip(seqs, reused):
            s.cached = n
        ctx = [list(p) for p in prompts]
        for b, s in enumerate(seqs):
            t = next_token(logits[b], s.req.params, gens[b])
            ctx[b].append(t)
            emitted = s.extend([t])
            if emitted and on_emit:
                on_emit(b, emitted)
        pos = torch.tensor([len(p) for p in prompts], device=dev)
    reported = [False] * B
    report_finished(seqs, reported, start, lambda b: stats[b].as_dict(), on_finish)
    if not resume and not all(s.done for s in seqs):
        # The draft's prefill after the first tokens went out: it delays the second token, not the first (same
        # tokens: it draws no random numbers), and a request answered by its first token never pays it.
        drafter.prefill([r.prompt for r in reqs])
    while not all(s.done for s in seqs):
        if yield_to is not None and yield_to():
            return finish_or_hand_off(seqs, start, [st.as_dict() for st in stats], gens, cache, pos.tolist(),
                                      [c[-1] for c in ctx], drafter.hand_off())
        if policy is None:
            # A round commits at most its drafts + 1 and a row emits at most max_new_tokens, so drafts past a row's
            # room are verified and never emitted (a capped answer's last round verified 12 tokens for 1 or 5 left:
            # 76-83 ms where 22-30 do); the load policy caps the same way (loadpolicy.choose).
            room = [-1 if s.done else s.req.max_new_tokens - len(s.tokens) - 1 for s in seqs]
            if max(room) <= 0:  # every row's next token is its last: a plain step
                drafts, q, limit = torch.zeros(B, 0, dtype=torch.long, device=dev), None, [0] * B
            else:
                if hasattr(drafter, "narrow") and max(room) < drafter.k_max:
                    drafter.narrow(max(room))  # rows' room only shrinks, so this never has to widen again
                drafts, q, limit = drafter.propose(ctx, pos, gens)
                limit = [max(0, min(lb, r)) for lb, r in zip(limit, room)]
                drafts = drafts[:, :max(limit)]
        else:
            ks = policy.lengths([(s.done, s.req.max_new_tokens - len(s.tokens), st.acc_pos, st.prop_pos)
                                 for s, st in zip(seqs, stats)])
            if max(ks) == 0:  # a plain step: the drafter catches up on the next round that drafts
                drafts, q, limit = torch.zeros(B, 0, dtype=torch.long, device=dev), None, [0] * B
            else:
                if hasattr(drafter, "narrow"):
                    drafter.narrow(max(ks))
                drafts, q, limit = drafter.propose(ctx, pos, gens)
                limit = [min(lb, kb) for lb, kb in zip(limit, ks)]
                drafts = drafts[:, :max(limit)]
        w = drafts.shape[1]
        last = torch.tensor([c[-1] for c in ctx], device=dev)
        cache = grow(cache, int(pos.max()) + w + 1)  # K/V taken as the rows advance
        if w == 0:
            # A plain step (the policy's, or every row's last token): the baseline's own step, none of the drafts'
            # checks. After a step's weights streamed by each torch op costs tens of us, and the dozen the checks
            # take had made a small model's plain steps here a few percent slower than generate's.
            logits = target.logits(target(last[:, None], pos[:, None], cache)[:, 0], all_greedy)
            best = greedy(logits).tolist()
            nxt_list = [best[b] if s.done or s.req.params.greedy else next_token(logits[b], s.req.params, gens[b])
                        for b, s in enumerate(seqs)]
            n_list, d_list = [0] * B, [[]] * B
        else:
            tokens = torch.cat([last[:, None], drafts], 1)
            p_logits = target.logits(target(tokens, pos[:, None] + torch.arange(w + 1, device=dev), cache),
                                     all_greedy)
            best = greedy(p_logits)
            lim = torch.tensor(limit, device=dev)
            match = (drafts == best[:, :w]) & (torch.arange(w, device=dev) < lim[:, None])
            n_greedy = match.to(torch.int64).cumprod(1).sum(1)
            nxt = best.gather(1, n_greedy[:, None])[:, 0]
            n_list, nxt_list, d_list = n_greedy.tolist(), nxt.tolist(), drafts.tolist()
        if w and not all_greedy:
            for b, s in enumerate(seqs):
                if s.done or s.req.params.greedy:
                    continue
                p = warp(p_logits[b], s.req.params)
                if q is not None and b in q:
                    n, t = leviathan_accept(p, q[b], drafts[b, :limit[b]], gens[b], residual_fn)
                else:
                    n, t = match_accept(p, d_list[b][:limit[b]], gens[b])
                n_list[b], nxt_list[b] = n, t
        adv = []
        for b, s in enumerate(seqs):
            if s.done:
                adv.append(0)
                continue
            n = n_list[b]
            new = d_list[b][:n] + [nxt_list[b]]
            stats[b].add(limit[b], n)
            ctx[b].extend(new)
            emitted = s.extend(new)
            if emitted and on_emit:
                on_emit(b, emitted)
            adv.append(n + 1)
        pos = pos + torch.tensor(adv, device=dev)
        report_finished(seqs, reported, start, lambda b: stats[b].as_dict(), on_finish)
    if prompt_cache is not None:
        use = [s.req.cache_prompt for s in seqs]
        keep_rows(prompt_cache, "target", ctx, cache, use, pos.tolist())
        if isinstance(drafter, _ModelDrafter):
            drafter.keep(ctx, [True] * B)
    remember = getattr(drafter, "remember", None) or getattr(getattr(drafter, "lookup", None), "remember", None)
    if remember is not None:  # the suffix drafter's store of recent outputs (pipeline/runtime/suffix.py)
        remember([s.tokens for s in seqs])
    return finish(seqs, start, [st.as_dict() for st in stats])


@torch.inference_mode()
def draft_target(target: Transformer, draft: Transformer, reqs: list[Request], k: int, on_emit: Emit | None = None,
                 residual_fn: Residual = residual, use_draft_logits: bool = True, lookup_min_ngram: int = 0,
                 lookup_num_tokens: int = 4, lookup_max_ngram: int = 3, draft_confidence: float = 0.0,
                 yield_to: YieldTo | None = None, resume: list[Handoff] | None = None,
                 on_finish: OnFinish | None = None, prompt_cache: PromptCache | None = None,
                 policy: DraftPolicy | None = None, **opts) -> list[Result | Handoff]:
    """Speculative decoding with a draft model proposing k tokens per round (exact for greedy and sampling).

    `lookup_min_ngram` > 0: a row whose context ends in an n-gram (that long or longer, up to
    `lookup_max_ngram`) seen earlier proposes the `lookup_num_tokens` tokens that followed it instead of
    the draft's (speculation.draft_lookup_min_ngram). `draft_confidence` > 0: a row stops drafting after
    the first token whose draft probability is below it, so k is a maximum (speculation.draft_confidence).
    Both decide from the context and the draft's own q only, so acceptance stays exact."""
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"draft vocab_size {draft.cfg.vocab_size} differs from the target's "
                         f"{target.cfg.vocab_size}; the draft must share the target's tokenizer")
    if k < 1:
        raise ValueError(f"num_draft_tokens: got {k}; must be 1 or more")
    lookup = None
    if lookup_min_ngram > 0:
        if lookup_max_ngram < lookup_min_ngram or lookup_num_tokens < 1:
            raise ValueError(f"draft_target lookup: max_ngram {lookup_max_ngram} must be >= min_ngram "
                             f"{lookup_min_ngram} and num_tokens {lookup_num_tokens} >= 1")
        lookup = _LookupDrafter(lookup_num_tokens, lookup_max_ngram, target.embed.weight.device, lookup_min_ngram)
    drafter = _ModelDrafter(draft, reqs, k, target.cfg.vocab_size, lookup, draft_confidence, use_draft_logits,
                            prompt_cache)
    return speculate(target, reqs, k, on_emit, drafter, residual_fn, yield_to, resume, on_finish, prompt_cache,
                     policy)


@torch.inference_mode()
def prompt_lookup(target: Transformer, reqs: list[Request], k: int, on_emit: Emit | None = None, max_ngram: int = 3,
                  yield_to: YieldTo | None = None, resume: list[Handoff] | None = None,
                  on_finish: OnFinish | None = None, prompt_cache: PromptCache | None = None,
                  policy: DraftPolicy | None = None, **opts) -> list[Result | Handoff]:
    """Speculative decoding with n-gram prompt lookup as the drafter (model-free; exact)."""
    if k < 1:
        raise ValueError(f"num_draft_tokens: got {k}; must be 1 or more")
    return speculate(target, reqs, k, on_emit, _LookupDrafter(k, max_ngram, target.embed.weight.device),
                      yield_to=yield_to, resume=resume, on_finish=on_finish, prompt_cache=prompt_cache, policy=policy)


class DraftTarget:
    """`decode`'s draft_target: a draft model proposes (`_ModelDrafter`), with the spec's prompt-lookup and
    confidence options; sampled rows use Leviathan's rule unless use_draft_logits is off."""

    name, resumable = "draft_target", True
    adaptive = True  # takes `policy=` (decode passes the load-adaptive DraftPolicy)

    def available(self, b) -> bool:
        return b.draft is not None

    def run(self, b, reqs: list[Request], k: int, on_emit: Emit | None, **opts) -> list[Result | Handoff]:
        sp = b.spec
        opts = {"lookup_min_ngram": sp.draft_lookup_min_ngram, "lookup_num_tokens": sp.prompt_lookup_num_tokens,
                "lookup_max_ngram": sp.prompt_lookup_max_ngram, "draft_confidence": sp.draft_confidence,
                "use_draft_logits": sp.use_draft_logits, **opts}
        return draft_target(b.target, b.draft, reqs, k, on_emit, **opts)


class PromptLookup:
    """`decode`'s prompt_lookup: n-gram lookup in the context proposes (`_LookupDrafter`); needs max_draft_len."""

    name, resumable = "prompt_lookup", True
    adaptive = True

    def available(self, b) -> bool:
        return b.max_draft_len > 0

    def run(self, b, reqs: list[Request], k: int, on_emit: Emit | None, **opts) -> list[Result | Handoff]:
        return prompt_lookup(b.target, reqs, k, on_emit, **{"max_ngram": b.spec.prompt_lookup_max_ngram, **opts})


DRAFT_TARGET, PROMPT_LOOKUP = DraftTarget(), PromptLookup()

__all__ = ["DRAFT_TARGET", "PROMPT_LOOKUP",
           "draft_target", "prompt_lookup", "leviathan_accept", "match_accept", "residual", "DraftProbs", "load_draft",
           "attach_draft_head", "SamplingParams"]

"""Acceptance rules and their statistics, checked against answers computed here independently.

Exact output alone cannot catch a wrong acceptance count or a wrong acceptance probability that happens
to keep the output plausible; these tests compare the counters with a replay, and the probabilities with
enumeration, tightly enough to catch an acceptance ratio off by 1.5x.
"""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.runtime.generate import Request, generate
from pipeline.runtime.model import Transformer
from pipeline.runtime.sampling import SamplingParams, sample, warp
from pipeline.runtime.speculative import draft_target, leviathan_accept, residual
from tests.test_speculative import tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def chi2_critical(df: int, z: float = 3.72) -> float:
    """Upper 0.01% point of chi-square with df degrees of freedom (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of counts against probabilities over the cells expecting 5 or more; (stat, df)."""
    n = float(counts.sum())
    keep = probs * n >= 5
    e = probs[keep] * n
    return float(((counts[keep] - e) ** 2 / e).sum()), int(keep.sum()) - 1


@torch.inference_mode()
def next_probs(model: Transformer, ctx: list[int], params: SamplingParams) -> torch.Tensor:
    """The warped next-token distribution after ctx, from a fresh full forward (no speculative state)."""
    cache = model.new_cache(1, len(ctx) + 8)
    h = model(torch.tensor([ctx]), torch.arange(len(ctx))[None], cache)
    return warp(model.logits(h[0, -1]), params)


def greedy_replay(target: Transformer, draft: Transformer, prompt: list[int], k: int, new: int) -> dict:
    """What draft_target's counters must read for a greedy row, rebuilt from plain decoding: the draft's greedy
    proposals from fresh forwards, matched against the target's own greedy continuation; k a round, or the row's
    room where that is less (a round emits at most its drafts and one token, the row at most `new`)."""
    (ref,) = generate(target, [Request(prompt, new + k + 1)])
    base = ref.tokens
    steps, proposed, accepted, acc_pos, prop_pos = 1, 0, 0, [0] * k, [0] * k
    i = 1  # prefill emitted the first token
    while i < new:
        ctx, d = prompt + base[:i], []
        for _ in range(min(k, new - i - 1)):
            d.append(int(next_probs(draft, ctx + d, SamplingParams()).argmax()))
        n = 0
        while n < len(d) and d[n] == base[i + n]:
            n += 1
        steps, proposed, accepted = steps + 1, proposed + len(d), accepted + n
        for j in range(n):
            acc_pos[j] += 1
        for j in range(len(d)):
            prop_pos[j] += 1
        i += n + 1
    return {"tokens": base[:new], "steps": steps, "draft_proposed": proposed, "draft_accepted": accepted,
            "accepted_per_position": acc_pos, "proposed_per_position": prop_pos}


@pytest.fixture(scope="module")
def pair():
    t = tiny(seed=0)
    return t, {"self": t, "noisy": tiny(base=t, noise=0.02, seed=7), "random": tiny(layers=1, seed=3)}


@pytest.mark.parametrize("which", ["self", "noisy", "random"])
def test_greedy_counters_equal_an_independent_replay(pair, which):
    target, drafts = pair
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(2, 48, (n,), generator=g).tolist() for n in (5, 9, 3)]
    k, new = 3, 20
    out = draft_target(target, drafts[which], [Request(p, new) for p in ps], k)
    for p, r in zip(ps, out, strict=True):
        want = greedy_replay(target, drafts[which], p, k, new)
        got = {key: getattr(r, key) for key in want}
        assert got == want
        assert r.acceptance_rate == pytest.approx(want["draft_accepted"] / want["draft_proposed"])
        assert r.mean_accepted_len == pytest.approx(new / want["steps"])
    if which == "self":
        assert all(r.acceptance_rate == 1.0 for r in out)


# ---- Leviathan's rule, one row at a time ----------------------------------------------------------

P = torch.tensor([[0.10, 0.20, 0.30, 0.40], [0.70, 0.10, 0.10, 0.10]])
Q = torch.tensor([[0.40, 0.30, 0.20, 0.10]])


def test_leviathan_accept_commits_target_tokens_with_the_right_acceptance():
    """k = 1: the committed token is distributed as p_1, the draft is accepted with probability
    sum_x min(p(x), q(x)) (0.6 here; 0.75 if the ratio were off by 1.5x), and the bonus token after an
    acceptance is distributed as p_2."""
    g = torch.Generator().manual_seed(0)
    n = 12000
    first, bonus, acc = torch.zeros(4), torch.zeros(4), 0
    for _ in range(n):
        d = sample(Q[0], g)[None]
        m, t = leviathan_accept(P, Q, d, g)
        if m == 1:
            acc += 1
            first[int(d[0])] += 1
            bonus[t] += 1
        else:
            first[t] += 1
    want = float(torch.minimum(P[0], Q[0]).sum())
    assert abs(acc / n - want) < 4 * math.sqrt(want * (1 - want) / n), acc / n
    for counts, probs in ((first, P[0]), (bonus, P[1])):
        stat, df = chi2(counts, probs)
        assert stat < chi2_critical(df), (counts, probs)


def test_draft_probs_over_a_reduced_vocabulary_decide_as_the_expanded_rows_do():
    """A draft head over a subset of the vocabulary: leviathan_accept given DraftProbs (each draft's probability and
    the reduced rows, one row expanded at the first rejection) accepts and commits what it does given the rows
    expanded to the full vocabulary, draw for draw from the same generator state."""
    from pipeline.runtime.speculative import DraftProbs

    g = torch.Generator().manual_seed(4)
    V, ids = 12, torch.tensor([1, 3, 4, 7, 10])
    for trial in range(300):
        k = 1 + trial % 4
        rows = torch.softmax(torch.randn(k, len(ids), generator=g) * 2, -1)
        p = torch.softmax(torch.randn(k + 1, V, generator=g) * 2, -1)
        picks = torch.stack([sample(r, g) for r in rows])
        drafts = ids[picks]
        full = torch.zeros(k, V).index_copy_(-1, ids, rows)
        state = g.get_state()
        want = leviathan_accept(p, full, drafts, g)
        g.set_state(state)
        got = leviathan_accept(p, DraftProbs(rows[torch.arange(k), picks], rows, ids, V), drafts, g)
        assert got == want, (trial, got, want)


def test_residual_is_the_normalised_positive_part_and_completes_p():
    """q(x) min(1, p(x)/q(x)) + (1 - beta) r(x) = p(x) with beta = sum min(p, q): what makes the rule exact."""
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        p = torch.softmax(torch.randn(7, generator=g) * 2, -1)
        q = torch.softmax(torch.randn(7, generator=g) * 2, -1)
        r = residual(p, q)
        pos = (p - q).clamp_min(0)
        assert torch.allclose(r, pos / pos.sum(), atol=1e-6)
        assert float(r.min()) >= 0 and float(r.sum()) == pytest.approx(1.0, abs=1e-6)
        beta = torch.minimum(p, q).sum()
        assert torch.allclose(torch.minimum(p, q) + (1 - beta) * r, p, atol=1e-6)
    one = torch.tensor([0.0, 1.0, 0.0])
    assert torch.equal(residual(one, one), one)  # nothing left over: fall back to p, never divide by zero


# ---- end to end: acceptance and distribution through draft_target ---------------------------------

V = 10


@pytest.fixture(scope="module")
def small_pair():
    """A target and a sharper draft that often puts more mass than the target on a token: acceptance 0.16,
    0.22 with the ratio off by 1.5x (13 standard errors apart at 6000 samples)."""
    t = tiny(vocab=V, seed=11, hidden=16, scale=0.6)
    d = tiny(vocab=V, seed=13, hidden=16, scale=1.5, layers=1)
    return t, d


def test_sampled_acceptance_and_output_match_enumeration(small_pair):
    """k = 1, two tokens: the first comes from prefill, the second from one speculative round. The fraction of
    accepted drafts must be E_t1[sum_x min(p(x|t1), q(x|t1))] and the pairs must follow p(t1) p(t2|t1)."""
    t, d = small_pair
    prompt, params = [3, 7, 2], SamplingParams(1.0)
    p1 = next_probs(t, prompt, params)
    joint, accept = torch.zeros(V, V), 0.0
    for a in range(V):
        p2, q2 = next_probs(t, prompt + [a], params), next_probs(d, prompt + [a], params)
        joint[a] = p1[a] * p2
        accept += float(p1[a] * torch.minimum(p2, q2).sum())
    n, counts, accepted = 6000, torch.zeros(V, V), 0
    for c in range(0, n, 1000):
        # 3 tokens: the round after the prefill's token has room for its draft (2 would make it a plain step)
        reqs = [Request(prompt, 3, SamplingParams(1.0, seed=c + i)) for i in range(1000)]
        for r in draft_target(t, d, reqs, 1):
            counts[r.tokens[0], r.tokens[1]] += 1
            assert r.draft_proposed == 1 and r.draft_accepted in (0, 1)
            accepted += r.draft_accepted
    stat, df = chi2(counts.flatten(), joint.flatten())
    assert stat < chi2_critical(df), stat
    assert abs(accepted / n - accept) < 4 * math.sqrt(accept * (1 - accept) / n), (accepted / n, accept)

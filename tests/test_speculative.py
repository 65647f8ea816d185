"""Speculative decoding is exact: greedy output equals the baseline token for token, and sampling
preserves the target's distribution (checked against the enumerated exact distribution)."""

from __future__ import annotations

import pytest
import torch

from pipeline.runtime.generate import Request, generate
from pipeline.runtime.model import ModelConfig, Transformer, build_model
from pipeline.runtime.sampling import SamplingParams, warp
from pipeline.runtime.specconfig import SpecDecodeConfig
from pipeline.runtime.speculative import attach_draft_head, draft_target, prompt_lookup, residual


def tiny(vocab: int = 48, layers: int = 2, seed: int = 0, hidden: int = 32, scale: float = 0.3,
         base: Transformer | None = None, noise: float = 0.0) -> Transformer:
    """A random tiny Llama; with `base`, a copy of it whose weights carry `noise` (a partly agreeing draft)."""
    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_layers=layers,
                      num_heads=4, num_kv_heads=2, head_dim=hidden // 4, tie_embeddings=True,
                      max_position_embeddings=512, eos_token_id=[1])
    g = torch.Generator().manual_seed(seed)
    if base is not None:
        st = {k: v + noise * torch.randn(v.shape, generator=g) * (v.dim() > 1) for k, v in base.state_dict().items()
              if k != "lm_head.weight"}
        cfg = base.cfg
    else:
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in Transformer(cfg).state_dict().items() if k != "lm_head.weight"}
        st = {k: torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * scale for k, s in shapes.items()}
    return build_model(cfg, st, torch.float32, "cpu")


def prompts(n: int, vocab: int, seed: int, lo: int = 2, hi: int = 14) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(2, vocab, (m,), generator=g).tolist() for m in lens]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny(seed=0)


@pytest.fixture(scope="module")
def drafts(target):
    return {"self": target, "noisy": tiny(base=target, noise=0.02, seed=7), "random": tiny(layers=1, seed=3)}


def _reqs(ps, new=(24, 9, 17, 30), end=True):
    return [Request(p, new[i % len(new)], end_ids=(1,) if end else ()) for i, p in enumerate(ps)]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("which", ["self", "noisy", "random"])
def test_greedy_draft_target_equals_baseline_batch_one(target, drafts, k, which):
    for p in prompts(6, 48, seed=k):
        (base,) = generate(target, _reqs([p]))
        (spec,) = draft_target(target, drafts[which], _reqs([p]), k)
        assert spec.tokens == base.tokens and spec.finish_reason == base.finish_reason


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("which", ["self", "noisy", "random"])
def test_greedy_draft_target_equals_baseline_ragged_batch(target, drafts, k, which):
    reqs = _reqs(prompts(5, 48, seed=10 + k))
    base = generate(target, reqs)
    spec = draft_target(target, drafts[which], reqs, k)
    assert [r.tokens for r in spec] == [r.tokens for r in base]
    assert [r.finish_reason for r in spec] == [r.finish_reason for r in base]


def test_acceptance_stats_are_consistent(target, drafts):
    reqs = _reqs(prompts(4, 48, seed=3), end=False)
    for which, lo, hi in (("self", 1.0, 1.0), ("noisy", 0.2, 0.8), ("random", 0.0, 0.2)):
        out = draft_target(target, drafts[which], reqs, 3)
        rate = sum(r.draft_accepted for r in out) / sum(r.draft_proposed for r in out)
        assert lo <= rate <= hi, which
        for r in out:
            # k a round, less only in the last rounds, whose room (max_new_tokens) holds fewer: at most 1 + 2 + 3
            assert 3 * (r.steps - 1) - 6 <= r.draft_proposed <= 3 * (r.steps - 1)
            assert r.draft_proposed == sum(r.proposed_per_position)
            assert r.draft_accepted == sum(r.accepted_per_position)
            assert r.accepted_per_position == sorted(r.accepted_per_position, reverse=True)
            assert len(r.tokens) <= r.draft_accepted + r.steps


def test_self_draft_emits_k_plus_one_tokens_per_step(target):
    (r,) = draft_target(target, target, [Request([5, 6, 7], 40)], 4)
    assert r.steps == 1 + 8 and r.mean_accepted_len == pytest.approx(40 / 9)


def test_reduced_vocab_draft_head_is_exact_and_maps_back(target):
    ids = torch.arange(0, 48, 2)
    d = tiny(base=target, noise=0.01, seed=9)
    attach_draft_head(d, d.embed.weight[ids].clone(), ids)
    reqs = _reqs(prompts(4, 48, seed=21))
    base = generate(target, reqs)
    spec = draft_target(target, d, reqs, 3)
    assert [r.tokens for r in spec] == [r.tokens for r in base]
    assert sum(r.draft_accepted for r in spec) > 0


def test_streamed_tokens_equal_the_result(target, drafts):
    reqs = _reqs(prompts(3, 48, seed=4))
    got = {b: [] for b in range(3)}
    out = draft_target(target, drafts["noisy"], reqs, 3, on_emit=lambda b, t: got[b].extend(t))
    assert [got[b] for b in range(3)] == [r.tokens for r in out]


def test_stop_sequences_truncate_like_baseline(target, drafts):
    p = prompts(1, 48, seed=5)[0]
    (free,) = generate(target, [Request(p, 30)])
    stop = free.tokens[6:8]
    req = Request(p, 30, stop=[stop])
    (base,) = generate(target, [req])
    (spec,) = draft_target(target, drafts["self"], [req], 5)
    assert spec.tokens == base.tokens and spec.finish_reason == base.finish_reason == "stop"


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_prompt_lookup_equals_baseline(target, k):
    ps = prompts(6, 48, seed=30 + k, lo=6, hi=20)
    # repetitive prompts so lookup finds matches
    ps = [p + p[: len(p) // 2] for p in ps]
    for p in ps[:3]:
        (base,) = generate(target, _reqs([p]))
        (spec,) = prompt_lookup(target, _reqs([p]), k)
        assert spec.tokens == base.tokens
    reqs = _reqs(ps)
    spec = prompt_lookup(target, reqs, k, max_ngram=2)
    assert [r.tokens for r in spec] == [r.tokens for r in generate(target, reqs)]
    assert sum(r.draft_accepted for r in spec) > 0


def test_prompt_lookup_proposes_the_latest_match():
    from pipeline.runtime.speculative import _LookupDrafter

    d = _LookupDrafter(3, 3, "cpu")
    assert d.lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]) == [7, 8, 5]
    assert d.lookup([4, 5, 6, 4]) == [5, 6, 4]
    assert d.lookup([4, 5, 6]) == []


@pytest.mark.parametrize("min_ngram", [1, 2])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("which", ["noisy", "random"])
def test_greedy_draft_target_with_lookup_equals_baseline(target, drafts, k, which, min_ngram):
    ps = prompts(5, 48, seed=40 + k, lo=4, hi=16)
    # long enough that lookup rounds find room for their 4 tokens (a round drafts no more than the answer's room)
    reqs = _reqs([p + p[: len(p) // 2] for p in ps], new=(40, 48, 56, 64))
    base = generate(target, reqs)
    out = draft_target(target, drafts[which], reqs, k, lookup_min_ngram=min_ngram, lookup_num_tokens=4)
    assert [r.tokens for r in out] == [r.tokens for r in base]
    assert [r.finish_reason for r in out] == [r.finish_reason for r in base]
    # lookup rounds propose up to 4 tokens, model rounds k: both kinds happened
    assert max(len(r.proposed_per_position) for r in out) == max(k, 4)
    assert sum(r.draft_accepted for r in out) > 0


@pytest.mark.parametrize("which", ["self", "noisy", "random"])
def test_greedy_draft_target_with_draft_confidence_equals_baseline(target, drafts, which):
    reqs = _reqs(prompts(5, 48, seed=50))
    base = generate(target, reqs)
    out = draft_target(target, drafts[which], reqs, 4, draft_confidence=0.5, lookup_min_ngram=2)
    assert [r.tokens for r in out] == [r.tokens for r in base]


def test_draft_confidence_stops_a_row_at_its_first_doubtful_token(target):
    """The rule only shortens drafts: below-threshold-everywhere gives one token per round, a threshold the
    draft always clears gives all k."""
    reqs = [Request(p, 24) for p in prompts(3, 48, seed=51)]
    always_doubt = draft_target(target, target, reqs, 4, draft_confidence=0.999999)
    never_doubt = draft_target(target, target, reqs, 4, draft_confidence=1e-9)
    for r in always_doubt:  # the last round may have no room for a draft (a plain step)
        assert r.proposed_per_position[1:] == [0, 0, 0] and r.draft_proposed in (r.steps - 1, r.steps - 2)
    for r in never_doubt:  # all k but in the last rounds, whose room holds fewer
        assert r.proposed_per_position[3] >= r.steps - 4 and r.proposed_per_position[0] >= r.steps - 2


def test_draft_cache_catches_up_after_lookup_rounds(target):
    """Rounds served by lookup skip the draft model (its prompt too, until then); its next round feeds what it
    missed, so its cache then holds exactly what a fresh prefill of the whole context would."""
    from pipeline.runtime.generate import prefill
    from pipeline.runtime.speculative import _LookupDrafter, _ModelDrafter

    prompts_ = [[5, 6, 7, 8, 5, 6], [9, 4, 3, 9, 4]]
    reqs = [Request(c, 20) for c in prompts_]
    d = _ModelDrafter(target, reqs, 2, 48, _LookupDrafter(4, 3, "cpu", min_ngram=2))
    d.prefill(prompts_)
    gens = [torch.Generator() for _ in prompts_]
    ctx = [prompts_[0] + [7], prompts_[1] + [3]]
    drafts, _, limit = d.propose(ctx, torch.tensor([6, 5]), gens)  # both rows end in a repeated n-gram
    assert limit == [4, 3] and drafts.tolist() == [[8, 5, 6, 7], [9, 4, 3, 0]]
    assert d.fed == [0, 0]  # the draft model did not run: its prefill waits for the first round that drafts
    ctx[0] += [8, 5, 6, 7, 13]
    ctx[1] += [9, 14]
    _, _, limit = d.propose(ctx, torch.tensor([11, 7]), gens)
    assert limit == [2, 2]
    ref = target.new_cache(2, d.cache.length)
    prefill(target, ref, ctx)
    for b, n in enumerate([12, 8]):
        assert d.fed[b] == n
        assert torch.allclose(d.cache.k[:, b, :, :n], ref.k[:, b, :, :n], atol=1e-5)
        assert torch.allclose(d.cache.v[:, b, :, :n], ref.v[:, b, :, :n], atol=1e-5)


def test_use_draft_logits_false_accepts_by_matching(target):
    """With the target as its own draft, Leviathan's rule accepts every sampled draft; matching the target's own
    sample (use_draft_logits=false) accepts only when two independent samples agree."""
    reqs = [Request([5, 6, 7], 30, SamplingParams(1.0, seed=i)) for i in range(4)]
    lev = draft_target(target, target, reqs, 3)
    match = draft_target(target, target, reqs, 3, use_draft_logits=False)
    assert all(r.draft_accepted == r.draft_proposed for r in lev)
    assert sum(r.draft_accepted for r in match) < 0.9 * sum(r.draft_proposed for r in match)


# ---- sampling: distribution preservation ----------------------------------------------------

V = 10


def exact_two_token_dist(target: Transformer, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """P(t1, t2) [V, V] by enumeration with the same warping."""
    with torch.inference_mode():
        cache = target.new_cache(1, 64)
        n = len(prompt)
        h = target(torch.tensor([prompt]), torch.arange(n)[None], cache)
        p1 = warp(target.logits(h[0, -1]), params)
        rows = torch.tensor([prompt + [t] for t in range(V)])
        c2 = target.new_cache(V, 64)
        h2 = target(rows, torch.arange(n + 1).expand(V, n + 1), c2)
        p2 = warp(target.logits(h2[:, -1]), params)
    return p1[:, None] * p2


def sampled_two_token_dist(target, draft, prompt, params, n, k, **kw) -> torch.Tensor:
    """Empirical P(t1, t2) over n seeded requests, run as ragged batches of 500 rows."""
    counts = torch.zeros(V, V)
    chunk = 500
    for c in range(0, n, chunk):
        # 2 + k tokens: the first round drafts all k (with 2, the room cap would make it a plain step)
        reqs = [Request(prompt, 2 + k, SamplingParams(params.temperature, params.top_k, params.top_p, seed=c + i))
                for i in range(chunk)]
        out = (draft_target(target, draft, reqs, k, **kw) if draft is not None
               else prompt_lookup(target, reqs, k, max_ngram=2))
        for r in out:
            counts[r.tokens[0], r.tokens[1]] += 1
    return counts / counts.sum()


def broken_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The classic mistake: resample from the target after a rejection instead of norm(max(p - q, 0))."""
    return p


@pytest.fixture(scope="module")
def small_pair():
    t = tiny(vocab=V, seed=11, hidden=16, scale=0.6)
    d = tiny(vocab=V, seed=12, hidden=16, scale=0.6, layers=1)
    return t, d


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_k=6, top_p=0.9)])
def test_speculative_sampling_preserves_target_distribution(small_pair, params):
    t, d = small_pair
    prompt = [3, 7, 2]
    exact = exact_two_token_dist(t, prompt, params)
    emp = sampled_two_token_dist(t, d, prompt, params, n=6000, k=2)
    tv = 0.5 * (emp - exact).abs().sum()
    assert tv < 0.045, float(tv)


@pytest.mark.parametrize("kw", [{"use_draft_logits": False}, {"lookup_min_ngram": 1, "lookup_num_tokens": 2},
                                {"draft_confidence": 0.4}], ids=["match", "lookup", "confidence"])
def test_draft_target_variants_preserve_target_distribution(small_pair, kw):
    t, d = small_pair
    prompt, params = [3, 7, 2, 4, 3, 7], SamplingParams(1.0)
    exact = exact_two_token_dist(t, prompt, params)
    emp = sampled_two_token_dist(t, d, prompt, params, n=6000, k=2, **kw)
    assert 0.5 * (emp - exact).abs().sum() < 0.045


def test_prompt_lookup_sampling_preserves_target_distribution(small_pair):
    t, _ = small_pair
    prompt, params = [3, 7, 2, 4, 3, 7], SamplingParams(1.0)
    exact = exact_two_token_dist(t, prompt, params)
    emp = sampled_two_token_dist(t, None, prompt, params, n=6000, k=2)
    assert 0.5 * (emp - exact).abs().sum() < 0.045


def test_distribution_test_rejects_a_wrong_residual_rule(small_pair):
    t, d = small_pair
    prompt, params = [3, 7, 2], SamplingParams(1.0)
    exact = exact_two_token_dist(t, prompt, params)
    emp = sampled_two_token_dist(t, d, prompt, params, n=6000, k=2, residual_fn=broken_residual)
    assert 0.5 * (emp - exact).abs().sum() > 0.045


def test_residual_is_normalised_positive_part():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(residual(p, q), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.allclose(residual(p, p), p)


def test_speculation_switches_off_at_disable_at_batch():
    """At or above disable_at_batch a batch runs the baseline code itself: same tokens, nothing proposed."""
    from pipeline.runtime.decode import Bundle, decode

    target = tiny(seed=11)
    b = Bundle(target, None, {"build_config": {"max_draft_len": 4}}, draft=tiny(base=target, seed=12, noise=0.05),
               spec=SpecDecodeConfig(max_draft_len=4, disable_at_batch=3))
    ps = prompts(3, 48, seed=13)
    base = generate(target, [Request(p, 12) for p in ps])
    two = decode(b, "draft_target", [Request(p, 12) for p in ps[:2]], num_draft_tokens=3)
    assert sum(r.draft_proposed for r in two) > 0 and not any(r.speculation_off for r in two)
    three = decode(b, "draft_target", [Request(p, 12) for p in ps], num_draft_tokens=3)
    assert all(r.speculation_off and r.draft_proposed == 0 for r in three)
    assert [r.tokens for r in three] == [r.tokens for r in base]
    forced = decode(b, "prompt_lookup", [Request(p, 12) for p in ps], disable_at_batch=0)
    assert not any(r.speculation_off for r in forced)
    assert [r.tokens for r in forced] == [r.tokens for r in base]
    assert not b.spec.off_at("baseline", 99) and b.spec.off_at("medusa", 3)


def test_accepted_drafts_are_not_fed_to_the_draft_twice(target, drafts):
    """The draft K/V written while drafting stays valid for the drafts the target accepts: each round's
    catch-up feeds one token (two when all k were accepted), and the cache still equals a fresh prefill."""
    from pipeline.runtime.generate import prefill
    from pipeline.runtime.speculative import _ModelDrafter

    draft = drafts["noisy"]
    fed: list = []
    hook = draft.register_forward_hook(lambda m, args, out: fed.append(tuple(args[0].shape)))
    try:
        reqs = _reqs(prompts(3, 48, seed=80, lo=6, hi=12), new=(40,), end=False)
        out = draft_target(target, draft, reqs, 4)
    finally:
        hook.remove()
    assert [r.tokens for r in out] == [r.tokens for r in generate(target, reqs)]
    assert fed[0][1] >= 6 and all(s <= 2 for _, s in fed[1:])  # the prefill, then 1 or 2 tokens per forward
    assert any(s == 2 for _, s in fed[1:])  # some round had all drafts accepted

    ps = [[5, 6, 7, 8], [9, 4, 3]]
    d = _ModelDrafter(target, [Request(p, 20) for p in ps], 3, 48)
    d.prefill(ps)
    gens = [torch.Generator() for _ in ps]
    ctx = [ps[0] + [10], ps[1] + [11]]
    drafts_, _, _ = d.propose(ctx, torch.tensor([4, 3]), gens)
    ctx[0] += drafts_[0, :3].tolist() + [12]  # all 3 accepted (d3 was never fed), then a bonus token
    ctx[1] += drafts_[1, :1].tolist() + [13]  # 1 accepted, then the target's own token
    d.propose(ctx, torch.tensor([8, 5]), gens)
    ref = target.new_cache(2, d.cache.length)
    prefill(target, ref, ctx)
    for b, n in enumerate([9, 6]):
        assert d.fed[b] == n
        assert torch.allclose(d.cache.k[:, b, :, :n], ref.k[:, b, :, :n], atol=1e-5)
        assert torch.allclose(d.cache.v[:, b, :, :n], ref.v[:, b, :, :n], atol=1e-5)


def test_the_first_token_goes_out_before_the_draft_prefills_and_a_one_token_request_never_runs_it(target, drafts):
    draft = tiny(base=target, noise=0.02, seed=11)
    calls: list[int] = []
    hook = draft.register_forward_hook(lambda *a: calls.append(1))
    try:
        seen = []
        draft_target(target, draft, [Request(prompts(1, 48, seed=90)[0], 8)], 3,
                     lambda b, toks: seen.append(len(calls)))
        assert seen[0] == 0 and len(calls) > 0  # the first token before any draft forward, the rest after
        calls.clear()
        draft_target(target, draft, [Request(prompts(1, 48, seed=91)[0], 1)], 3)
        assert calls == []
    finally:
        hook.remove()

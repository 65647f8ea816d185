"""Baseline decoding: equals transformers' generate; sampling, stopping and batching behave."""

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.runtime.generate import Request, generate
from pipeline.runtime.model import ModelConfig, build_model, hf_to_runtime
from pipeline.runtime.sampling import SamplingParams, warp


def _pair(seed=0, vocab=97):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=1000.0,
                      tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    mc = ModelConfig.from_hf(cfg.to_dict())
    return hf, build_model(mc, hf_to_runtime(hf.state_dict(), mc), torch.float32, "cpu")


@pytest.mark.slow
def test_greedy_equals_transformers_generate_token_for_token():
    hf, ours = _pair()
    g = torch.Generator().manual_seed(1)
    for n in (3, 9, 17):
        ids = torch.randint(0, 97, (1, n), generator=g)
        ref = hf.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)[0, n:].tolist()
        (res,) = generate(ours, [Request(ids[0].tolist(), 24)])
        assert res.tokens == ref


def test_batch_rows_of_different_lengths_equal_each_row_alone():
    _, ours = _pair()
    g = torch.Generator().manual_seed(2)
    reqs = [Request(torch.randint(0, 97, (n,), generator=g).tolist(), m) for n, m in ((4, 20), (15, 7), (9, 13))]
    together = generate(ours, reqs)
    for r, res in zip(reqs, together):
        assert res.tokens == generate(ours, [r])[0].tokens
        assert len(res.tokens) == r.max_new_tokens


def test_eos_stops_and_is_not_emitted():
    _, ours = _pair()
    prompt = [5, 6, 7]
    free = generate(ours, [Request(prompt, 12)])[0].tokens
    eos = free[4]
    res = generate(ours, [Request(prompt, 12, end_ids=(eos,))])[0]
    assert res.tokens == free[: free.index(eos)]
    assert res.finish_reason == "eos"


def test_stop_sequence_ends_generation_after_it():
    _, ours = _pair()
    prompt = [1, 2, 3]
    free = generate(ours, [Request(prompt, 16)])[0].tokens
    stop = free[5:7]
    res = generate(ours, [Request(prompt, 16, stop=[stop])])[0]
    first = next(i for i in range(len(free) - 1) if free[i:i + 2] == stop)
    assert res.tokens == free[: first + 2] and res.finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    _, ours = _pair()
    p = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=123)
    a = generate(ours, [Request([4, 5], 20, p)])[0].tokens
    b = generate(ours, [Request([4, 5], 20, p)])[0].tokens
    c = generate(ours, [Request([4, 5], 20, SamplingParams(1.0, 20, 0.9, seed=7))])[0].tokens
    assert a == b and a != c


def test_streaming_callback_sees_every_token_in_order():
    _, ours = _pair()
    seen = []
    res = generate(ours, [Request([3, 1, 4], 10)], on_emit=lambda row, toks: seen.extend(toks))[0]
    assert seen == res.tokens


def test_warp_applies_temperature_top_k_and_top_p():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    p = warp(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(p, torch.softmax(logits / 0.5, -1))
    p = warp(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[2:] == 0).all() and torch.allclose(p[:2], torch.softmax(logits[:2], -1))
    full = torch.softmax(logits, -1)
    p = warp(logits, SamplingParams(temperature=1.0, top_p=0.8))
    keep = (full.cumsum(-1) - full) < 0.8
    assert torch.allclose(p, torch.where(keep, full, 0) / full[keep].sum())
    g = warp(logits, SamplingParams(temperature=0.0))
    assert g.tolist() == [1.0, 0, 0, 0, 0]


def _nucleus_by_full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sp, idx = probs.sort(dim=-1, descending=True)
    before = torch.nn.functional.pad(sp.cumsum(-1), (1, 0))[..., :-1]  # the mass of the more likely tokens
    sp = sp.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, idx, sp)
    return kept / kept.sum(-1, keepdim=True)


@pytest.mark.parametrize("spread", [6.0, 0.01])  # peaked: the nucleus is within the top 256; flat: it is not
def test_top_p_over_a_large_vocabulary_keeps_the_nucleus_a_full_sort_keeps(spread):
    from pipeline.runtime import sampling

    logits = torch.randn(5, 50_000, generator=torch.Generator().manual_seed(3)) * spread
    params = SamplingParams(temperature=1.0, top_p=0.9)
    got = warp(logits, params)
    want = _nucleus_by_full_sort(torch.softmax(logits, -1), 0.9)
    kept = (got > 0).sum(-1)
    assert torch.equal(got > 0, want > 0) and torch.allclose(got, want, rtol=1e-6, atol=0)
    assert ((kept <= sampling.TOP_P_CANDIDATES) if spread > 1 else (kept > sampling.TOP_P_CANDIDATES)).all(), kept


# Powers of two, distinct but for the last two: every running total is exact, so "the mass before a token
# equals top_p" is exact too. Tokens are stored shuffled so that position is not rank.
DYADIC = [0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.015625]
SHUFFLE = [3, 0, 6, 2, 1, 4, 5]


@pytest.mark.parametrize("kept", [1, 2, 3, 4])
def test_top_p_drops_the_token_whose_preceding_mass_equals_top_p(kept):
    """The nucleus is the smallest set of most likely tokens holding top_p: with top_p equal to the mass of the
    `kept` most likely tokens, the next token (whose preceding mass is exactly top_p) is out; a hair above
    top_p it is in."""
    from pipeline.runtime.sampling import _nucleus

    probs = torch.zeros(7)
    probs[SHUFFLE] = torch.tensor(DYADIC)
    top_p = sum(DYADIC[:kept])
    got = _nucleus(probs[None], top_p)[0]
    ranked = got[SHUFFLE]
    assert (ranked[:kept] > 0).all() and (ranked[kept:] == 0).all(), ranked
    assert torch.equal(ranked[:kept], torch.tensor(DYADIC[:kept]) / top_p)
    above = _nucleus(probs[None], float(np.nextafter(np.float32(top_p), np.float32(1))))[0][SHUFFLE]
    assert (above[:kept + 1] > 0).all() and (above[kept + 1:] == 0).all(), above
    # and through warp, with probabilities a softmax made (temperature 1 leaves them as they are)
    logits = torch.log(probs)
    p = warp(logits, SamplingParams(temperature=1.0, top_p=float(torch.softmax(logits, -1)[SHUFFLE[0]])))
    assert int((p > 0).sum()) == 1 and int(p.argmax()) == SHUFFLE[0]


def test_top_p_equal_to_the_top_token_keeps_it_alone_for_any_distribution():
    """The preceding mass of the second token is exactly the first's probability, however the sums round: top_p
    set to it keeps one token (cumsum - p can round below it and let the second in)."""
    from pipeline.runtime.sampling import _nucleus

    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(400, 12, generator=g), -1)
    for row in probs:
        top2 = row.topk(2).values
        if top2[0] == top2[1]:
            continue
        got = _nucleus(row[None], float(top2[0]))[0]
        assert int((got > 0).sum()) == 1 and got.max() == 1.0, row
        two = _nucleus(row[None], float(top2[0] + top2[1]))[0]  # a float32 sum, as the running total is
        assert int((two > 0).sum()) == 2, row


def test_top_p_past_the_candidate_windows_stops_at_the_same_boundary():
    """A flat distribution's nucleus within the top-256 candidates, past them (the wider window) and past that (the
    full sort): top_p equal to the mass of n tokens keeps exactly n in each."""
    from pipeline.runtime import sampling

    probs = torch.full((1, 8192), 1 / 8192)
    for n in (200, 300, 5000):
        assert (n > sampling.TOP_P_CANDIDATES) == (n >= 300) and (n > sampling.TOP_P_WIDER) == (n == 5000)
        got = sampling._nucleus(probs, n / 8192)
        assert int((got > 0).sum()) == n and torch.allclose(got[got > 0], torch.tensor(1 / n))


def test_bad_sampling_params_name_the_field():
    import pytest

    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(1.0, 0, 1.5).check(10)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(-0.1).check(10)


def test_on_step_sees_every_picked_token_with_the_state_it_came_from():
    """The training data builders record through on_step: each row's tokens (the end token too), and the hidden
    state and logits each was picked from."""
    from tests.test_speculative import tiny

    m = tiny(seed=0)
    reqs = [Request([5, 6, 7], 30, end_ids=(1,)), Request([9, 3], 12, end_ids=(1,))]
    seen: dict[int, list] = {0: [], 1: []}
    out = generate(m, reqs, on_step=lambda b, h, lg, t: seen[b].append((h.clone(), lg.clone(), t)))
    for b, r in enumerate(out):
        toks = [t for _, _, t in seen[b]]
        assert toks[: len(r.tokens)] == r.tokens
        assert toks[len(r.tokens):] == ([1] if r.finish_reason == "eos" else [])
        for h, lg, t in seen[b]:
            assert int(lg.argmax()) == t
            assert torch.allclose(m.logits(h[None])[0], lg, atol=1e-5)


def test_sample_draws_each_token_at_its_probability():
    """sampling.sample (every sampled token: plain steps, drafts, residuals) draws from the distribution it is
    given: 200,000 draws from a skewed 50-token distribution with zeros pass a chi-square test (49 degrees of
    freedom, 120 is about p = 1e-7), zeros are never drawn, and a batch of rows draws each row from its own."""
    from pipeline.runtime.sampling import sample

    g = torch.Generator().manual_seed(11)
    probs = torch.rand(50, generator=g) ** 4
    probs[::9] = 0
    probs /= probs.sum()
    draws = sample(probs.expand(200_000, -1), g)
    seen = torch.bincount(draws, minlength=50).double()
    want = probs.double() * 200_000
    assert seen[probs == 0].sum() == 0
    chi2 = float(((seen - want)[probs > 0] ** 2 / want[probs > 0]).sum())
    assert chi2 < 120, chi2
    two = torch.zeros(2, 50)
    two[0, 7], two[1, 42] = 1.0, 1.0
    assert sample(two, g).tolist() == [7, 42]

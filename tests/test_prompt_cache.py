"""The prompt cache never changes an answer: K/V copied from it are the bits a full prefill writes, and every method
answers the same with it on and off (greedy and seeded sampling), while it holds its byte budget."""

from __future__ import annotations

import pytest
import torch

from pipeline.runtime.batcher import ContinuousBatch
from pipeline.runtime.generate import Request, generate, prefill
from pipeline.runtime.prompt_cache import PromptCache, prefill_cached
from pipeline.runtime.sampling import SamplingParams
from tests.test_speculative import prompts, tiny

pytestmark = pytest.mark.usefixtures("one_thread")

BT = 8  # block tokens: small, so short prompts span several blocks and hits end mid-prompt


@pytest.fixture(scope="module")
def target():
    return tiny(seed=0)


@pytest.fixture(scope="module")
def draft(target):
    return tiny(base=target, noise=0.02, seed=7)


def _budget(model, blocks: int) -> int:
    """Bytes of `blocks` blocks of `model`'s K/V."""
    c = model.cfg
    return blocks * 2 * c.num_layers * c.num_kv_heads * BT * c.head_dim * torch.finfo(model.kv_dtype).bits // 8


@pytest.mark.parametrize("cut", [0, 5, 8, 13, 16, 29, 40])
def test_a_cached_prefix_then_the_rest_writes_the_bits_of_one_full_prefill(target, cut):
    p = prompts(1, 48, seed=3, lo=41, hi=42)[0]
    full = target.new_cache(1, 64)
    h_full = prefill(target, full, [p])
    pc = PromptCache(1 << 30, BT)
    prefill_cached(target, target.new_cache(1, 64), [p[:cut + 1]], pc, "target")  # the earlier request
    kv = target.new_cache(1, 64)
    h, reused = prefill_cached(target, kv, [p], pc, "target")
    assert reused == [min(cut + 1, len(p) - 1)]  # token-granular: whole blocks and the earlier prompt's tail
    assert torch.equal(h, h_full)
    assert torch.equal(kv.k[:, :, :, :len(p)], full.k[:, :, :, :len(p)])
    assert torch.equal(kv.v[:, :, :, :len(p)], full.v[:, :, :, :len(p)])


def test_prefill_in_chunks_with_ragged_rows_equals_one_forward(target):
    ps = prompts(3, 48, seed=4, lo=5, hi=40)
    one, chunked = target.new_cache(3, 64), target.new_cache(3, 64)
    h1 = prefill(target, one, ps, chunk=1 << 20)
    h2 = prefill(target, chunked, ps, chunk=7)
    assert torch.equal(h1, h2)
    for b, p in enumerate(ps):
        assert torch.equal(one.k[:, b, :, :len(p)], chunked.k[:, b, :, :len(p)])


def test_a_hit_always_leaves_the_last_prompt_token_to_run(target):
    p = prompts(1, 48, seed=5, lo=16, hi=17)[0]  # exactly two blocks
    pc = PromptCache(1 << 30, BT)
    prefill_cached(target, target.new_cache(1, 32), [p], pc, "target")
    assert pc.cached("target", p) == 2 * BT - 1  # not 16: the last token's hidden state gives the first new token
    assert pc.cached("target", p + [7]) == 2 * BT


def test_a_prompt_diverging_inside_a_cached_block_reuses_the_tokens_before_the_difference(target):
    p = prompts(1, 48, seed=15, lo=40, hi=41)[0]
    q = p[:20] + [(t + 1) % 46 + 2 for t in p[20:30]]  # shares 20 tokens: two blocks and 4 of the third
    pc = PromptCache(1 << 30, BT)
    prefill_cached(target, target.new_cache(1, 64), [p], pc, "target")
    kv, full = target.new_cache(1, 64), target.new_cache(1, 64)
    h, reused = prefill_cached(target, kv, [q], pc, "target")
    assert reused == [20]
    assert torch.equal(h, prefill(target, full, [q]))
    assert torch.equal(kv.k[:, :, :, :len(q)], full.k[:, :, :, :len(q)])
    # and q's own tail (3 whole blocks + 6 ids) is kept next to p's third block
    assert pc.cached("target", q + [5]) == len(q)


def _conversation(reqs_of_turn, run, pc):
    """Three turns: each next prompt resends the previous prompt and answer plus new text."""
    got, prev = [], []
    for extra, params in reqs_of_turn:
        req = Request(prev + extra, 12, params, end_ids=())
        (res,) = run([req], pc)
        got.append((res.tokens, res.cached_tokens))
        prev = req.prompt + res.tokens
    return got


def _methods(target, draft):
    from pipeline.runtime.medusa import make_engine, medusa_generate
    from pipeline.runtime.speculative import draft_target, prompt_lookup
    from tests.test_medusa import random_heads

    engine = make_engine(random_heads(target), [[0], [1], [0, 0], [0, 0, 0]])

    def pool(reqs, pc):
        cb = ContinuousBatch(target, 2, 32, prompt_cache=pc)
        out = dict(cb.admit(reqs, list(range(len(reqs)))))
        while cb.rows:
            out.update(cb.step())
        return [out[i] for i in range(len(reqs))]

    return {
        "baseline": lambda reqs, pc: generate(target, reqs, prompt_cache=pc),
        "continuous": pool,
        "draft_target": lambda reqs, pc: draft_target(target, draft, reqs, 3, prompt_cache=pc),
        "draft_target_lookup": lambda reqs, pc: draft_target(target, draft, reqs, 3, lookup_min_ngram=2,
                                                             prompt_cache=pc),
        "prompt_lookup": lambda reqs, pc: prompt_lookup(target, reqs, 3, max_ngram=2, prompt_cache=pc),
        "medusa": lambda reqs, pc: medusa_generate(target, engine, reqs, prompt_cache=pc),
    }


@pytest.mark.parametrize("method", ["baseline", "continuous", "draft_target", "draft_target_lookup", "prompt_lookup",
                                    "medusa"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_every_method_answers_the_same_with_the_cache_on_and_off(target, draft, method, temperature):
    run = _methods(target, draft)[method]
    turns = [(p, SamplingParams(temperature, seed=11 + i)) for i, p in enumerate(prompts(3, 48, seed=8, lo=10, hi=20))]
    off = _conversation(turns, run, None)
    pc = PromptCache(1 << 30, BT)
    on = _conversation(turns, run, pc)
    assert [t for t, _ in on] == [t for t, _ in off]
    assert on[0][1] == 0 and all(c == 0 for _, c in off)
    assert on[1][1] >= BT and on[2][1] >= on[1][1]  # later turns start from the earlier turns' K/V
    if method.startswith("draft_target"):
        assert pc.stats.per_kind["draft"][0] > 0  # the draft's prefill reused its cached prefix too
    if method != "medusa":  # prompt + answer were kept: the third turn reuses more than the second prompt held
        assert on[2][1] > len(turns[0][0]) + len(turns[1][0]) - BT


def test_cache_prompt_false_neither_reuses_nor_keeps(target):
    p = prompts(1, 48, seed=9, lo=30, hi=31)[0]
    pc = PromptCache(1 << 30, BT)
    generate(target, [Request(p, 4, cache_prompt=False)], prompt_cache=pc)
    assert len(pc) == 0
    generate(target, [Request(p, 4)], prompt_cache=pc)
    (res,) = generate(target, [Request(p + [5], 4, cache_prompt=False)], prompt_cache=pc)
    assert res.cached_tokens == 0 and len(pc) > 0


def test_the_budget_holds_and_the_least_recently_used_leaves_go_first(target):
    a, b, c = prompts(3, 48, seed=10, lo=16, hi=17)  # two whole blocks each
    pc = PromptCache(_budget(target, 4), BT)
    for p in (a, b):
        prefill_cached(target, target.new_cache(1, 32), [p], pc, "target")
    assert len(pc) == 4 and pc.bytes == _budget(target, 4)
    assert pc.cached("target", a) == 2 * BT - 1
    prefill_cached(target, target.new_cache(1, 32), [a], pc, "target")  # a is used again: b is now older
    prefill_cached(target, target.new_cache(1, 32), [c], pc, "target")
    assert pc.bytes <= _budget(target, 4)
    assert pc.cached("target", a) == 2 * BT - 1 and pc.cached("target", c) == 2 * BT - 1
    assert pc.cached("target", b) == 0  # b's leaf went first, then its root (a leaf by then)
    assert pc.stats.evicted_blocks == 2


def test_a_block_larger_than_the_budget_is_never_stored(target):
    p = prompts(1, 48, seed=12, lo=20, hi=21)[0]
    pc = PromptCache(_budget(target, 1) - 1, BT)
    prefill_cached(target, target.new_cache(1, 32), [p], pc, "target")
    assert len(pc) == 0 and pc.bytes == 0


def test_a_failed_prefill_leaves_no_entry(target):
    good = prompts(1, 48, seed=13, lo=20, hi=21)[0]
    bad = good[:10] + [10_000] + good[10:]  # a token id past the vocabulary: the prefill raises
    pc = PromptCache(1 << 30, BT)
    pool = ContinuousBatch(target, 2, 32, prompt_cache=pc)
    with pytest.raises(IndexError):
        pool.admit([Request(bad, 4)], ["x"])
    assert len(pc) == 0 and not pool.rows


def test_a_cancelled_row_leaves_only_its_finished_prompt(target):
    p = prompts(1, 48, seed=14, lo=20, hi=21)[0]
    pc = PromptCache(1 << 30, BT)
    pool = ContinuousBatch(target, 2, 32, prompt_cache=pc)
    toks: list[int] = []
    pool.admit([Request(p, 30, end_ids=())], ["x"], lambda tag, t: toks.extend(t))
    for _ in range(12):
        pool.step(lambda tag, t: toks.extend(t))
    kept = len(pc)
    pool.remove(lambda tag: True)  # cancelled: its answer is not kept
    assert len(pc) == kept and len(toks) == 13
    assert pc.cached("target", p + toks + [1]) == len(p)  # the prompt, not one answer token further


def test_byte_budgets_are_read_as_sizes_and_a_bad_one_is_named(tmp_path):
    from pipeline import spec as specmod
    from tests.conftest import write_spec

    s = specmod.load(write_spec(tmp_path, prompt_cache={"bytes": "2GiB", "block_tokens": 32},
                                kv_cache={"bytes": 3 * 2**31, "prefill_chunk": 16}))
    assert (s.prompt_cache.bytes, s.prompt_cache.block_tokens) == (2**31, 32)
    assert (s.kv_cache.bytes, s.kv_cache.prefill_chunk) == (3 * 2**31, 16)
    with pytest.raises(specmod.SpecError, match=r"prompt_cache\.bytes: got '2 GB'; send a whole number of bytes"):
        specmod.load(write_spec(tmp_path, prompt_cache={"bytes": "2 GB"}))
    with pytest.raises(specmod.SpecError, match=r"prompt_cache\.block_tokens: got 0"):
        specmod.load(write_spec(tmp_path, prompt_cache={"block_tokens": 0}))

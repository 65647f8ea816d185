"""A draft model behind a lookup (hybrid) prefills a long prompt only once the lookup keeps failing (DEFER_MIN,
DEFER_RATE in pipeline.runtime.speculative): it never runs while the lookup drafts or the plain-step allowance lasts,
runs in the first round that drafts on a short prompt, never in a batch the load policy keeps on plain steps, and
the answer is baseline's token for token either way."""

from __future__ import annotations

import pytest

from pipeline.runtime.decode import decode
from pipeline.runtime.generate import Request, generate
from pipeline.runtime.loadpolicy import DraftPolicy
from pipeline.runtime.speculative import DEFER_MIN, DEFER_RATE, draft_target
from tests.test_loadpolicy import _memory_bound
from tests.test_speculative import prompts, tiny
from tests.test_suffix import bundle

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair():
    t = tiny(seed=0)
    return t, tiny(base=t, noise=0.02, seed=7)


def _fed(model) -> tuple[list[int], object]:
    """Tokens each forward of `model` ran (a forward hook: the real model runs)."""
    seen: list[int] = []
    return seen, model.register_forward_hook(lambda _m, args, _out: seen.append(args[0].numel()))


def _hybrid(t, d, prompt: list[int], new: int, min_match: int) -> tuple[list[int], list[int]]:
    b = bundle(t, d, suffix_store_bytes=0, suffix_min_match=min_match)
    seen, hook = _fed(d)
    try:
        (r,) = decode(b, "hybrid", [Request(prompt, new)])
    finally:
        hook.remove()
    return r.tokens, seen


def test_a_long_prompt_the_lookup_never_fails_on_costs_no_draft_prefill(pair):
    t, d = pair
    p = prompts(1, 48, seed=11, lo=DEFER_MIN + 64, hi=DEFER_MIN + 65)[0]
    new = (len(p) // DEFER_RATE) - 2  # fewer lookup-less rounds than the allowance: the draft model never runs
    (want,) = generate(t, [Request(p, new)])
    got, seen = _hybrid(t, d, p, new, min_match=64)  # a match of 64 never happens: no lookup draft either
    assert got == want.tokens
    assert seen == []


def test_a_long_prompt_whose_lookup_keeps_failing_prefills_the_draft_after_its_allowance(pair):
    t, d = pair
    p = prompts(1, 48, seed=12, lo=DEFER_MIN + 8, hi=DEFER_MIN + 9)[0]
    allowance = len(p) // DEFER_RATE
    new = allowance + 40
    (want,) = generate(t, [Request(p, new)])
    got, seen = _hybrid(t, d, p, new, min_match=64)
    assert got == want.tokens
    # the prompt and the plain steps' tokens, once, in prefill's chunks; then the usual draft steps
    assert sum(seen) >= len(p) + allowance
    assert max(seen) <= max(len(p), 2048)


def test_a_short_prompt_prefills_the_draft_at_once(pair):
    t, d = pair
    p = prompts(1, 48, seed=13, lo=DEFER_MIN // 2, hi=DEFER_MIN // 2 + 1)[0]
    (want,) = generate(t, [Request(p, 12)])
    got, seen = _hybrid(t, d, p, 12, min_match=64)
    assert got == want.tokens
    assert seen and seen[0] == len(p)  # the whole prompt in the first forward, before any draft step


def test_deferral_leaves_rows_batched_together_exact(pair):
    t, d = pair
    long_p = prompts(1, 48, seed=14, lo=DEFER_MIN + 40, hi=DEFER_MIN + 41)[0]
    short_p = prompts(1, 48, seed=15, lo=20, hi=21)[0]
    reqs = [Request(long_p, 30), Request(short_p, 30)]
    want = [r.tokens for r in generate(t, reqs)]
    b = bundle(t, d, suffix_store_bytes=0, suffix_min_match=64)
    got = decode(b, "hybrid", [Request(long_p, 30), Request(short_p, 30)])
    assert [r.tokens for r in got] == want


def test_a_batch_the_load_policy_keeps_on_plain_steps_never_prefills_the_draft(pair):
    t, d = pair
    never = DraftPolicy(_memory_bound(3), 3, [0.0, 0.0, 0.0])  # drafting never pays: every round a plain step
    reqs = [Request(p, 12) for p in prompts(2, 48, seed=16, lo=20, hi=40)]
    want = [r.tokens for r in generate(t, reqs)]
    seen, hook = _fed(d)
    try:
        got = draft_target(t, d, [Request(p, 12) for p in prompts(2, 48, seed=16, lo=20, hi=40)], 3, policy=never)
    finally:
        hook.remove()
    assert [r.tokens for r in got] == want
    assert seen == []  # the draft's prefill waits for a round that drafts, and none came

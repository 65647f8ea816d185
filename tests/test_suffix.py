"""Suffix drafting (methods suffix and hybrid, Predicted Outputs) is exact: greedy output equals the baseline token for
token whatever the prediction or the store of recent outputs holds, and sampling preserves the target's distribution."""

from __future__ import annotations

import pytest
import torch

from pipeline.runtime.decode import Bundle, decode
from pipeline.runtime.generate import Request, generate
from pipeline.runtime.sampling import SamplingParams
from pipeline.runtime.specconfig import SpecDecodeConfig
from pipeline.runtime.suffix import (
    ANCHOR,
    PREDICTION_FORGET,
    PREDICTION_PRIOR,
    TOKEN_BYTES,
    VERIFY_COST,
    Odds,
    SuffixDrafter,
    SuffixStore,
    _Index,
    best_draft,
)
from tests.test_speculative import V, exact_two_token_dist, prompts, tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair():
    t = tiny(seed=0)
    return t, tiny(base=t, noise=0.02, seed=7)


def bundle(target, draft=None, max_draft_len: int = 16, **spec) -> Bundle:
    cfg = SpecDecodeConfig(max_draft_len=max_draft_len, num_draft_tokens=3, **spec)
    return Bundle(target, None, {"build_config": {"max_draft_len": max_draft_len}}, draft, spec=cfg)


def _reqs(ps, new=(24, 9, 17, 30), **kw):
    return [Request(p, new[i % len(new)], end_ids=(1,), **kw) for i, p in enumerate(ps)]


def repetitive(n: int, seed: int) -> list[list[int]]:
    return [p + p[: len(p) // 2] + p for p in prompts(n, 48, seed=seed, lo=6, hi=20)]


@pytest.mark.parametrize("method", ["suffix", "hybrid"])
@pytest.mark.parametrize("store", [0, 4096])
def test_greedy_suffix_and_hybrid_equal_baseline(pair, method, store):
    t, d = pair
    b = bundle(t, d, suffix_store_bytes=store, suffix_min_match=2)
    ps = repetitive(6, seed=3)
    want = [r.tokens for r in generate(t, _reqs(ps))]
    for _ in range(2):  # the second pass drafts from the store the first one filled
        got = decode(b, method, _reqs(ps))
        assert [r.tokens for r in got] == want
    assert sum(r.draft_accepted for r in got) > 0
    if store:
        assert 0 < b.suffix_store.bytes <= store


def test_suffix_drafts_long_runs_from_the_store_of_recent_outputs(pair):
    t, _ = pair
    p = prompts(1, 48, seed=5, lo=12, hi=13)[0]
    (ref,) = generate(t, [Request(p, 40)])
    b = bundle(t, suffix_store_bytes=1 << 20)
    (cold,) = decode(b, "suffix", [Request(p, 40)])
    (warm,) = decode(b, "suffix", [Request(p, 40)])  # an agent resending: the store holds the answer
    assert cold.tokens == warm.tokens == ref.tokens
    assert warm.steps < len(warm.tokens) / 4 < cold.steps  # long drafts accepted: a few target forwards in all


def test_a_request_without_the_cache_neither_drafts_from_the_store_nor_feeds_it(pair):
    """`cache_prompt: false` (what validate sends to time each method as on a fresh prompt): no draft from earlier
    requests' outputs and nothing left for later ones; the answer is the same either way."""
    t, _ = pair
    p = prompts(1, 48, seed=5, lo=12, hi=13)[0]
    (ref,) = generate(t, [Request(p, 40)])
    b = bundle(t, suffix_store_bytes=1 << 20)
    (first,) = decode(b, "suffix", [Request(p, 40, cache_prompt=False)])
    assert b.suffix_store.bytes == 0, "a request without the cache left its answer in the store"
    (fed,) = decode(b, "suffix", [Request(p, 40)])
    assert b.suffix_store.bytes > 0
    (fresh,) = decode(b, "suffix", [Request(p, 40, cache_prompt=False)])
    (warm,) = decode(b, "suffix", [Request(p, 40)])
    assert first.tokens == fed.tokens == fresh.tokens == warm.tokens == ref.tokens
    # The store's answer drafted would take a few target forwards (as `warm` does); without it, many (the store's
    # learned odds may still move a draft length by a token: statistics, not content).
    assert warm.steps < len(warm.tokens) / 4 < min(first.steps, fresh.steps)


@pytest.mark.parametrize("method", ["suffix", "hybrid"])
def test_prediction_right_or_wrong_never_changes_the_answer(pair, method):
    t, d = pair
    b = bundle(t, d)
    ps = prompts(4, 48, seed=9, lo=4, hi=12)
    base = generate(t, _reqs(ps, new=(40,)))
    g = torch.Generator().manual_seed(1)
    wrong = [torch.randint(2, 48, (40,), generator=g).tolist() for _ in ps]
    for preds in ([r.tokens for r in base], wrong, [[]] * 4, [r.tokens[:10] + w[:5] + r.tokens[15:]
                                                             for r, w in zip(base, wrong)]):
        reqs = [Request(p, 40, end_ids=(1,), prediction=q) for p, q in zip(ps, preds)]
        got = decode(b, method, reqs)
        assert [r.tokens for r in got] == [r.tokens for r in base]
    right = decode(b, "suffix", [Request(p, 40, end_ids=(1,), prediction=r.tokens) for p, r in zip(ps, base)])
    assert all(r.steps <= len(r.tokens) // 4 + 1 for r in right)  # the right prediction drafts the whole answer


# A verify curve as flat as bench measures where verification is cheap (33 tokens at 2.6 one-token steps, less than
# two 8-token verifies on the Zen 4): the suffix drafter then drafts up to limits.max_draft_len.
FLAT = tuple(1.0 + 0.05 * s for s in range(64))


def _widest(per_position: list[int]) -> int:
    """The most tokens one round drafted (proposed_per_position) or had accepted (accepted_per_position): the last
    nonzero slot (the lists are as long as the method's k)."""
    return max((i + 1 for i, n in enumerate(per_position) if n), default=0)


@pytest.mark.parametrize("method", ["suffix", "hybrid"])
def test_a_repeated_answer_is_drafted_and_accepted_past_8_tokens_in_one_round_up_to_max_draft_len(pair, method):
    """limits.max_draft_len 32 with the draft model's k still 3: a resent request (its answer in the store) and a
    prediction that is the answer both draft and commit more than 8 tokens in a round, at most 32; with 8, at most 8.
    Greedy output is the baseline's throughout."""
    t, d = pair
    p = prompts(1, 48, seed=5, lo=12, hi=13)[0]
    (ref,) = generate(t, [Request(p, 80)])
    assert len(ref.tokens) == 80
    for mdl in (32, 8):
        b = bundle(t, d, max_draft_len=mdl, suffix_store_bytes=1 << 20, suffix_min_match=2)
        b.verify_cost = FLAT
        (cold,) = decode(b, method, [Request(p, 80)])
        (warm,) = decode(b, method, [Request(p, 80)])  # the store holds the answer
        (pred,) = decode(b, method, [Request(p, 80, cache_prompt=False, prediction=ref.tokens)])
        assert cold.tokens == warm.tokens == pred.tokens == ref.tokens
        for r in (warm, pred):
            assert _widest(r.proposed_per_position) <= mdl
            if mdl == 32:
                assert _widest(r.accepted_per_position) > 8 and r.steps <= 80 // 9
            else:
                assert _widest(r.accepted_per_position) == 8  # the cap, reached
        assert b.spec.num_draft_tokens == 3  # the draft model's k is its own


def test_long_drafts_follow_the_verify_curve_not_the_cap(pair):
    """The same right prediction with limits.max_draft_len 32: on the flat curve rounds draft the cap; on the Zen 4
    curve bench measured (16 tokens at 3.93 steps) no round drafts more than its best length there."""
    t, _ = pair
    p = prompts(1, 48, seed=5, lo=12, hi=13)[0]
    (ref,) = generate(t, [Request(p, 80)])
    widths = {}
    for name, cost in (("flat", FLAT), ("zen4", VERIFY_COST)):
        b = bundle(t, max_draft_len=32)
        b.verify_cost = cost
        (r,) = decode(b, "suffix", [Request(p, 80, cache_prompt=False, prediction=ref.tokens)])
        assert r.tokens == ref.tokens
        widths[name] = _widest(r.proposed_per_position)
    assert widths["flat"] == 32 and 8 <= widths["zen4"] <= best_draft(0.999, 32, VERIFY_COST)[0] < 16


@pytest.mark.parametrize("method", ["suffix", "hybrid", "draft_target"])
def test_a_capped_answer_drafts_no_token_past_its_room(pair, method):
    """max_new_tokens bounds what a round can emit, so drafts past it would be verified for nothing: with the answer
    as the prediction on the flat curve, a 12-token answer verifies its 10 drafts and no more (1 token from the
    prefill, 1 bonus); a 3-token answer drafts at most 1 a round (the draft model narrowed too), a 2-token one none."""
    t, d = pair
    p = prompts(1, 48, seed=5, lo=12, hi=13)[0]
    (ref,) = generate(t, [Request(p, 80)])
    b = bundle(t, d, max_draft_len=32, suffix_min_match=2)
    b.verify_cost = FLAT
    for new, most in ((12, 10), (3, 1), (2, 0)):
        (r,) = decode(b, method, [Request(p, new, cache_prompt=False, prediction=ref.tokens)])
        assert r.tokens == ref.tokens[:new]
        assert _widest(r.proposed_per_position) <= most
        if method != "draft_target" and most:
            assert r.draft_proposed == r.draft_accepted == most  # the prediction is the answer: nothing wasted


@pytest.mark.parametrize("min_match", [ANCHOR, 4])
def test_after_an_edit_in_copied_text_the_drafter_resyncs_to_the_source_past_it(min_match):
    """An answer copying the prompt's file, with one token replaced (a renamed identifier): once the output's last
    token is met again in the file just past the mismatch, the row drafts what follows it there ("resync"), where
    the suffix method would otherwise have no 2-token match and take a plain step. The hybrid (min_match 4) leaves
    such a row to its draft model, except while the draft model waits for its prefill (`weak`)."""
    src = list(range(10, 70))
    prompt = [2, 3, *src, 4]
    d = SuffixDrafter([Request(prompt, 64)], 16, "cpu", None, FLAT, min_match)
    c = prompt + src[:12]  # copying the file
    first = d.row_draft(0, c)
    assert len(first) > 3 and first == src[12:12 + len(first)]
    c = c + src[12:15] + [99]  # the target took 3 drafted tokens, then wrote 99 where the file has src[15]
    # 99 is nowhere in the file: the guess is that it replaced src[15] and the file goes on from src[16] ("skip")
    skip = d.row_draft(0, c) if min_match == ANCHOR else d.weak(0, c)
    assert skip and skip == src[16:16 + len(skip)] and d.rows[0].last[0] == "skip"
    if min_match > ANCHOR:
        assert d.row_draft(0, c) == []  # the hybrid's draft model would take the row
    d.rows[0].last = None  # that draft was not verified
    c = c + [src[16]]  # ... and goes on as the file does
    strong = d.row_draft(0, c)
    got = strong if min_match == ANCHOR else d.weak(0, c)
    assert got and got == src[17:17 + len(got)] and d.rows[0].last[0] == "resync"
    if min_match > ANCHOR:
        assert strong == []  # the hybrid's draft model would take the row
    d.rows[0].last = None  # that draft was not verified
    c = c + [80, 81, 82]  # then text the file does not have: no draft from it
    assert d.weak(0, c) == []


def test_the_hybrid_leaves_a_match_the_draft_model_would_beat_to_the_model():
    """`beat` (the draft model's expected tokens per step, pick-k's): a context match whose odds and the verify
    curve promise less per step drafts nothing, so the hybrid's draft model takes the row; a long match, an aligned
    prediction and `weak` (the model waiting for its prefill) draft as before."""
    src = list(range(10, 70))
    prompt = [2, 3, *src, 4]

    def drafter(beat: float, prediction=None) -> SuffixDrafter:
        return SuffixDrafter([Request(prompt, 64, prediction=prediction)], 16, "cpu", None, VERIFY_COST, 4, beat)

    short = prompt + src[:4]  # a 4-token match: p 4 / 6 by the prior, about 1.9 tokens a step on the Zen 4 curve
    assert drafter(0.0).row_draft(0, short) and drafter(1.5).row_draft(0, short)
    assert drafter(2.5).row_draft(0, short) == []
    weak = drafter(2.5).weak(0, short)
    assert weak and weak == src[4:4 + len(weak)]
    long = prompt + src[:12]  # 12 tokens: p 12 / 14, about 3 a step
    got = drafter(2.5).row_draft(0, long)
    assert got and got == src[12:12 + len(got)]
    predicted = drafter(2.5, prediction=src).row_draft(0, short)  # the prediction, aligned after 4 tokens
    assert predicted and predicted == src[4:4 + len(predicted)]


def test_a_predictions_odds_are_its_own_requests_not_the_deployments():
    """Two requests on one deployment's store (its odds shared by every request): a wrong prediction's rejections
    leave the next request's right prediction drafting as long as on a fresh deployment; the context and store odds
    stay shared."""
    src = list(range(10, 70))
    prompt = [2, 3, 4, 5]

    def draft_len(store: SuffixStore) -> int:
        d = SuffixDrafter([Request(prompt, 64, prediction=src)], 16, "cpu", store, VERIFY_COST)
        return len(d.row_draft(0, prompt))

    fresh = draft_len(SuffixStore(1 << 20))
    assert fresh > 1
    store = SuffixStore(1 << 20)
    wrong = SuffixDrafter([Request(prompt, 64, prediction=src)], 16, "cpu", store, VERIFY_COST)
    c = list(prompt)
    for t in range(80, 92):  # the output never follows the prediction; it realigns on each 3-token match
        wrong.row_draft(0, c)
        c = c + [t]
    assert not any(k[0] == "prediction" for k in store.odds.tested)
    assert draft_len(store) == fresh


def test_a_failing_prediction_leaves_its_rounds_to_a_longer_context_match():
    """An aligned prediction and a long match of the prompt are weighed by what their odds promise a step: while the
    prediction's odds are the prior it drafts; once its own rounds were rejected, the context's continuation does."""
    src = list(range(10, 70))
    prompt = [2, 3, *src, 4]
    out = src[:12]
    pred = out + [99] * 40  # follows the output so far, then goes elsewhere
    d = SuffixDrafter([Request(prompt, 64, prediction=pred)], 16, "cpu", None, VERIFY_COST)
    first = d.row_draft(0, prompt + out)
    assert first and first[0] == 99
    row = d.rows[0]
    row.last = None
    for _ in range(12):
        row.pred_odds.add("prediction", 64, 4, 0)
    got = d.row_draft(0, prompt + out)
    assert got and got == src[12:12 + len(got)]


def _rounds(d: SuffixDrafter, prompt: list[int], out: list[int]) -> list[tuple[int, list[int], int]]:
    """Row 0 of `d` verified as a target whose greedy answer is `out` would: each round commits the draft's
    agreeing prefix and the target's own next token. (output position, draft, tokens of it accepted) a round."""
    c, rounds = list(prompt), []
    while len(c) - len(prompt) < len(out):
        pos = len(c) - len(prompt)
        draft = d.row_draft(0, c)
        n = 0
        while n < len(draft) and pos + n < len(out) and draft[n] == out[pos + n]:
            n += 1
        rounds.append((pos, draft, n))
        c = c + out[pos:pos + n + 1]
    return rounds


def _with_at(tokens: list[int], at: tuple[int, ...], parts: list[list[int]]) -> list[int]:
    """tokens with parts[i] put before tokens[at[i]]."""
    out = []
    for i, t in enumerate(tokens):
        if i in at:
            out += parts[at.index(i)]
        out.append(t)
    return out


def test_a_renamed_identifier_is_drafted_renamed_after_its_first_use():
    """A prediction holding an identifier three times, an answer that renames it (one token to two): the first use
    misses, and once the output is back on the prediction the rename is a substitution, so the later uses are
    drafted renamed and every later draft is accepted whole."""
    body, X, new = list(range(10, 130)), 200, [201, 202]
    pred = _with_at(body, (20, 50, 80), [[X]] * 3)
    out = _with_at(body, (20, 50, 80), [new] * 3)
    d = SuffixDrafter([Request([2, 3], 200, prediction=pred)], 16, "cpu", None, VERIFY_COST)
    rounds = _rounds(d, [2, 3], out)
    assert d.rows[0].subs == [((X,), tuple(new))]
    assert any(pos <= 20 < pos + len(draft) and draft[20 - pos] == X for pos, draft, _ in rounds)  # the first use
    later = [(pos, draft, n) for pos, draft, n in rounds if pos > 30]
    assert any(pos <= 51 < pos + len(draft) for pos, draft, _ in later)  # the second use was drafted ...
    assert all(n == len(draft) or pos + n == len(out) for pos, draft, n in later)  # ... and nothing missed


def test_a_diverged_prediction_rejoins_at_the_nearest_equal_match_past_where_it_left():
    """The edit set's calendar fix: the answer writes "or" where the prediction has "and", then "year % 4", which the
    prediction holds just past the edit ("year % 400") and again lines later ("2000 + year % 400"). Both match as
    long; the output rejoins where it left the prediction, not at the later line (drafted there, 11 tokens had 2
    accepted). With no divergence to be near, equal matches still go to the latest occurrence."""
    head, mid, A = list(range(10, 40)), list(range(100, 140)), [60, 61, 62]
    X, Y, Q = 200, 201, 202
    pred = head + [X] + A + [70, 71, 72, 73] + mid + [Q] + A + [80, 81, 82, 83]
    d = SuffixDrafter([Request([2, 3], 200, prediction=pred)], 16, "cpu", None, FLAT)
    c = [2, 3] + head
    assert d.row_draft(0, c)[0] == X  # aligned: the prediction drafts on
    c = c + [Y]  # the target wrote Y where the prediction has X
    assert d.row_draft(0, c)[:2] == A[:2] and d.rows[0].last[0] == "skip"  # the guess: Y replaced X
    d.rows[0].last = None  # that draft was not verified
    c = c + A  # then text the prediction holds twice, after X and after Q
    assert d.row_draft(0, c)[:4] == [70, 71, 72, 73]
    assert d.rows[0].last[0] == "prediction"
    ix = _Index()
    ix.extend(pred)
    assert ix.best([Y] + A) == (3, len(pred) - 4)  # no `near`: the latest of equal matches


def test_after_a_mismatch_with_the_prompt_equal_matches_go_to_the_nearest_past_it():
    """The same edit with the file in the prompt (no prediction): after the long copy's mismatch, the text the file
    holds twice is drafted from the occurrence just past the mismatch, not from the latest one."""
    head, mid, A = list(range(10, 40)), list(range(100, 140)), [60, 61, 62]
    X, Y, Q = 200, 201, 202
    prompt = [2, 3] + head + [X] + A + [70, 71, 72, 73] + mid + [Q] + A + [80, 81, 82, 83] + [4]
    d = SuffixDrafter([Request(prompt, 200)], 16, "cpu", None, FLAT)
    c = prompt + head[:20]
    first = d.row_draft(0, c)
    assert first[:11] == head[20:] + [X]  # the copy drafts on past the edit point
    c = c + head[20:] + [Y]  # the target took the rest of the head, then wrote Y where the file has X
    d.row_draft(0, c)
    c = c + A
    assert d.row_draft(0, c)[:2] == [70, 71]


def test_a_substitution_the_output_declines_is_dropped_and_costs_the_prediction_no_odds():
    """A one-off fix (X -> Z at its first use only) is learnt as a substitution like a rename, drafted at the next X,
    declined there (the answer keeps X): it is dropped, that round counts no miss against the prediction, and the
    third X is drafted as the prediction has it."""
    body, X, Z = list(range(10, 130)), 200, 203
    pred = _with_at(body, (20, 50, 80), [[X]] * 3)
    out = _with_at(body, (20, 50, 80), [[Z], [X], [X]])
    d = SuffixDrafter([Request([2, 3], 200, prediction=pred)], 16, "cpu", None, VERIFY_COST)
    row = d.rows[0]
    c, declined, rounds = [2, 3], None, []
    while len(c) - 2 < len(out):
        pos = len(c) - 2
        draft = d.row_draft(0, c)  # takes in the last round's outcome first
        misses = sum(row.pred_odds.tested.values()) - sum(row.pred_odds.accepted.values())
        if declined is not None and declined[0] is None:
            declined[0] = misses  # with the declined round's outcome in
        n = 0
        while n < len(draft) and pos + n < len(out) and draft[n] == out[pos + n]:
            n += 1
        if Z in draft and pos > 30:
            assert row.subs == [((X,), (Z,))] and draft[n] == Z  # offered, and declined there
            declined = [None, misses]
        rounds.append((pos, draft, n))
        c = c + out[pos:pos + n + 1]
    assert declined is not None and row.subs == []
    assert declined[0] <= declined[1] + 1e-9  # the declined round added no miss (earlier ones only fade)
    third = out.index(X, out.index(X) + 1)
    assert any(pos <= third < pos + n and draft[third - pos] == X for pos, draft, n in rounds)


def test_an_aligned_prediction_drafts_long_from_its_first_round():
    """A client sends a prediction to have it repeated: aligned, its first draft is as long as its prior odds and the
    verify curve allow (11 tokens on the Zen 4 curve), not a ramp from a few tokens."""
    src = list(range(10, 70))
    d = SuffixDrafter([Request([2, 3, 4, 5], 64, prediction=src)], 16, "cpu", None, VERIFY_COST)
    first = d.row_draft(0, [2, 3, 4, 5])
    assert first == src[:len(first)] and len(first) == best_draft(PREDICTION_PRIOR, 16, VERIFY_COST)[0] >= 11


def test_a_predictions_misses_fade_as_its_tokens_are_accepted():
    """A prediction's odds forget a miss as its tokens are accepted (edits cluster; past them the prediction is the
    text again), so its drafts grow back to their length; misses with nothing accepted since do not fade."""
    def odds(forget: float, rounds: list[tuple[int, int]]) -> float:
        o = Odds(forget=forget)
        for drafted, accepted in rounds:
            o.add("prediction", 64, drafted, accepted)
        return o.p("prediction", 64)

    clean = [(16, 16)] * 7
    missed = [(16, 16), (16, 3), (8, 0)] + clean[1:]
    linear = [1.0 + 0.2 * s for s in range(64)]  # a verify that costs a fifth of a step a token

    def length(p: float) -> int:
        return best_draft(p, 32, linear)[0]

    assert odds(PREDICTION_FORGET, missed) > odds(1.0, missed)
    assert length(odds(1.0, missed)) < length(odds(1.0, clean)) == 32  # misses remembered: shorter for good
    assert length(odds(PREDICTION_FORGET, missed)) == 32  # forgotten after ~100 accepted tokens
    wrong = [(8, 0)] * 4  # an unrelated prediction: nothing accepted, nothing forgotten
    assert odds(PREDICTION_FORGET, wrong) == odds(1.0, wrong)


def test_a_deferred_hybrid_row_drafts_a_short_match_instead_of_a_plain_step(pair):
    """While the draft model waits for its prefill (a long prompt, DEFER_MIN), a row the hybrid's 4-token threshold
    leaves without a draft takes a 2-token match's continuation; the draft model still does not run."""
    from pipeline.runtime.speculative import DEFER_MIN, _ModelDrafter

    t, dm = pair
    p = prompts(1, 48, seed=21, lo=DEFER_MIN + 8, hi=DEFER_MIN + 9)[0]
    pairs = list(zip(p, p[1:]))
    i = next(i for i in range(8, len(p) - 8) if pairs.count(pairs[i]) == 1 and p[i - 1] != 47)
    ctx = p + [47, p[i], p[i + 1]]  # ends with the prompt's only (p[i], p[i + 1]), a 2-token match
    lookup = SuffixDrafter([Request(p, 8)], 8, "cpu", None, FLAT, 4)
    md = _ModelDrafter(dm, [Request(p, 8)], 3, V, lookup)
    md.prefill([p])
    seen: list[int] = []
    hook = dm.register_forward_hook(lambda _m, args, _out: seen.append(args[0].numel()))
    try:
        drafts, _q, limit = md.propose([ctx], torch.tensor([len(ctx) - 1]), [torch.Generator()])
    finally:
        hook.remove()
    assert seen == [] and limit[0] > 0
    assert drafts[0, :limit[0]].tolist() == p[i + 2:i + 2 + limit[0]]


def test_store_stays_within_its_byte_budget_and_drops_the_oldest():
    s = SuffixStore(100 * TOKEN_BYTES)
    for i in range(30):
        s.add([1000 + i] + list(range(i, i + 19)))
        assert s.bytes <= 100 * TOKEN_BYTES
    assert len(s.docs) == 5 and s.docs[0][1][0] == 1025  # the newest five of 20 tokens each
    assert s.entries <= 2 * s.tokens + 64
    s.add(list(range(200)))  # larger than the whole budget: not kept
    assert s.bytes <= 100 * TOKEN_BYTES and s.docs[-1][1][0] == 1029
    m, cont = s.best([30, 31, 32, 33, 34])
    assert m == 5 and cont[:3] == [35, 36, 37]
    assert s.best([7, 8, 9]) == (0, [])  # only in outputs dropped since


def test_draft_length_grows_with_the_odds_and_follows_the_verify_cost():
    lengths = [best_draft(p, 32, VERIFY_COST)[0] for p in (0.3, 0.7, 0.97)]
    assert lengths[0] < lengths[1] < lengths[2]
    assert 8 <= best_draft(0.99, 32, VERIFY_COST)[0] <= 12  # the Zen 4 curve: 16 tokens cost 3.93 steps, 12 cost 2.14
    flat = [1.0 + 0.01 * s for s in range(64)]
    assert best_draft(0.95, 32, flat)[0] == 32  # verification almost free: the whole cap
    steep = [1.0 + s for s in range(64)]  # every token costs a step: drafting never pays
    assert best_draft(0.9, 32, steep)[0] == 0


def sampled(b: Bundle, method: str, prompt, params, n: int, **kw) -> torch.Tensor:
    counts = torch.zeros(V, V)
    for c in range(0, n, 500):
        # 5 tokens: the first round has room for the draft model's k = 3 (with 2 it would be a plain step)
        reqs = [Request(prompt, 5, SamplingParams(params.temperature, params.top_k, params.top_p, seed=c + i), **kw)
                for i in range(500)]
        for r in decode(b, method, reqs):
            counts[r.tokens[0], r.tokens[1]] += 1
    return counts / counts.sum()


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("method,prediction", [("hybrid", None), ("hybrid", [4, 3, 7]), ("suffix", [5, 5, 5])])
def test_suffix_and_hybrid_sampling_preserve_target_distribution(temperature, method, prediction):
    t = tiny(vocab=V, seed=11, hidden=16, scale=0.6)
    d = tiny(vocab=V, seed=12, hidden=16, scale=0.6, layers=1)
    b = bundle(t, d, max_draft_len=4, suffix_min_match=2)
    prompt, params = [3, 7, 2, 4, 3, 7], SamplingParams(temperature)
    exact = exact_two_token_dist(t, prompt, params)
    emp = sampled(b, method, prompt, params, 6000, prediction=prediction)
    assert 0.5 * (emp - exact).abs().sum() < 0.045


def test_speculation_method_names_the_default_and_is_checked():
    from pipeline import spec as specmod
    from pipeline.triton.repo import default_methods

    assert default_methods(specmod.parse({"name": "x", "speculation": {"method": "suffix"}})) == ["suffix", "baseline"]
    assert default_methods(specmod.parse({"name": "x"})) == ["baseline"]
    assert default_methods(specmod.load("build/qwen_coder.yaml"))[0] == "hybrid"  # the flagship's default
    for method, words in (("hybrid", "needs a draft model"), ("nope", "must be one of")):
        with pytest.raises(specmod.SpecError, match=f"speculation.method: got '{method}'; {words}"):
            specmod.parse({"name": "x", "speculation": {"method": method}})
    with pytest.raises(specmod.SpecError, match="speculation.suffix_store_bytes"):
        specmod.parse({"name": "x", "speculation": {"suffix_store_bytes": -1}})
    assert specmod.parse({"name": "x", "speculation": {"suffix_store_bytes": "64MiB"}}).speculation.suffix_store_bytes \
        == 64 << 20


def test_an_answer_opening_as_the_prompt_quotes_the_prediction_drafts_it_from_its_first_round():
    """The prompt pastes the file after a fence (F1 F2 F3, "```python\\n") and the prediction is the file: an answer
    that opens with the fence has the rest of it and the file drafted in its first round, as the prediction; one that
    opens with the file itself is aligned as before; one that opens with neither drafts no prediction."""
    body, fence = list(range(10, 90)), [50, 51, 52]
    prompt = [2, 3, 60, 61] + fence + body + [50, 4]
    for first, expect in ((50, fence[1:] + body), (body[0], body[1:]), (70, None)):
        d = SuffixDrafter([Request(prompt, 64, prediction=body)], 16, "cpu", None, VERIFY_COST)
        draft = d.row_draft(0, prompt + [first])
        if expect is None:
            assert d.rows[0].last is None or d.rows[0].last[0] != "prediction"
        else:
            assert d.rows[0].last[0] == "prediction"
            assert draft == expect[:len(draft)] and len(draft) == best_draft(PREDICTION_PRIOR, 16, VERIFY_COST)[0]
    d = SuffixDrafter([Request([2, 3] + body, 64, prediction=body)], 16, "cpu", None, VERIFY_COST)
    assert d.rows[0].lead == [2, 3]  # nothing before the copy but the prompt's start
    assert SuffixDrafter([Request(prompt, 64, prediction=[7, 8, 9])], 16, "cpu", None, VERIFY_COST).rows[0].lead == []

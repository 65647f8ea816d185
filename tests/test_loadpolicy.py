"""The load-adaptive draft length (pipeline/runtime/loadpolicy.py): the choice on known costs and acceptance, and the
shared loop running rows of one batch at different lengths per round, exactly."""

from __future__ import annotations

import pytest

from pipeline import spec as specmod
from pipeline.runtime.decode import Bundle, decode, plain_rows
from pipeline.runtime.generate import Request, generate
from pipeline.runtime.loadpolicy import (
    MIN_GAIN,
    MIN_GAIN_ROWS,
    Costs,
    DraftPolicy,
    ceiling,
    choose,
    plain_from,
    policy_from,
    row_rates,
    tree_gain,
    tree_plain_from,
)
from pipeline.runtime.sampling import SamplingParams
from pipeline.runtime.specconfig import SpecDecodeConfig, SpeculationError
from pipeline.runtime.speculative import draft_target, prompt_lookup
from tests.test_speculative import prompts, tiny

pytestmark = pytest.mark.usefixtures("one_thread")

# A CPU where a step of a few rows is bound by memory (one read of the weights: 10 ms whatever the tokens, up to 16
# tokens in one step) and then grows with the work; a draft step is a tenth of the target's.
BOUND = 16


def _memory_bound(k_max: int = 8, rows=(1, 2, 4, 8, 16)) -> Costs:
    def step(tokens: int) -> float:
        return 0.010 * max(1.0, tokens / BOUND)

    return Costs({r: 0.1 * step(r) for r in rows}, {r: [step(r * n) for n in range(1, k_max + 2)] for r in rows})


GOOD = [0.8, 0.64, 0.51, 0.41, 0.33, 0.26, 0.21, 0.17]  # P(first i+1 accepted) of a draft agreeing 80% a token


def test_one_row_with_a_good_draft_drafts_long_and_a_full_batch_does_not_draft():
    c = _memory_bound()
    one, _ = choose([GOOD], [100], 8, c)
    assert one[0] >= 4  # the verify of 5+ tokens costs what one does
    full, _ = choose([GOOD] * 16, [100] * 16, 8, c)
    assert full == [0] * 16  # 16 rows already fill the step: every draft token costs its share


def test_the_width_shrinks_as_rows_are_added():
    c = _memory_bound()
    widths = [max(choose([GOOD] * b, [100] * b, 8, c)[0]) for b in (1, 2, 4, 8, 16)]
    assert widths == sorted(widths, reverse=True) and widths[0] > widths[-1]


def test_a_draft_that_is_never_accepted_is_not_run_at_any_load():
    c = _memory_bound()
    for b in (1, 4):
        assert choose([[0.0] * 8] * b, [100] * b, 8, c)[0] == [0] * b


def test_a_row_near_the_end_of_its_budget_drafts_only_what_it_can_still_emit():
    ks, _ = choose([GOOD, GOOD], [100, 3], 8, _memory_bound())
    assert ks[0] > ks[1] == 2  # 3 tokens left: 2 drafts and the bonus token


def test_finished_rows_draft_nothing_but_still_count_in_the_step_cost():
    c = _memory_bound()
    alone, rate_alone = choose([GOOD], [100], 8, c)
    beside, rate_beside = choose([GOOD] + [None] * 15, [100] + [0] * 15, 8, c)
    assert beside[1:] == [0] * 15 and rate_beside < rate_alone  # the 15 finished rows are still in the forward


def test_the_choice_maximises_expected_tokens_per_second_over_every_width():
    c = _memory_bound()
    for b in (1, 3, 8):
        ks, rate = choose([GOOD] * b, [100] * b, 8, c)
        plain = b / c.verify(b, 1)
        for w in range(9):
            t = w * c.draft(b) + c.verify(b, w + 1)
            r = b * (1 + sum(GOOD[:w])) / t
            assert r <= rate * (1 + 1e-9) or r < (MIN_GAIN if b < 2 else MIN_GAIN_ROWS) * plain


def test_a_draft_expected_to_gain_less_than_min_gain_over_a_plain_step_is_not_run():
    """What a round costs beside its draft steps and verify (the draft's catch-up, the round's bookkeeping) is not in
    the model, so a width must expect MIN_GAIN times a plain step's tokens/s: at 4 rows the flagship's model said
    1.16x for width 1 and the served default ran 0.88x baseline."""
    c = Costs({1: 0.0}, {1: [0.010, 0.015]})  # a 2-token verify costs 1.5 plain steps; drafting is free
    assert (1 + 0.7) / 0.015 < MIN_GAIN * 100 < (1 + 0.9) / 0.015
    assert choose([[0.7]], [100], 1, c)[0] == [0]  # 1.13x expected: plain
    assert choose([[0.9]], [100], 1, c)[0] == [1]  # 1.27x: drafts


def test_a_rows_running_acceptance_takes_over_from_the_prior_and_never_rises_with_position():
    prior = [0.8, 0.6, 0.4]
    assert row_rates(prior, [], [], 3) == pytest.approx(prior)
    r = row_rates(prior, [0, 0, 0], [40, 40, 40], 3)  # its own 40 rounds rejected the first draft each time
    assert r[0] < 0.1 and r == sorted(r, reverse=True)
    assert row_rates([0.2, 0.9], [], [], 2) == [0.2, 0.2]


def _flagship_like(k: int = 6) -> DraftPolicy:
    """One row: a draft step 0.29 of a target step, a verify of n tokens 1 + 0.05 (n - 1) steps, a prior near the
    flagship draft's (0.88 at the first position)."""
    costs = Costs({1: 0.29}, {1: [1.0 + 0.05 * n for n in range(k + 1)]})
    return DraftPolicy(costs, k, [0.88, 0.77, 0.67, 0.58, 0.5, 0.43])


def _rounds(pol: DraftPolicy, acc: list[int], prop: list[int], n: int, hit: bool) -> list[int]:
    """n rounds of one row; a round that drafts w tokens is all accepted (`hit`) or missed at the first position."""
    widths = []
    for _ in range(n):
        w = pol.lengths([(False, 1000, acc, prop)])[0]
        widths.append(w)
        for i in range(w):
            while len(prop) <= i:
                prop.append(0)
                acc.append(0)
            prop[i] += 1
            acc[i] += int(hit)
    return widths


def test_a_row_kept_plain_by_its_first_misses_drafts_again_later_and_takes_up_a_predictable_rest(monkeypatch):
    """A row's own counts fade while it steps plainly (IDLE_DECAY): after four first-position misses it probes again
    within twenty plain rounds, and a rest that the draft predicts is drafted long again. Without the fade it stays
    plain for good (its counts never move)."""
    from pipeline.runtime import loadpolicy

    pol = _flagship_like()
    acc, prop = [0], [4]  # its first four rounds missed at the first position
    widths = _rounds(pol, acc, prop, 20, hit=True)
    assert widths[0] == 0 and max(widths) >= 1
    assert max(_rounds(pol, acc, prop, 20, hit=True)) >= 4, "once its drafts land again it drafts long"
    monkeypatch.setattr(loadpolicy, "IDLE_DECAY", 1.0)
    assert _rounds(_flagship_like(), [0], [4], 60, hit=True) == [0] * 60


def test_a_row_whose_probes_keep_missing_steps_plainly_most_rounds():
    """The probe's cost where the draft never predicts the row: one draft (PROBE_WIDTH) in at most one round of
    eight, some 4% of a plain step's time at the flagship's costs."""
    from pipeline.runtime.loadpolicy import PROBE_WIDTH

    widths = _rounds(_flagship_like(), [0], [4], 200, hit=False)
    probes = [w for w in widths if w]
    assert 0 < len(probes) <= len(widths) / 8 and set(probes) == {PROBE_WIDTH}


def _costly_verify(k: int = 6) -> DraftPolicy:
    """One row on a 2-core Zen 3's stored costs (AVX2: a 2-token verify 1.30 one-token steps) and its prior."""
    costs = Costs({1: 0.0088}, {1: [0.0318, 0.0413, 0.0474, 0.0549, 0.0643, 0.0726, 0.0836]})
    return DraftPolicy(costs, k, [0.851, 0.761, 0.657, 0.619, 0.541, 0.533])


def test_where_one_draft_cannot_pay_a_plain_row_probes_with_the_narrowest_width_that_can_and_drafts_again():
    """One draft at the prior's rate expects less than MIN_GAIN on these costs, so a probe of PROBE_WIDTH could never
    be chosen: a row kept plain by its first misses stayed plain for good. It probes with two drafts instead, and once
    they land drafts long. Where one draft pays (the flagship-like costs) the probe stays PROBE_WIDTH."""
    from pipeline.runtime.loadpolicy import PROBE_WIDTH, probe_width

    pol = _costly_verify()
    one = (1 + pol.prior[0]) / (pol.costs.draft(1) + pol.costs.verify(1, 2)) * pol.costs.verify(1, 1)
    assert one < MIN_GAIN and pol.probe == 2
    assert _flagship_like().probe == PROBE_WIDTH == 1
    acc, prop = [0], [4]  # its first four rounds missed at the first position
    widths = _rounds(pol, acc, prop, 80, hit=True)
    assert widths[0] == 0 and 2 in widths
    assert max(_rounds(pol, acc, prop, 10, hit=True)) >= 4, "once its probes land it drafts long"
    stuck = DraftPolicy(pol.costs, 6, pol.prior, probe=PROBE_WIDTH)
    assert _rounds(stuck, [0], [4], 80, hit=True) == [0] * 80
    assert probe_width(pol.costs, [0.1] * 6, 6) == PROBE_WIDTH  # nothing pays: the policy is plain from its prior


def test_a_probe_that_pays_just_at_the_prior_is_widened_to_one_that_pays_by_probe_slack():
    """The same CPU's costs stored in a slow minute: one draft expects 1.22x at the prior, just over MIN_GAIN, which a
    row coming back from plain steps reaches only slowly (its rates return to the prior from below); two drafts pay by
    PROBE_SLACK. Where only the margin itself is reached, the narrowest width that reaches it."""
    from pipeline.runtime.loadpolicy import PROBE_SLACK, probe_width

    costs = Costs({1: 0.0122}, {1: [0.0434, 0.0535, 0.0598, 0.0724, 0.0730, 0.0823, 0.1007]})
    prior = [0.851, 0.761, 0.657, 0.619, 0.541, 0.533]
    one = (1 + prior[0]) / (costs.draft(1) + costs.verify(1, 2)) * costs.verify(1, 1)
    assert MIN_GAIN <= one < MIN_GAIN * PROBE_SLACK and probe_width(costs, prior, 6) == 2
    flat = Costs({1: 0.0122}, {1: [0.0434, 0.0535, 0.0800, 0.1000, 0.1200, 0.1400, 0.1600]})  # only one draft pays
    assert probe_width(flat, prior, 6) == 1


def _zen4_like(stops_early: bool) -> DraftPolicy:
    """A draft step 0.24 of a target step, a verify of n tokens 1 + 0.08 (n - 1) steps, the flagship's prior: four
    drafts expect 1.705x plain steps and six 1.699x."""
    costs = Costs({1: 0.24}, {1: [1.0 + 0.08 * n for n in range(8)]})
    return DraftPolicy(costs, 6, [0.851, 0.761, 0.657, 0.619, 0.541, 0.533], stops_early=stops_early)


def test_a_lone_row_whose_drafter_stops_on_its_confidence_takes_the_widest_width_near_the_best():
    """Within WIDER_WITHIN of the best width's expected rate the widest is taken, for one row whose drafter stops at
    its first doubted token (the model charges every width its full drafts); a drafter that always drafts the width,
    and a batch of two rows, keep the best width."""
    from pipeline.runtime.loadpolicy import WIDER_WITHIN

    rates = row_rates(_zen4_like(False).prior, [], [], 6)
    best, rate = choose([rates], [1000], 6, _zen4_like(False).costs)
    wide, wide_rate = choose([rates], [1000], 6, _zen4_like(False).costs, wider=WIDER_WITHIN)
    assert best == [4] and wide == [6] and (1 - WIDER_WITHIN) * rate <= wide_rate < rate
    assert _zen4_like(True).lengths([(False, 1000, [], [])]) == [6]
    assert _zen4_like(False).lengths([(False, 1000, [], [])]) == [4]
    assert _zen4_like(True).lengths([(False, 1000, [], [])] * 2) == _zen4_like(False).lengths(
        [(False, 1000, [], [])] * 2)
    plain = DraftPolicy(_costly_verify().costs, 6, [0.5] * 6, stops_early=True)  # nothing pays: still plain
    assert plain.lengths([(False, 1000, [], [])]) == [0]


def _zen3_fast() -> Costs:
    """One row's costs as pick-k stored them on a 2-core Zen 3 in its fast memory minutes (run zg3, seconds): the
    best width expects 1.19x plain steps at pick-k's acceptance, between MIN_GAIN_CONFIDENT and MIN_GAIN."""
    return Costs({1: 0.0088}, {1: [0.0294, 0.0376, 0.0474, 0.0543, 0.0612, 0.0679, 0.0778, 0.0865, 0.1137]})


ZEN3_PRIOR = [0.851, 0.761, 0.657, 0.619, 0.541, 0.533]


def test_a_lone_row_whose_drafter_stops_on_its_confidence_drafts_from_a_smaller_margin():
    """The model charges a width its full drafts, where a drafter that stops at its first doubted token drafts less
    when unsure: such a lone row drafts where the best width expects MIN_GAIN_CONFIDENT, a drafter that always drafts
    the width still needs MIN_GAIN, and from two rows MIN_GAIN_ROWS holds for both."""
    from pipeline.runtime.loadpolicy import MIN_GAIN_CONFIDENT

    c = _zen3_fast()
    rates = row_rates(ZEN3_PRIOR, [], [], 6)
    _, rate = choose([rates], [1000], 6, c, gain=1.0)
    assert MIN_GAIN_CONFIDENT * 1.05 < rate * c.verify(1, 1) < MIN_GAIN  # the case this margin is for
    sure, plain = DraftPolicy(c, 6, ZEN3_PRIOR, stops_early=True), DraftPolicy(c, 6, ZEN3_PRIOR)
    assert sure.lengths([(False, 1000, [], [])])[0] > 0 and plain.lengths([(False, 1000, [], [])]) == [0]
    assert plain_from(sure, 4) == 2 and plain_from(plain, 4) == 1
    assert sure.lengths([(False, 1000, [], [])] * 2) == [0, 0]
    never = DraftPolicy(c, 6, [0.3] * 6, stops_early=True)  # a draft that cannot pay even so
    assert never.lengths([(False, 1000, [], [])]) == [0] and plain_from(never, 4) == 1


def test_the_policy_knows_a_model_drafter_stops_on_confidence_from_the_spec(tmp_path):
    from pipeline.runtime.loadpolicy import policy_for

    stored = {"table": [{"accept_pos": 0.9}] * 4, "costs_s": {"c_draft": 0.001, "c_verify": [0.01] * 5}}
    b = _bundle(tmp_path, stored)
    assert not policy_for(b, "draft_target", 4).stops_early
    b = b.use(SpecDecodeConfig(max_draft_len=4, num_draft_tokens=4, draft_length="load", draft_confidence=0.7))
    assert policy_for(b, "draft_target", 4).stops_early and not policy_for(b, "prompt_lookup", 4).stops_early
    assert not policy_for(b, "draft_target", 4, confidence=0.0).stops_early  # a request that turns the stop off


def test_a_row_that_takes_every_draft_is_expected_to_go_deeper_than_the_prior():
    """The rates chain each position's rate given the ones before: a row accepting all its drafts of 4 is expected to
    take a 5th more often than the prior's average row, and drafts to k (blended position by position it kept to 4)."""
    prior = [0.88, 0.77, 0.67, 0.58, 0.5, 0.43]
    r = row_rates(prior, [10] * 4, [10] * 4, 6)
    assert r == sorted(r, reverse=True) and r[4] > prior[4] and r[5] > prior[5]
    assert row_rates(prior, [], [], 6) == pytest.approx(prior)
    assert _rounds(_flagship_like(), [], [], 10, hit=True)[-1] == 6


def test_one_row_costs_stand_for_a_batch_as_one_row_of_all_its_tokens():
    c = Costs.from_stored({"c_draft": 1, "costs_s": {"c_draft": 0.002, "c_verify": [0.01, 0.011, 0.012, 0.02]}})
    assert c.verify(1, 2) == pytest.approx(0.011)
    assert c.verify(2, 2) == pytest.approx(0.02)  # 2 rows x 2 tokens: the one-row cost of 4 tokens
    assert c.verify(4, 2) == pytest.approx(0.04)  # 8 tokens: beyond the curve, linear in the tokens
    assert Costs.from_stored({}) is None and policy_from({"num_draft_tokens": 4}, 4) is None


def test_costs_measured_by_rows_are_read_as_stored_and_interpolated_between_them():
    c = Costs.from_stored({"costs_by_rows": {"1": {"c_draft": 0.001, "c_verify": [0.01, 0.012]},
                                             "4": {"c_draft": 0.004, "c_verify": [0.04, 0.05]}}})
    assert c.verify(4, 2) == pytest.approx(0.05) and c.verify(2, 1) == pytest.approx(0.02)
    assert c.draft(8) == pytest.approx(0.008)


class Scripted:
    """A policy giving row b of round r the length (r + b) % (k + 1): every row of a batch at a different length,
    whole rounds at 0 (plain steps) among them."""

    def __init__(self, k: int):
        self.k, self.round, self.seen = k, 0, []

    def lengths(self, rows):
        ks = [(self.round + b) % (self.k + 1) for b in range(len(rows))]
        self.round += 1
        self.seen.append(ks)
        return ks


@pytest.mark.parametrize("method", ["draft_target", "prompt_lookup"])
def test_rows_drafting_different_lengths_each_round_give_the_baseline_answer(method):
    target = tiny(seed=0)
    reqs = [Request(p, n, end_ids=(1,)) for p, n in zip(prompts(4, 48, seed=5), (24, 9, 17, 30))]
    base = generate(target, reqs)
    pol = Scripted(3)
    if method == "draft_target":
        out = draft_target(target, tiny(base=target, noise=0.02, seed=7), reqs, 3, policy=pol)
    else:
        out = prompt_lookup(target, reqs, 3, policy=pol)
    assert [r.tokens for r in out] == [r.tokens for r in base]
    assert any(len(set(ks)) > 1 for ks in pol.seen)
    assert all(sum(r.proposed_per_position) >= 0 for r in out) and max(r.draft_proposed for r in out) > 0


def test_a_plain_round_chosen_by_the_policy_runs_no_draft_and_a_step_per_token():
    target = tiny(seed=0)
    never = DraftPolicy(_memory_bound(3), 3, [0.0, 0.0, 0.0])
    (r,) = draft_target(target, target, [Request(prompts(1, 48, seed=2)[0], 12)], 3, policy=never)
    (b,) = generate(target, [Request(prompts(1, 48, seed=2)[0], 12)])
    assert r.tokens == b.tokens and r.draft_proposed == 0 and r.steps == len(r.tokens)  # prefill + a step a token
    assert never.decisions == {0: len(r.tokens) - 1}


@pytest.mark.parametrize("method", ["draft_target", "prompt_lookup"])
def test_plain_rounds_give_greedy_and_sampled_rows_what_generate_gives_them_draw_for_draw(method):
    # A plain round takes the baseline's own step: a sampled row draws from its generator as generate's does, so
    # with the same seed the same tokens come out (a drafting round would draw differently, exact in distribution).
    target = tiny(seed=0)
    ps = prompts(3, 48, seed=9)
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=11), SamplingParams(temperature=1.2, top_k=20,
                                                                                          seed=3)]
    reqs = [Request(p, n, sp) for p, n, sp in zip(ps, (14, 20, 9), params)]
    never = DraftPolicy(_memory_bound(3), 3, [0.0, 0.0, 0.0])
    if method == "draft_target":
        out = draft_target(target, target, reqs, 3, policy=never)
    else:
        out = prompt_lookup(target, reqs, 3, policy=never)
    base = generate(target, reqs)
    assert [r.tokens for r in out] == [r.tokens for r in base]
    assert [len(r.tokens) for r in out] == [14, 20, 9] and sum(r.draft_proposed for r in out) == 0
    assert set(never.decisions) == {0}


def _bundle(tmp_path, speculation: dict | None, draft_length: str = "load") -> Bundle:
    target = tiny(seed=0)
    cfg = {"build_config": {"max_draft_len": 4, "max_input_len": 64, "max_seq_len": 256}}
    b = Bundle(target, None, cfg, draft=target, draft_config={"speculation": speculation} if speculation else None)
    return b.use(SpecDecodeConfig(max_draft_len=4, num_draft_tokens=4, draft_length=draft_length))


def test_decode_applies_the_stored_costs_unless_the_spec_fixes_the_draft_length(tmp_path):
    # Stored costs where a draft step costs as much as ten target steps: drafting never pays, so `load` runs plain
    # rounds; `fixed` drafts k every round as before. Same answer either way.
    stored = {"table": [{"accept_pos": 0.9}] * 4, "costs_s": {"c_draft": 0.1, "c_verify": [0.01] * 5}}
    reqs = [Request(p, 10) for p in prompts(2, 48, seed=4)]
    load = decode(_bundle(tmp_path, stored), "draft_target", reqs)
    fixed = decode(_bundle(tmp_path, stored, "fixed"), "draft_target", reqs)
    assert [r.tokens for r in load] == [r.tokens for r in fixed]
    assert sum(r.draft_proposed for r in load) == 0 and sum(r.draft_proposed for r in fixed) > 0
    unmeasured = decode(_bundle(tmp_path, None), "draft_target", reqs)  # no pick-k costs: the fixed k
    assert sum(r.draft_proposed for r in unmeasured) == sum(r.draft_proposed for r in fixed)


def test_a_batch_the_policy_would_only_step_plainly_runs_the_baseline_loop_in_process_as_served(tmp_path):
    # The stored costs say drafting never pays at any row count: `decode` runs generate's loop (as the scheduler gives
    # such rows to the continuous batch) and says so; a caller's own policy or k still gets the speculative loop.
    stored = {"table": [{"accept_pos": 0.9}] * 4, "costs_s": {"c_draft": 0.1, "c_verify": [0.01] * 5}}
    b = _bundle(tmp_path, stored)
    assert plain_rows(b, "draft_target", 2) == 1
    reqs = [Request(p, 10) for p in prompts(2, 48, seed=4)]
    base = generate(b.target, reqs)
    routed = decode(b, "draft_target", reqs)
    assert [r.tokens for r in routed] == [r.tokens for r in base] and all(r.speculation_off for r in routed)
    never = DraftPolicy(_memory_bound(4), 4, [0.0] * 4)
    for kw in ({"policy": never}, {"num_draft_tokens": 2}):
        own = decode(b, "draft_target", reqs, **kw)
        assert [r.tokens for r in own] == [r.tokens for r in base] and not any(r.speculation_off for r in own)
    assert never.decisions  # the speculative loop asked its policy every round


def test_draft_length_is_load_or_fixed_in_the_spec_and_the_config():
    s = specmod.parse({"name": "x", "speculation": {"draft_length": "fixed"}})
    assert s.speculation.draft_length == "fixed"
    assert specmod.parse({"name": "x"}).speculation.draft_length == "fixed"
    with pytest.raises(specmod.SpecError, match="speculation.draft_length"):
        specmod.parse({"name": "x", "speculation": {"draft_length": "sometimes"}})
    with pytest.raises(SpeculationError, match="speculation.draft_length: got 'often'"):
        SpecDecodeConfig(max_draft_len=4, draft_length="often")
    cfg = SpecDecodeConfig(max_draft_len=4, draft_length="fixed")
    assert SpecDecodeConfig.from_params(lambda k, d: cfg.to_params().get(k, d), 4).draft_length == "fixed"


def test_plain_from_is_the_fewest_rows_at_which_the_prior_drafts_nothing():
    c = _memory_bound()
    pol = DraftPolicy(c, 8, GOOD)
    at = plain_from(pol, 32)
    assert at is not None and max(choose([GOOD] * at, [1 << 30] * at, 8, c)[0]) == 0
    assert all(max(choose([GOOD] * b, [1 << 30] * b, 8, c)[0]) > 0 for b in range(1, at))
    assert plain_from(pol, at - 1) is None and plain_from(None, 16) is None


def test_from_two_rows_a_width_must_expect_min_gain_rows_over_a_plain_step():
    """The flagship's stored costs and pick-k's acceptance: the model expects 1.7x at 2 rows where closed-loop clients
    measured 0.82-0.97x, so from two rows a width must expect MIN_GAIN_ROWS; one row keeps MIN_GAIN."""
    c = Costs({1: 0.0, 2: 0.0}, {1: [0.010, 0.015], 2: [0.010, 0.015]})  # 2 tokens a row cost 1.5 plain steps
    rates = [[0.9]]
    assert MIN_GAIN * 100 < (1 + 0.9) / 0.015 < MIN_GAIN_ROWS * 100  # 1.27x expected
    assert choose(rates, [100], 1, c)[0] == [1]  # one row: drafts
    assert choose(rates * 2, [100, 100], 1, c)[0] == [0, 0]  # two rows, the same gain: plain
    assert choose([[1.0]] * 2, [100, 100], 1, Costs({2: 0.0}, {2: [0.010, 0.010]}))[0] == [1, 1]  # 2x: drafts


def test_the_ceiling_is_the_best_width_with_no_margin_and_its_rate_over_a_plain_step():
    """`ceiling` reports what the cost model allows: the width `choose` would take with a gain of 1, and its expected
    tokens/s over a plain step's; it falls with the rows on a machine whose steps fill with them."""
    c = _memory_bound()
    pol = DraftPolicy(c, 8, GOOD)
    rates = row_rates(GOOD, [], [], 8)
    for b in (1, 2, 4, 16):
        w, x = ceiling(pol, b)
        ks, rate = choose([rates] * b, [1 << 30] * b, 8, c, gain=1.0)
        assert w == max(ks) and x == pytest.approx(rate / (b / c.verify(b, 1)))
    assert ceiling(pol, 1)[1] > ceiling(pol, 4)[1] > 1.0 == ceiling(pol, 16)[1]
    assert ceiling(pol, 16)[0] == 0  # 16 rows fill the step: no width pays, the plain step is the ceiling


def test_the_ceiling_ignores_min_gain_rows_where_the_policy_keeps_to_plain_steps():
    c = Costs({1: 0.0, 2: 0.0}, {1: [0.010, 0.015], 2: [0.010, 0.015]})  # the case above: 1.27x expected at 2 rows
    pol = DraftPolicy(c, 1, [0.9])
    assert pol.lengths([(False, 100, [], []), (False, 100, [], [])]) == [0, 0]
    w, x = ceiling(pol, 2)
    assert w == 1 and x == pytest.approx((1 + 0.9) / 1.5)
    assert ceiling(None, 2) is None


# The small spec's Medusa tree as its build timed it (2-core Zen 4, 2026-12-06): 2 candidates, 3 tokens a verify.
SMALL_TREE = {"expected_accept_len": 1.283, "verify_cost_ms": [4.24, 4.41, 4.48, 4.9, 5.9, 7.06, 7.83], "heads_ms": 0.3}


def test_a_medusa_trees_expected_gain_is_its_builds_at_one_row_and_the_curve_read_as_rows_beyond():
    assert tree_gain(SMALL_TREE, 3, 1) == pytest.approx(1.283 * 4.24 / (4.48 + 0.3))  # the build's 1.137x
    assert tree_gain(SMALL_TREE, 3, 2) == pytest.approx(1.283 * 4.41 / (7.06 + 0.3))  # 2 rows of 3: one row of 6
    assert tree_gain(SMALL_TREE, 3, 4) == pytest.approx(1.283 * 4.9 / (7.83 * 12 / 7 + 0.3))  # past the curve
    assert tree_plain_from(SMALL_TREE, 3, 8) == 1  # 1.14x is under MIN_GAIN: plain from one row
    better = {**SMALL_TREE, "expected_accept_len": 2.0}  # 1.77x at one row, 1.20x at two (under MIN_GAIN_ROWS)
    assert tree_gain(better, 3, 1) >= MIN_GAIN and tree_gain(better, 3, 2) < MIN_GAIN_ROWS
    assert tree_plain_from(better, 3, 8) == 2 and tree_plain_from(better, 3, 1) is None
    # a spec's own choices: the build timed nothing, so nothing is judged
    assert tree_gain({}, 3, 1) is None and tree_plain_from(None, 3, 8) is None


def _medusa_bundle(tmp_path, tree: dict | None, draft_length: str = "load") -> Bundle:
    from pipeline.runtime.medusa import make_engine
    from tests.test_medusa import random_heads

    b = _bundle(tmp_path, None, draft_length)
    b.medusa = make_engine(random_heads(b.target), [[0], [1]], config={"medusa": {"tree": tree} if tree else {}})
    return b


def test_medusa_steps_plainly_where_its_build_expects_its_tree_not_to_pay(tmp_path):
    """The small spec's Medusa read 0.84x baseline served and 0.55x at 8-32 clients (its heads' first guess right
    one time in five): with `draft_length: load` a batch at rows where the tree the build timed is not expected to
    pay by the policy's margins decodes plainly (its results say `speculation_off`), with the same answer."""
    reqs = [Request(p, 10) for p in prompts(2, 48, seed=4)]
    base = generate(tiny(seed=0), reqs)
    low = _medusa_bundle(tmp_path, SMALL_TREE)
    high = _medusa_bundle(tmp_path, {**SMALL_TREE, "expected_accept_len": 2.0})
    assert plain_rows(low, "medusa", 8) == 1 and plain_rows(high, "medusa", 8) == 2
    (one,) = decode(low, "medusa", reqs[:1])
    assert one.speculation_off and one.tokens == base[0].tokens and one.draft_proposed == 0
    (tree,) = decode(high, "medusa", reqs[:1])
    assert not tree.speculation_off and tree.tokens == base[0].tokens and tree.draft_proposed > 0
    both = decode(high, "medusa", reqs)
    assert all(r.speculation_off for r in both) and [r.tokens for r in both] == [r.tokens for r in base]
    fixed = decode(_medusa_bundle(tmp_path, SMALL_TREE, "fixed"), "medusa", reqs[:1])[0]
    assert not fixed.speculation_off and fixed.draft_proposed > 0
    unmeasured = _medusa_bundle(tmp_path, None)  # a spec's own choices: nothing to judge by, the tree runs
    assert plain_rows(unmeasured, "medusa", 8) is None and not decode(unmeasured, "medusa", reqs[:1])[0].speculation_off


def test_a_lone_hybrid_row_drafts_from_the_suffix_alone_where_the_draft_model_cannot_pay(tmp_path, monkeypatch):
    """The small spec's hybrid under `draft_length: load`: its draft model cannot pay even at one row, and the
    scheduler had sent its requests to plain steps whole, so a predicted edit ran at 0.4-0.5x the suffix's speed.
    A lone row takes no policy in hybrid (the suffix's odds rule it), so it stays speculative (`plain_rows` counts
    from 2 rows), drafts its prediction, and never runs the draft model."""
    from pipeline.runtime import speculative

    stored = {"table": [{"accept_pos": 0.9}] * 4, "costs_s": {"c_draft": 0.1, "c_verify": [0.01] * 5}}
    b = _bundle(tmp_path, stored)
    assert plain_rows(b, "hybrid", 8) == 2 and plain_rows(b, "suffix", 8) == 3  # suffix: free drafts, generic prior
    assert plain_rows(b, "draft_target", 8) == 1  # its lone row takes the policy: plain from one row
    runs = []
    real = speculative._ModelDrafter._catch_up
    monkeypatch.setattr(speculative._ModelDrafter, "_catch_up", lambda self, *a: runs.append(1) or real(self, *a))
    p = prompts(1, 48, seed=5)[0]
    (base,) = generate(b.target, [Request(p, 16)])
    one = Request(p, 16, prediction=list(base.tokens[:8]))  # the answer's first half predicted, then nothing
    (r,) = decode(b, "hybrid", [one])
    assert r.tokens == base.tokens and r.draft_accepted >= 6 and not runs  # the prediction's drafts, no model
    (fixed,) = decode(_bundle(tmp_path, stored, "fixed"), "hybrid", [Request(p, 16)])
    assert fixed.tokens == base.tokens and runs  # with k every round the model drafts where nothing matches

"""pick-k: the one verify-cost timer, expected tokens per step and the k table, on known answers."""

from __future__ import annotations

import pytest

from pipeline.speedpick import (
    expected_tokens,
    expected_tokens_iid,
    measure_acceptance,
    measure_costs,
    speed_table,
    verify_costs,
)
from tests.test_speculative import tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("tree", [False, True])
def test_verify_costs_cover_every_size_and_never_fall(tree):
    costs = verify_costs(tiny(seed=0), 6, context=32, reps=2, tree=tree)
    assert len(costs) == 6 and min(costs) > 0
    assert costs == sorted(costs)


def test_verify_costs_hand_over_each_timed_round_and_keep_the_best_of_them():
    rounds: list[list[float]] = []
    costs = verify_costs(tiny(seed=0), 5, context=32, reps=3, rounds=rounds)
    assert len(rounds) == 3 and all(len(r) == 5 and min(r) > 0 for r in rounds)  # the warm-up round is not kept
    best = [min(r[n] for r in rounds) for n in range(5)]
    assert costs == [max(best[: n + 1]) for n in range(5)]


def test_draft_steps_are_timed_between_the_verify_rounds():
    target, draft = tiny(seed=0), tiny(seed=1)
    calls = []
    for name, m in (("target", target), ("draft", draft)):
        fwd = m.forward
        m.forward = lambda *a, _f=fwd, _n=name, **k: calls.append(_n) or _f(*a, **k)
    costs = measure_costs(target, draft, max_k=2, context=16, reps=3)
    assert costs["c_draft"] > 0 and len(costs["c_verify"]) == 3
    timed = calls[calls.index("target"):]  # after the draft's prefill and warm-up, and the target's prefill
    runs = [n for i, n in enumerate(timed) if i == 0 or timed[i - 1] != n]
    # target prefill + warm-up round, then a draft step after it (untimed) and after every timed round
    assert runs.count("draft") == 4 and runs[-1] == "draft" and runs.count("target") == 4, runs


def test_costs_by_rows_time_every_batch_size_in_the_same_rounds_in_turn():
    """The memory's speed switches within minutes here, so the row counts are timed together (each round every size
    in turn, the order rotating) rather than one after another: each cell keeps its minimum over the same minutes."""
    from pipeline.speedpick import measure_costs_by_rows

    target, draft = tiny(seed=0), tiny(seed=1)
    order: list[int] = []
    by = measure_costs_by_rows(target, draft, max_k=2, rows=(1, 2, 4), context=16, reps=3, order=order)
    assert order == [1, 2, 4, 2, 4, 1, 4, 1, 2, 1, 2, 4]  # a warm-up round, then three timed, each starting later
    assert list(by) == ["1", "2", "4"]
    for c in by.values():
        cv = c["c_verify"]
        assert len(cv) == 3 and c["c_draft"] > 0 and 0 < cv[0] and cv == sorted(cv)  # more tokens never cost less


def test_expected_tokens_per_step():
    assert expected_tokens([0.8, 0.5, 0.2], 2) == pytest.approx(2.3)
    assert expected_tokens_iid(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens_iid(1.0, 3) == 4.0


def test_speed_table_known_answers():
    costs = {"c_draft": 0.001, "c_verify": [0.010, 0.011, 0.012, 0.020]}
    rows = speed_table(costs, [0.8, 0.5, 0.2])
    assert [r["k"] for r in rows] == [1, 2, 3]
    # k=2: (1 + 0.8 + 0.5) tokens in 2 draft steps + a 3-token verify = 0.014 s, against 1 token in 0.010 s
    assert rows[1]["speedup"] == pytest.approx(2.3 * 0.010 / 0.014, abs=1e-3)
    assert rows[2]["speedup"] == pytest.approx(2.5 * 0.010 / 0.023, abs=1e-3)
    assert max(rows, key=lambda r: r["speedup"])["k"] == 2


def test_measured_acceptance_of_a_perfect_and_a_random_draft():
    t = tiny(seed=0)
    prompts = [[5, 6, 7], [9, 3, 4, 2]]
    assert measure_acceptance(t, t, prompts, 3, max_new=16) == [1.0, 1.0, 1.0]
    rates = measure_acceptance(t, tiny(layers=1, seed=3), prompts, 3, max_new=16)
    assert rates == sorted(rates, reverse=True) and rates[0] < 0.5


def test_costs_retimed_keep_the_acceptance_and_k_and_recompute_the_table_from_the_new_timings():
    from pipeline.speedpick import measure_and_pick, remeasure_costs

    target, draft = tiny(seed=0), tiny(seed=1)
    ps = [[3, 5, 7, 9, 11, 13], [4, 6, 8, 10, 12, 14]]
    stored = measure_and_pick(target, draft, ps, 3, log=lambda *_: None, fixed=2)
    again = remeasure_costs(target, draft, stored, log=lambda *_: None)
    assert again["num_draft_tokens"] == 2 and again["chosen_by"] == "spec"
    assert [r["accept_pos"] for r in again["table"]] == [r["accept_pos"] for r in stored["table"]]
    assert again["table"] == speed_table(again["costs_s"], [r["accept_pos"] for r in stored["table"]])
    assert again["expected_speedup"] == again["table"][1]["speedup"]
    assert sorted(again["costs_by_rows"]) == ["1", "2", "4", "8"] and again["costs_by_rows"]["1"] is again["costs_s"]
    assert all(min(c["c_verify"]) > 0 and c["c_draft"] > 0 for c in again["costs_by_rows"].values())
    with pytest.raises(ValueError, match="pick-k SPEC --write"):
        remeasure_costs(target, draft, {"num_draft_tokens": 2}, log=lambda *_: None)

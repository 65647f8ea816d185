"""load's request mix (pipeline.load._Mix): what request i of a run sends is a pure function of i, so a soak with
the same settings sends the same requests; the served load runs themselves are in test_reliability.py."""

from __future__ import annotations

from pipeline.load import _Mix, finished_before_cancel


def test_the_soak_mix_cycles_methods_then_temperatures_and_spaces_cancels_drops_and_unary_requests():
    mix = _Mix(("baseline", "prompt_lookup"), (0.0, 0.7), sample_every=4, cancel_every=10, disconnect_every=15,
               unary_every=2, decoupled=True)
    reqs = [mix.request(i) for i in range(30)]
    assert [r.method for r in reqs[:4]] == ["baseline", "prompt_lookup"] * 2
    assert [r.temperature for r in reqs[:6]] == [0.0, 0.0, 0.7, 0.7, 0.0, 0.0], "each temperature for every method"
    assert reqs[0].opts == {} and reqs[2].opts == {"temperature": 0.7, "seed": 2}
    assert [i for i, r in enumerate(reqs) if r.drop] == [14, 29]
    assert [i for i, r in enumerate(reqs) if r.cancel] == [9, 19], "request 29 drops its connection instead"
    assert [i for i, r in enumerate(reqs) if r.unary] == [i for i in range(1, 30, 2) if i not in (9, 19, 29)]


def test_without_temperatures_every_nth_request_samples_and_a_unary_server_gets_only_whole_requests():
    mix = _Mix(("baseline",), (), sample_every=4, cancel_every=2, disconnect_every=3, unary_every=0,
               decoupled=False)
    reqs = [mix.request(i) for i in range(8)]
    assert [i for i, r in enumerate(reqs) if r.temperature > 0] == [3, 7]
    assert reqs[3].opts == {"temperature": 0.8, "top_p": 0.95, "seed": 3} and reqs[2].opts == {}
    assert all(r.unary and not r.cancel and not r.drop for r in reqs), "nothing to cancel without a stream"


def test_a_request_finished_before_its_cancel_came_is_told_from_one_that_ended_as_its_client_went():
    """Finished first: the server decoded the whole budget (448 tokens) that no client saw; ended early: a few."""
    assert finished_before_cancel(missed=2, unseen_tokens=2 * 448, long_budget=448) == 2
    assert finished_before_cancel(missed=2, unseen_tokens=448 + 5, long_budget=448) == 1, "one whole, one early"
    assert finished_before_cancel(missed=1, unseen_tokens=5, long_budget=448) == 0
    assert finished_before_cancel(missed=1, unseen_tokens=3 * 448, long_budget=448) == 1, "never more than missed"
    assert finished_before_cancel(missed=0, unseen_tokens=-12, long_budget=448) == 0

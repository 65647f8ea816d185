"""bench's admission run (pipeline/admission.py): running streams keep stepping while a long prompt is prefilled in
chunks beside them, and stop for it when it is prefilled whole."""

from __future__ import annotations

import pytest

from pipeline.admission import admission_lines, streams_while_admitting
from tests.test_speculative import tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def test_streams_step_between_the_chunks_of_an_admitted_prompt():
    t = tiny(seed=0, vocab=200)
    whole = streams_while_admitting(t, 0, streams=2, prompt_tokens=160, warm=4, after=4)
    chunked = streams_while_admitting(t, 16, streams=2, prompt_tokens=160, warm=4, after=4)
    # chunks of 16: at least one step of both streams per chunk while the prompt is pending; whole: none
    assert chunked["gaps"] >= whole["gaps"] + 2 * (160 // 16 - 1)
    for r in (whole, chunked):
        assert r["median_ms"] <= r["p99_ms"] <= r["max_ms"]
        assert r["p99_over_median"] == pytest.approx(r["p99_ms"] / r["median_ms"])
    line = admission_lines(chunked)[-1]
    assert "160-token prompt" in line and "prefill_chunk 16" in line
    assert admission_lines({}) == []


def test_steal_time_is_read_from_proc_stat_and_never_goes_back():
    import sys

    from pipeline.figures import steal_ms

    a = steal_ms()
    if not sys.platform.startswith("linux"):
        assert a is None
        return
    b = steal_ms()
    assert a is not None and 0 <= a <= b


def test_gaps_of_steps_that_lost_time_to_the_hypervisor_are_set_apart(monkeypatch):
    """The hypervisor cannot be made to steal on demand, so /proc/stat's reading is replaced by a clock that loses
    5 ms during every third step: those steps' gaps leave the calm figures, the total is reported, and the line says
    both; with no steal at all there are no calm figures (the headline is already them)."""
    import pipeline.admission as adm

    calls = [0]

    def fake() -> float:
        calls[0] += 1
        step = (calls[0] + 1) // 2  # two readings a step: before and after
        return 5.0 * (step // 3 if calls[0] % 2 == 0 else (step - 1) // 3)

    t = tiny(seed=0, vocab=200)
    monkeypatch.setattr(adm.figures, "steal_ms", fake)
    r = adm.streams_while_admitting(t, 16, streams=2, prompt_tokens=96, warm=6, after=6)
    steps = calls[0] // 2
    assert r["steps_with_steal"] == steps // 3 and r["steal_ms"] == 5.0 * (steps // 3)
    assert 0 < r["calm_gaps"] < r["gaps"]
    assert r["calm_median_ms"] <= r["calm_p99_ms"]
    assert "hypervisor took" in adm.admission_lines(r)[-1]
    monkeypatch.setattr(adm.figures, "steal_ms", lambda: 0.0)
    quiet = adm.streams_while_admitting(t, 16, streams=2, prompt_tokens=96, warm=6, after=6)
    assert quiet["steps_with_steal"] == 0 and "calm_gaps" not in quiet
    assert "hypervisor" not in adm.admission_lines(quiet)[-1]

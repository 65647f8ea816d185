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

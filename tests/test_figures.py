"""The report figures from per-prompt runs, on inputs whose answers are worked out by hand."""

import pytest

from pipeline.figures import Run, mean_accepted_len, pct, summarize


def test_summarize_known_answers():
    base = [Run(10.0, [1, 2], 16, 16), Run(20.0, [3], 16, 16), Run(40.0, [4], 16, 16)]
    # per-prompt speedups 3.0, 0.5, 1.25: median 1.25
    runs = [Run(30.0, [1, 2], 16, 4, 12, 12), Run(10.0, [9], 16, 8, 12, 8), Run(50.0, [4], 16, 16, 12, 0)]
    s = summarize(runs, base)
    assert s["tokens_per_s"] == 30.0
    assert s["speedup"] == 1.25
    assert s["acceptance_rate"] == pytest.approx(20 / 36)
    assert s["mean_accepted_len"] == pytest.approx(48 / 28)
    assert (s["greedy_identical"], s["greedy_total"]) == (2, 3)
    assert (s["total_draft_tokens"], s["total_accepted_draft_tokens"], s["num_output_tokens"]) == (36, 20, 48)
    assert s["per_prompt_tokens_per_s"] == [30.0, 10.0, 50.0]


def test_speedup_is_the_median_of_per_prompt_ratios_not_a_ratio_of_medians():
    base = [Run(10.0, 0, 1, 1), Run(100.0, 0, 1, 1), Run(30.0, 0, 1, 1)]
    runs = [Run(40.0, 0, 1, 1), Run(45.0, 0, 1, 1), Run(33.0, 0, 1, 1)]  # ratios 4.0, 0.45, 1.1
    s = summarize(runs, base)
    assert s["speedup"] == pytest.approx(1.1)
    assert s["tokens_per_s"] / summarize(base, base)["tokens_per_s"] == pytest.approx(40 / 30)
    assert summarize(base, base)["speedup"] == 1.0


def test_baseline_and_empty_cases():
    base = [Run(12.0, "a", 8, 8)]
    s = summarize(base, base)
    assert (s["acceptance_rate"], s["mean_accepted_len"], s["speedup"]) == (0.0, 1.0, 1.0)
    assert mean_accepted_len(0, 0) == 0.0 and mean_accepted_len(10, 4) == 2.5
    with pytest.raises(ValueError, match="same prompts"):
        summarize(base, base + base)


def test_latency_percentiles_are_nearest_rank_and_zero_for_none():
    """One percentile for validate, the OpenAI validation and the peer's curve (they had three copies)."""
    xs = [float(x) for x in range(10, 0, -1)]
    assert (pct(xs, 0.5), pct(xs, 0.95), pct(xs, 0.99), pct(xs, 0.0)) == (5.0, 10.0, 10.0, 1.0)
    assert pct([], 0.5) == 0.0 and pct([3.0], 0.99) == 3.0

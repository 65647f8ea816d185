"""Issue 51's targets read off validate's concurrency curve (pipeline/curve_targets.py), each level with the load
policy's ceiling from the draft engine's stored costs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import curve_targets as ct
from pipeline.runtime import loadpolicy


def _point(c: int, method: str, tps: float, itl=(30.0, 60.0)) -> dict:
    return {"concurrency": c, "method": method, "tokens_per_s": tps, "itl_ms_p50": itl[0], "itl_ms_p99": itl[1]}


CURVE = [_point(1, "baseline", 30.0), _point(1, "hybrid", 57.0), _point(2, "baseline", 45.0),
         _point(2, "hybrid", 44.0), _point(4, "baseline", 55.0), _point(4, "hybrid", 66.0, (35.0, 140.0)),
         _point(4, "llama-server", 20.0)]


def test_the_targets_set_each_levels_default_over_baseline_and_the_two_figures_at_four_clients():
    s = ct.summarize(CURVE, "hybrid", {"4": 3.3}, None)
    one, two, four = (s["over_baseline"][c] for c in ("1", "2", "4"))
    assert one["measured"] == pytest.approx(57 / 30) and one["target"] == 1.8 and one["met"] is True
    assert two["measured"] == pytest.approx(44 / 45) and two["target"] == 1.4 and two["met"] is False
    assert four["measured"] == pytest.approx(1.2) and four["met"] is True  # 66 / 55 = 1.2: at the target is met
    assert s["at_least_baseline_every_level"] is False  # 2 clients read below baseline
    assert s["over_llama_server"] == {"concurrency": 4, "measured": 3.3, "target": 2.5, "met": True}
    assert s["itl_p99_over_p50"]["measured"] == pytest.approx(4.0) and s["itl_p99_over_p50"]["met"] is False


def test_each_level_says_how_far_apart_baselines_two_bursts_were():
    """Where baseline ran twice a level (validate.curve_order) the spread of its bursts over their pooled figure is
    that level's noise, shown beside a default-over-baseline figure that both methods' plain steps put near 1."""
    curve = [{**_point(4, "baseline", 56.1), "bursts_tokens_per_s": [57.4, 54.8]}, _point(4, "hybrid", 56.0)]
    s = ct.summarize(curve, "hybrid", None, None)
    e = s["over_baseline"]["4"]
    assert e["baseline_spread"] == pytest.approx(2.6 / 56.1) and e["met"] is False
    assert s["at_least_baseline_every_level"] is False  # strict: the spread is shown, never applied
    assert "4: 1.00x (target >= 1.2; baseline's two bursts 5% apart: not met)" in " ".join(ct.markdown(s))
    assert "baseline_spread" not in ct.summarize(CURVE, "hybrid", None, None)["over_baseline"]["4"]


def test_a_figure_the_run_lacks_is_neither_met_nor_missed():
    s = ct.summarize([_point(1, "baseline", 30.0), _point(1, "hybrid", 40.0)], "hybrid", None, None)
    assert set(s["over_baseline"]) == {"1"} and s["at_least_baseline_every_level"] is True
    assert s["over_llama_server"]["met"] is None and s["itl_p99_over_p50"]["met"] is None
    md = " ".join(ct.markdown(s))
    assert "over llama-server -np 4: n/a (target >= 2.5: n/a)" in md and "ceiling" not in md


def test_a_level_between_two_named_ones_takes_the_lower_ones_target():
    assert [ct.over_baseline_target(c) for c in (1, 2, 3, 4, 6, 8, 16, 32)] == [1.8, 1.4, 1.4, 1.2, 1.2, 1.0, 1.0,
                                                                              1.0]


def _draft_config(tmp_path, k: int = 4) -> Path:
    by = {r: {"c_draft": 0.002 * (1 + r / 8), "c_verify": [0.02 * max(1.0, r * n / 4) for n in range(1, 10)]}
          for r in (1, 2, 4, 8)}
    table = [{"k": i + 1, "accept_pos": 0.9 ** (i + 1)} for i in range(8)]
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"speculation": {"num_draft_tokens": k, "costs_by_rows": by, "table": table}}))
    return p


def test_the_ceiling_comes_from_the_draft_engines_stored_costs_and_k_for_a_model_drafting_default(tmp_path):
    p = _draft_config(tmp_path)
    got = ct.ceilings(p, "hybrid", [1, 2, 8])
    pol = loadpolicy.policy_from(json.loads(p.read_text())["speculation"], 4)
    for c in (1, 2, 8):
        w, x = loadpolicy.ceiling(pol, c)
        assert got[str(c)] == {"width": w, "over_plain": round(x, 3)}
    assert got["1"]["width"] > 0 and got["1"]["over_plain"] > got["8"]["over_plain"] == 1.0
    assert ct.ceilings(p, "suffix", [1]) is None  # no draft model in its rounds: the model says nothing of it
    assert ct.ceilings(tmp_path / "missing.json", "hybrid", [1]) is None
    md = " ".join(ct.markdown(ct.summarize(CURVE, "hybrid", None, got)))
    assert f"1: 1.90x (target >= 1.8; the ceiling here {got['1']['over_plain']:.2f}x at width {got['1']['width']}" in md
    assert "The ceiling is what the draft model's rounds can gain" in md

"""Issue 51's done-when figures read off validate's concurrency curve, each beside what this machine allows.

The curve (validate.batch_curve) measures the served default method, baseline and llama-server -np N at each level.
This module sets those figures against the issue's targets and against the load policy's ceiling at the same number
of rows (`loadpolicy.ceiling`: the best expected gain over a plain step from pick-k's stored costs and acceptance,
before any round's overhead), so a level that falls short says whether another policy could reach it or only a
cheaper many-row verification (the kernels) could.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.runtime import loadpolicy

# The default method's aggregate tokens/s over baseline's by concurrency (a level between two: the lower one's).
OVER_BASELINE = {1: 1.8, 2: 1.4, 4: 1.2, 8: 1.0, 16: 1.0}
OVER_LLAMA_AT = (4, 2.5)  # at 4 clients, over llama-server -np 4 from the same run
ITL_SPREAD_AT = (4, 3.0)  # at 4 clients, the default's p99 inter-token latency over its p50


def over_baseline_target(c: int) -> float:
    return OVER_BASELINE[max(k for k in OVER_BASELINE if k <= max(1, c))]


def ceilings(draft_config: Path, default: str, levels: list[int]) -> dict[str, dict] | None:
    """Per level (str), {width, over_plain}: `loadpolicy.ceiling` from the draft engine's stored costs and k, for a
    default method whose rounds run the draft model (None otherwise, or without stored costs)."""
    if default not in loadpolicy.MODEL_DRAFTERS or not draft_config.is_file():
        return None
    sp = json.loads(draft_config.read_text()).get("speculation") or {}
    pol = loadpolicy.policy_from(sp, int(sp.get("num_draft_tokens") or 0))
    out = {}
    for c in levels:
        got = loadpolicy.ceiling(pol, c)
        if got is None:
            return None
        out[str(c)] = {"width": got[0], "over_plain": round(got[1], 3)}
    return out


def _met(x: float | None, target: float, above: bool = True) -> bool | None:
    return None if x is None else (x >= target if above else x <= target)


def summarize(curve: list[dict], default: str, vs_llama: dict[str, float] | None,
              ceiling: dict[str, dict] | None) -> dict:
    """The targets against the curve's figures: per level the default over baseline (with the ceiling there), the
    default at least baseline at every level, and the two figures at 4 clients."""
    by = {(e["concurrency"], e["method"]): e for e in curve}
    levels = sorted({c for c, m in by if m == default and (c, "baseline") in by})
    per = {}
    for c in levels:
        d, b = by[(c, default)].get("tokens_per_s"), by[(c, "baseline")].get("tokens_per_s")
        x = d / b if d and b else None
        t = over_baseline_target(c)
        per[str(c)] = {"measured": x, "target": t, "met": _met(x, t), "ceiling": (ceiling or {}).get(str(c))}
        bursts = by[(c, "baseline")].get("bursts_tokens_per_s")
        if bursts and len(bursts) > 1 and b:  # the level's own noise: baseline's bursts apart, over their pool
            per[str(c)]["baseline_spread"] = (max(bursts) - min(bursts)) / b
    xs = [e["measured"] for e in per.values()]
    out = {"default_method": default, "over_baseline": per,
           "at_least_baseline_every_level": None if None in xs or not xs else all(x >= 1.0 for x in xs)}
    c4, t4 = OVER_LLAMA_AT
    x = (vs_llama or {}).get(str(c4))
    out["over_llama_server"] = {"concurrency": c4, "measured": x, "target": t4, "met": _met(x, t4)}
    c4, t4 = ITL_SPREAD_AT
    e = by.get((c4, default)) or {}
    x = e["itl_ms_p99"] / e["itl_ms_p50"] if e.get("itl_ms_p50") else None
    out["itl_p99_over_p50"] = {"concurrency": c4, "measured": x, "target": t4, "met": _met(x, t4, above=False)}
    return out


def _state(met: bool | None) -> str:
    return "met" if met else "not met" if met is False else "n/a"


def markdown(s: dict) -> list[str]:
    """validate.md's lines for the targets (after the curve's table)."""
    cells = []
    for c, e in s["over_baseline"].items():
        x = "n/a" if e["measured"] is None else f"{e['measured']:.2f}x"
        ceil = e.get("ceiling")
        room = (f"; the ceiling here {ceil['over_plain']:.2f}x" + (f" at width {ceil['width']}" if ceil["width"]
                                                                  else ", plain steps")) if ceil else ""
        spread = f"; baseline's two bursts {e['baseline_spread']:.0%} apart" if e.get("baseline_spread") else ""
        cells.append(f"{c}: {x} (target >= {e['target']}{room}{spread}: {_state(e['met'])})")
    ll, itl = s["over_llama_server"], s["itl_p99_over_p50"]
    lines = [f"Issue 51's targets (default method {s['default_method']}): over baseline at "
             + "; ".join(cells) + f"; at least baseline at every level: {_state(s['at_least_baseline_every_level'])}"
             f"; over llama-server -np {ll['concurrency']}: "
             + ("n/a" if ll["measured"] is None else f"{ll['measured']:.2f}x") + f" (target >= {ll['target']}: "
             f"{_state(ll['met'])}); p99 / p50 inter-token latency at {itl['concurrency']} clients: "
             + ("n/a" if itl["measured"] is None else f"{itl['measured']:.2f}") + f" (target <= {itl['target']}: "
             f"{_state(itl['met'])})."]
    if any(e.get("ceiling") for e in s["over_baseline"].values()):
        lines += ["", "The ceiling is what the draft model's rounds can gain over plain steps at that many rows by "
                  "the load policy's cost model (pick-k's draft and verify costs stored for this machine and its "
                  "acceptance, no margin, before any round's overhead: `loadpolicy.ceiling`); a suffix draft adds to "
                  "it only where the text repeats. A target above it needs cheaper many-row verification on this "
                  "CPU, not another policy."]
    return lines

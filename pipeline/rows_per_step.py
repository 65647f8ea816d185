"""A model's forward at several token rows per step (issue 51 item 2: several users' drafts verified in one step, a
prefill's rows), each against its two limits on this machine: the weights read once at the measured memory
bandwidth, and the rows' multiply-adds at the kernel build's measured int8 peak. Bench's precision table shows it
per weight precision (`rows_per_step_lines`)."""
from __future__ import annotations

import time

import torch

ROWS = (1, 4, 8, 16, 32)


@torch.inference_mode()
def step_ms(model, rows: tuple[int, ...] = ROWS, context: int = 64, reps: int = 3) -> dict[str, float]:
    """Best ms of one forward plus logits over S new tokens after `context` (S in `rows`), sizes interleaved round
    by round (after a warm-up round) so load from other processes hits every size alike."""
    cache = model.new_cache(1, context + max(rows) + 1)
    model(torch.zeros(1, context, dtype=torch.long), torch.arange(context)[None], cache)
    best = {s: float("inf") for s in rows}
    for r in range(reps + 1):
        for s in rows:
            tok = torch.zeros(1, s, dtype=torch.long)
            t = time.perf_counter()
            model.logits(model(tok, context + torch.arange(s)[None], cache))
            if r:
                best[s] = min(best[s], time.perf_counter() - t)
    return {str(s): 1000 * best[s] for s in rows}


def limits(ms: dict[str, float], bytes_per_token: float, macs_per_token: float, bandwidth_gbs: float,
           int8_macs_per_s: float | None) -> dict[str, dict]:
    """Per S: `bandwidth_ms` (the weights read once), `int8_ms` (S tokens' multiply-adds at the int8 peak; None
    without one), `limit` (which of the two is larger) and `of_limit` (the larger over the measured time)."""
    out = {}
    for s, m in ms.items():
        bw = 1000 * bytes_per_token / (bandwidth_gbs * 1e9)
        i8 = 1000 * int(s) * macs_per_token / int8_macs_per_s if int8_macs_per_s else None
        floor = max(bw, i8 or 0.0)
        out[s] = {"ms": m, "bandwidth_ms": bw, "int8_ms": i8, "limit": "int8" if i8 and i8 > bw else "bandwidth",
                  "of_limit": floor / m}
    return out


def rows_per_step_lines(t: dict) -> list[str]:
    """bench.md's table: each precision's step time at 1..32 token rows and the share of its limit it reaches."""
    rows = [(p, e) for p, e in t.items() if isinstance(e, dict) and e.get("rows_per_step")]
    if not rows:
        return []
    sizes = list(rows[0][1]["rows_per_step"])
    peak = t.get("int8_macs_per_s")
    lines = ["", f"Token rows per step (one forward plus logits after a 64-token context; limit: the weights read "
             f"once at {t.get('bandwidth_gbs', 0):.1f} GB/s or the rows' multiply-adds at the int8 peak"
             + (f" {peak / 1e9:.0f} G/s" if peak else ", not measured") + ", whichever is larger; b bandwidth, "
             "i int8):", "",
             "| precision | " + " | ".join(f"{s} rows: ms (of limit)" for s in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    for p, e in rows:
        cells = [f"{c['ms']:.1f} ({100 * c['of_limit']:.0f}% {c['limit'][0]})" for c in e["rows_per_step"].values()]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return lines

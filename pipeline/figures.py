"""The figures bench and validate report, computed one way for both from per-prompt runs.

Definitions (DESIGN.md): acceptance rate = accepted draft tokens / proposed draft tokens; mean accepted
length = tokens emitted per target forward pass (accepted drafts + the target's own token); speedup = the
median over prompts of (method tokens/s / baseline tokens/s on the same prompt, in the same run), so a
slow moment of the machine hits both sides of each ratio. The per-prompt tokens/s go into the report too,
so every figure can be recomputed from it.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass


def median(xs: list[float]) -> float:
    """The median, 0 for no values (a method that ran no prompts)."""
    return statistics.median(xs) if xs else 0.0


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs by the nearest rank (0.0 for none): every latency percentile validate, validate_api and
    the peer's curve report."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def steal_ms() -> float | None:
    """Time the hypervisor has taken from this machine's cores (all of them, ms since boot; /proc/stat's steal
    column), or None where there is no such figure (not Linux, or a kernel without it)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return 1e3 * int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def steal_since(start: float | None) -> float | None:
    """Steal time since a `steal_ms()` reading (ms), or None where there is no such figure."""
    now = steal_ms()
    return None if start is None or now is None else now - start


def mean_accepted_len(tokens: int, forwards: int) -> float:
    """Tokens emitted per target forward pass (0 when nothing ran)."""
    return tokens / forwards if forwards > 0 else 0.0


@dataclass
class Run:
    """One prompt decoded by one method: what the figures need of it.

    `output` is what greedy exactness compares (token ids in-process, the text through gRPC); `forwards` the
    target forward passes it took (in-process `Result.steps`; through gRPC, output tokens minus accepted drafts,
    since every forward emits its accepted drafts plus one token of its own)."""

    tokens_per_s: float
    output: object
    num_output_tokens: int
    forwards: int
    proposed: int = 0
    accepted: int = 0


def summarize(runs: list[Run], base: list[Run]) -> dict:
    """A method's figures over prompts, against the baseline's runs on the same prompts (same order)."""
    if len(runs) != len(base):
        raise ValueError(f"{len(runs)} runs against {len(base)} baseline runs; both must cover the same prompts")
    tps = [r.tokens_per_s for r in runs]
    proposed, accepted = sum(r.proposed for r in runs), sum(r.accepted for r in runs)
    out = sum(r.num_output_tokens for r in runs)
    return {
        "tokens_per_s": median(tps),
        "speedup": median([a / b.tokens_per_s for a, b in zip(tps, base, strict=True) if b.tokens_per_s > 0]),
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_accepted_len": mean_accepted_len(out, sum(r.forwards for r in runs)),
        "greedy_identical": sum(r.output == b.output for r, b in zip(runs, base, strict=True)),
        "greedy_total": len(runs),
        "total_draft_tokens": proposed,
        "total_accepted_draft_tokens": accepted,
        "num_output_tokens": out,
        "per_prompt_tokens_per_s": tps,
    }


def curve_point(raws: list[dict]) -> dict:
    """One concurrency-curve point (validate's and the peer's) from one or more bursts of the same system and level,
    each {tokens, wall_s, latency_ms, ttft_ms, itl_ms, steal_ms}: aggregate tokens/s over their wall
    time, latency p50, time to first token and inter-token latency p50/p99 over every request and gap of them all;
    `bursts_tokens_per_s` each burst's own tokens/s where there were several."""
    stolen = [r["steal_ms"] for r in raws]
    out = {"tokens_per_s": sum(r["tokens"] for r in raws) / sum(r["wall_s"] for r in raws),
           "latency_ms_p50": pct([x for r in raws for x in r["latency_ms"]], 0.5)}
    ttft, itl = [x for r in raws for x in r["ttft_ms"]], [x for r in raws for x in r["itl_ms"]]
    out.update({"ttft_ms_p50": pct(ttft, 0.5), "ttft_ms_p99": pct(ttft, 0.99),
                "itl_ms_p50": pct(itl, 0.5), "itl_ms_p99": pct(itl, 0.99),
                "steal_ms": None if any(s is None for s in stolen) else sum(stolen)})
    if len(raws) > 1:
        out["bursts_tokens_per_s"] = [r["tokens"] / r["wall_s"] for r in raws]
    return out

"""Running streams while a long prompt is admitted (issue 48): their gaps between tokens when the prompt is prefilled
in chunks of `kv_cache.prefill_chunk` tokens between their steps (pipeline/runtime/batcher.py), or whole (chunk 0).

In process, on the target as the server runs plain rows: `streams` short requests decode; after `warm` of their steps
a prompt of `prompt_tokens` tokens is admitted, and they go on `after` steps once it has its first token. The figures
are the streams' gaps over their whole run (median, p99, the largest), the median before the admission, and the long
prompt's time to its first token. bench runs it at 4,096 tokens with the spec's chunk;
experiments/chunked_prefill.py tries several chunks.

On a VM the hypervisor takes a core away now and then (steal time, /proc/stat): on the 2-core Zen 4 VM of 2026-12-05
every gap past 1.6x the median in a 4k admission was a step that lost about 100 ms of one core that way. So the run
also reports the steal it saw and the gaps of the steps that saw none, so a reader can tell the scheduler's tail
from the machine's."""

from __future__ import annotations

import statistics
import time

import torch

from pipeline import figures
from pipeline.runtime.batcher import ContinuousBatch
from pipeline.runtime.generate import Request


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]


@torch.inference_mode()
def streams_while_admitting(target, chunk: int, streams: int = 2, prompt_tokens: int = 4096, warm: int = 24,
                            after: int = 32, vocab: int | None = None) -> dict:
    """The streams' gaps (ms) while a `prompt_tokens` prompt is admitted beside them with `prefill_chunk` = chunk."""
    vocab = min(vocab or target.cfg.vocab_size, 150_000)
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(100, vocab, (n,), generator=g).tolist()

    pool = ContinuousBatch(target, streams + 1, prefill_chunk=chunk)
    last: dict = {}
    gaps: dict = {"before": [], "window": []}
    phase = ["before"]
    first: dict = {}
    calm: list[float] = []  # gaps closed by steps that saw no steal
    pending: list[float] = []  # gaps closed by the step now running
    steal = {"ms": 0.0, "steps": 0}

    def emit(tag, _toks) -> None:
        now = time.perf_counter()
        if tag == "long":
            first.setdefault("t", now)
            return
        if tag in last:
            gaps[phase[0]].append(now - last[tag])
            pending.append(now - last[tag])
        last[tag] = now

    def step() -> None:
        s0 = figures.steal_ms()
        pool.step(emit)
        took = figures.steal_since(s0) or 0.0
        steal["ms"] += took
        steal["steps"] += took > 0
        if not took:
            calm.extend(pending)
        pending.clear()

    pool.admit([Request(ids(32), 100_000, end_ids=()) for _ in range(streams)], list(range(streams)), emit)
    pending.clear()
    for _ in range(warm):
        step()
    phase[0] = "window"
    t0 = time.perf_counter()
    pool.admit([Request(ids(prompt_tokens), 4, end_ids=())], ["long"], emit)  # whole (chunk 0) or pending
    pending.clear()  # (the gap across the admission itself belongs to no step)
    while "t" not in first:
        step()
    ttft = first["t"] - t0
    for _ in range(after):
        step()
    every, before = gaps["before"] + gaps["window"], gaps["before"]
    med = 1e3 * statistics.median(every)
    out = {"chunk": chunk, "streams": streams, "prompt_tokens": prompt_tokens, "ttft_s": ttft, "median_ms": med,
           "p99_ms": 1e3 * _p99(every), "p99_over_median": 1e3 * _p99(every) / med, "max_ms": 1e3 * max(every),
           "before_median_ms": 1e3 * statistics.median(before), "gaps": len(every),
           "steal_ms": steal["ms"] if figures.steal_ms() is not None else None, "steps_with_steal": steal["steps"]}
    if calm and steal["steps"]:
        cm = 1e3 * statistics.median(calm)
        out |= {"calm_gaps": len(calm), "calm_median_ms": cm, "calm_p99_ms": 1e3 * _p99(calm),
                "calm_p99_over_median": 1e3 * _p99(calm) / cm}
    return out


def admission_lines(r: dict) -> list[str]:
    """bench.md's paragraph on the admission run (empty when it did not run)."""
    if not r or "p99_ms" not in r:
        return []
    return ["", f"While a {r['prompt_tokens']}-token prompt is admitted beside {r['streams']} running streams "
            f"(kv_cache.prefill_chunk {r['chunk']}), the streams' gaps between tokens: median {r['median_ms']:.0f} ms, "
            f"p99 {r['p99_ms']:.0f} ms ({r['p99_over_median']:.2f}x the median), largest {r['max_ms']:.0f} ms; "
            f"{r['before_median_ms']:.0f} ms before it came; its first token after {r['ttft_s']:.1f} s." + _calm(r)]


def _calm(r: dict) -> str:
    """The sentence on steal time, where some step saw it."""
    if not r.get("calm_gaps"):
        return ""
    return (f" The hypervisor took {r['steal_ms']:.0f} ms of the cores in {r['steps_with_steal']} of the steps (steal "
            f"time); the gaps of the other steps: median {r['calm_median_ms']:.0f} ms, p99 {r['calm_p99_ms']:.0f} ms "
            f"({r['calm_p99_over_median']:.2f}x).")

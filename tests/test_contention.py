"""The busy process beside a decoder is real, runs while measured and is always killed; the figures are its ratios."""

from __future__ import annotations

import time

import psutil
import pytest

from pipeline import contention
from pipeline.bench import contention_lines


def test_the_busy_process_burns_a_core_while_the_block_runs_and_is_killed_after_it():
    with contention.busy_process() as proc:
        p = psutil.Process(proc.pid)
        t0 = p.cpu_times().user
        time.sleep(0.5)
        assert p.cpu_times().user - t0 > 0.05  # it is CPU-bound, not sleeping
    assert proc.poll() is not None


def test_the_busy_process_is_killed_when_the_measurement_fails():
    with pytest.raises(RuntimeError):
        with contention.busy_process() as proc:
            raise RuntimeError("a decode failed")
    assert proc.poll() is not None


def test_quiet_and_busy_rounds_alternate_and_the_slowdown_is_their_medians_ratio():
    seen = []

    def run() -> float:
        busy = any(p.cmdline()[-1:] == [contention.BUSY_LOOP] for p in psutil.Process().children())
        seen.append(busy)
        return 4.0 if busy else 10.0

    r = contention.measure(run, rounds=2)
    assert seen == [False, True, False, True]
    assert (r["quiet_tokens_per_s"], r["busy_tokens_per_s"], r["slowdown"]) == (10.0, 4.0, 2.5)


def test_bench_md_shows_each_decoders_slowdown_and_the_notes():
    c = {"new_tokens": 64, "cores": 2,
         "ours": {"baseline": {"quiet_tokens_per_s": 8.0, "busy_tokens_per_s": 5.0, "slowdown": 1.6}},
         "llama_cpp_server": {"note": "llama-server not built"}}
    text = "\n".join(contention_lines(c))
    assert "| ours, baseline | 8.0 | 5.0 | 1.60x |" in text and "llama-server: llama-server not built" in text
    assert contention_lines({}) == []

"""The step lock the served models take turns on (pipeline/triton/gate.py), between real processes.

Each worker process takes `steps` steps under the gate, each a few milliseconds of busy work, and
records when it held the lock. The records must never overlap (mutual exclusion), and while both
workers have work neither takes more than four steps in a row (fairness; two at most on a quiet
machine). A plain flock (`fair=False`) gives runs of 20 to 60 here: the process that releases the
lock takes it straight back.
"""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from pipeline.triton.gate import StepGate


def _worker(directory: str, name: str, steps: int, step_s: float, start, out, pause_every: int = 0,
            fair: bool = True) -> None:
    gate = StepGate(directory, name, fair=fair)
    start.wait(60)  # a barrier: every worker has its want file before any takes a step
    spans = []
    if pause_every:  # one long job holding the gate, pausing between its "rounds"
        with gate:
            for i in range(steps):
                t0 = time.monotonic()
                while time.monotonic() - t0 < step_s:
                    pass
                spans.append((t0, time.monotonic()))
                if (i + 1) % pause_every == 0:
                    gate.pause()
    else:
        for _ in range(steps):
            with gate:
                t0 = time.monotonic()
                while time.monotonic() - t0 < step_s:
                    pass
                spans.append((t0, time.monotonic()))
    out.put((name, spans, gate.handoffs))
    gate.close()


def _run(tmp_path, specs: list[tuple[str, int, float, int]], fair: bool = True) -> dict:
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(len(specs)), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), n, steps, dt, start, out, pause, fair))
             for n, steps, dt, pause in specs]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        name, spans, handoffs = out.get(timeout=60)
        got[name] = (spans, handoffs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return got


def _timeline(got: dict) -> list[tuple[float, float, str]]:
    return sorted((a, b, n) for n, (spans, _) in got.items() for a, b in spans)


def _longest_run_while_both_busy(got: dict) -> int:
    line = _timeline(got)
    both_until = min(spans[-1][1] for spans, _ in got.values())
    both_from = max(spans[0][0] for spans, _ in got.values())
    owners = [n for a, _, n in line if both_from <= a <= both_until]
    longest = run = 0
    for i, n in enumerate(owners):
        run = run + 1 if i and owners[i - 1] == n else 1
        longest = max(longest, run)
    return longest


def test_two_processes_never_hold_the_gate_at_once_and_alternate(tmp_path):
    got = _run(tmp_path, [("a", 40, 0.004, 0), ("b", 40, 0.004, 0)])
    line = _timeline(got)
    for (_, a1, na), (b0, _, nb) in zip(line, line[1:]):
        assert a1 <= b0, f"{na} and {nb} held the gate at once"
    assert _longest_run_while_both_busy(got) <= 4  # a plain flock: runs of 20 to 60 (starvation)
    assert got["a"][1] + got["b"][1] > 20, "the lock changed hands through the hand-over"


def test_a_long_job_that_pauses_between_rounds_lets_the_other_process_in(tmp_path):
    got = _run(tmp_path, [("long", 60, 0.004, 1), ("short", 20, 0.004, 0)])
    line = _timeline(got)
    for (_, a1, _), (b0, _, _) in zip(line, line[1:]):
        assert a1 <= b0
    short_end = got["short"][0][-1][1]
    long_end = got["long"][0][-1][1]
    assert short_end < long_end, "the short process finished while the long job still ran (it was let in)"
    assert _longest_run_while_both_busy(got) <= 4  # a plain flock: runs of 20 to 60 (starvation)


def test_alone_the_gate_never_waits_for_anyone(tmp_path):
    """With no process waiting (another model's gate open but idle, a stale want file of one that left), a
    release never hands over and never waits. Its hand-over wait is set to an hour, so a release that waited
    would block, not merely be slow: the steps run on a thread that must end (no speed is asserted)."""
    idle = StepGate(tmp_path, "idle")
    (tmp_path / ".want-gone.lock").touch()
    gate = StepGate(tmp_path, "solo", handoff_s=3600.0)
    seen = []

    def steps() -> None:
        for _ in range(1000):
            with gate:
                seen.append(gate.waiting())

    t = threading.Thread(target=steps, daemon=True)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), f"a release blocked after {len(seen)} steps with nobody waiting"
    assert seen == [[]] * 1000
    assert gate.handoffs == 0 and gate.acquisitions == 1000 and not gate.held
    gate.close()
    idle.close()


def _hold_forever(directory: str, ready) -> None:
    gate = StepGate(directory, "holder")
    gate.acquire()
    ready.set()
    time.sleep(600)


def test_a_process_that_dies_holding_the_gate_releases_it(tmp_path):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_hold_forever, args=(str(tmp_path), ready))
    p.start()
    try:
        assert ready.wait(30)
        gate = StepGate(tmp_path, "next")
        os.kill(p.pid, signal.SIGKILL)
        p.join(timeout=30)
        # the dead holder's flock went with it: the step lock is free now, not after some timeout
        probe = os.open(tmp_path / ".step.lock", os.O_RDWR)
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError while anyone holds it
            fcntl.flock(probe, fcntl.LOCK_UN)
        finally:
            os.close(probe)
        gate.acquire()
        assert gate.held
        gate.close()
    finally:
        if p.is_alive():
            p.kill()


@pytest.mark.parametrize("name", ["tensorrt_llm_bls_0_0", "ensemble_0_0"])
def test_want_files_are_per_process_name(tmp_path, name):
    gate = StepGate(tmp_path, name)
    assert (tmp_path / f".want-{name}.lock").is_file() and (tmp_path / ".step.lock").is_file()
    gate.close()

"""The step lock the served models take turns on (pipeline/triton/gate.py), between real processes.

Each worker process takes steps under the gate, each a few milliseconds of busy work, and records when
it held the lock and whether the other process was waiting for it (its want file held) as the step
ended. The records must never overlap (mutual exclusion), and every step that ended with the other
process waiting must be followed by a step of the other process (fairness: the hand-over). Nothing
depends on how fast the machine is: the workers start in a fixed order (the second waits until the
first holds the lock, the first holds it until the second waits), and their gates wait an hour for a
hand-over, so a hand-over never times out on a loaded machine. A plain flock (`fair=False`) lets the
process that releases the lock take it straight back while the other waits (runs of 20 to 60 steps),
which the fairness check fails.
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

HANDOFF_S = 3600.0  # a hand-over that waited this long would be a hang (the test timeout), not a slow machine
LONG_JOB_CAP = 5000  # steps (20 s of busy work): a long job that never lets the other in ends here and fails


def _step(gate: StepGate, step_s: float, spans: list) -> None:
    """One step of busy work under the held gate, recorded as (start, end, the other process was waiting)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < step_s:
        pass
    spans.append((t0, time.monotonic(), bool(gate.waiting())))  # while held: a waiter stays waiting until handed


def _wait_for_waiter(gate: StepGate) -> None:
    deadline = time.monotonic() + 60
    while not gate.waiting():
        assert time.monotonic() < deadline, "the other process never asked for the gate"
        time.sleep(0.001)


def _worker(directory: str, name: str, role: str, steps: int, step_s: float, barrier, holds, done, out,
            fair: bool = True) -> None:
    """role "first": take the gate, hold the first step until the other waits, then `steps` steps.
    "second": start once the first holds the gate, `steps` steps, then set `done`.
    "long": one long job holding the gate, pausing between its steps until `done` (or LONG_JOB_CAP steps)."""
    gate = StepGate(directory, name, handoff_s=HANDOFF_S, fair=fair)
    barrier.wait(60)  # every worker has its want file before any takes a step
    spans: list = []
    if role == "second":
        assert holds.wait(60), "the first process never took the gate"
        for _ in range(steps):
            with gate:
                _step(gate, step_s, spans)
        done.set()
    if role == "first":
        with gate:
            holds.set()
            _wait_for_waiter(gate)
            _step(gate, step_s, spans)
        for _ in range(steps - 1):
            with gate:
                _step(gate, step_s, spans)
    held = None
    if role == "long":
        with gate:
            held = (time.monotonic(), None)
            holds.set()
            while not done.is_set() and len(spans) < LONG_JOB_CAP:
                _step(gate, step_s, spans)
                gate.pause()
            held = (held[0], time.monotonic())
    out.put((name, spans, gate.handoffs, held))
    gate.close()


def _run(tmp_path, specs: list[tuple[str, str, int]], step_s: float = 0.004, fair: bool = True) -> dict:
    ctx = mp.get_context("spawn")
    barrier, holds, done, out = ctx.Barrier(len(specs)), ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), n, role, steps, step_s, barrier, holds, done, out,
                                               fair)) for n, role, steps in specs]
    for p in procs:
        p.start()
    got, held = {}, {}
    for _ in procs:
        name, spans, handoffs, held[name] = out.get(timeout=120)
        got[name] = (spans, handoffs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    got["held"] = held
    return got


def _timeline(got: dict) -> list[tuple[float, float, bool, str]]:
    return sorted((a, b, waited, n) for n, (spans, _) in got.items() if n != "held" for a, b, waited in spans)


def _check_exclusive_and_handed_over(got: dict) -> int:
    """Mutual exclusion, and every step that ended with the other waiting is followed by the other's step.
    Returns how many steps ended with the other waiting."""
    line = _timeline(got)
    for (_, a1, _, na), (b0, _, _, nb) in zip(line, line[1:]):
        assert a1 <= b0, f"{na} and {nb} held the gate at once"
    handed = 0
    for i, ((_, _, waited, n), (_, _, _, nxt)) in enumerate(zip(line, line[1:])):
        if waited:
            handed += 1
            assert nxt != n, (f"{n} took the gate straight back while the other waited (step {i} of {len(line)}): "
                              "the hand-over failed")
    return handed


def test_two_processes_never_hold_the_gate_at_once_and_alternate(tmp_path):
    got = _run(tmp_path, [("a", "first", 40), ("b", "second", 40)])
    handed = _check_exclusive_and_handed_over(got)
    assert handed >= 1, "the first step ended with the other waiting (it was held until then)"
    assert got["a"][1] + got["b"][1] >= handed, "every release with a waiter is counted as a hand-over"


def test_a_long_job_that_pauses_between_rounds_lets_the_other_process_in(tmp_path):
    """The long job holds the gate from before the short process starts until the short process has done all
    its steps: every short step got in through the long job's pauses."""
    got = _run(tmp_path, [("long", "long", 0), ("short", "second", 20)])
    long_spans, short_spans = got["long"][0], got["short"][0]
    assert len(long_spans) < LONG_JOB_CAP, f"the long job took {LONG_JOB_CAP} steps and never let the short one finish"
    assert len(short_spans) == 20
    start, end = got["held"]["long"]
    assert start < short_spans[0][0] and short_spans[-1][1] < end, "the short process ran inside the long job"
    assert _check_exclusive_and_handed_over(got) >= 1
    assert got["long"][1] >= 1, "the short process got in by the long job's hand-overs"


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

"""The step lock: served models that decode in separate processes take turns at decoding steps.

`ensemble` and `tensorrt_llm_bls` are two instances of the same python model, each in its own
python-backend stub process with its own OpenMP team sized to the machine. Two teams running
kernels at once on a small CPU thrash (both steps slower than the two run back to back), so each
decoding step is taken under an exclusive `flock` on one file of the model repository
(`.step.lock`). No Triton import: tests drive it from plain processes.

Fairness: a process that wants the lock first holds its own `.want-<name>.lock` until it has the
step lock. A holder that ends a step (`release`, or `pause` between speculative rounds) and finds
another process's want file held (a non-blocking lock on it fails) gives the step lock up and waits,
at most `handoff_s`, until that process has taken it; so when both models have work they alternate
step by step and neither starves, and with one model busy the lock costs a few system calls a step.
A process that dies releases its locks with it (the kernel drops flocks with the file).
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

LOCK_NAME = ".step.lock"
WANT_PREFIX = ".want-"
SCAN_S = 1.0  # how often the holder looks for new want files (another model instance that started)


def _try(fd: int, how: int) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


class StepGate:
    """An exclusive, fair, cross-process lock on `directory/.step.lock`; `name` identifies this process."""

    def __init__(self, directory: str | Path, name: str, handoff_s: float = 0.25, fair: bool = True):
        self.dir = Path(directory)
        self.fair = fair  # False: a plain flock (for measuring what the hand-over buys)
        self.name = name
        self.handoff_s = handoff_s
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        self._lock = os.open(self.dir / LOCK_NAME, flags, 0o666)
        self._want_path = self.dir / f"{WANT_PREFIX}{name}.lock"
        self._want = os.open(self._want_path, flags, 0o666)
        self._others: dict[Path, int] = {}
        self._scanned = 0.0
        self.held = False
        self.acquisitions = 0
        self.handoffs = 0  # times this process gave the lock to a waiting one
        self.waited_s = 0.0  # time spent waiting for the lock

    def _scan(self) -> list[int]:
        now = time.monotonic()
        if not self._others or now - self._scanned >= SCAN_S:  # alone so far: look at every step (a glob)
            self._scanned = now
            for p in self.dir.glob(f"{WANT_PREFIX}*.lock"):
                if p != self._want_path and p not in self._others:
                    try:
                        self._others[p] = os.open(p, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
                    except OSError:
                        continue
        return list(self._others.values())

    def waiting(self) -> list[int]:
        """The want files of processes now waiting for the step lock (their want lock is held)."""
        out = []
        for fd in self._scan():
            if _try(fd, fcntl.LOCK_SH):
                fcntl.flock(fd, fcntl.LOCK_UN)
            else:
                out.append(fd)
        return out

    def acquire(self) -> None:
        if self.held:
            return
        t0 = time.monotonic()
        fcntl.flock(self._want, fcntl.LOCK_EX)  # "I am waiting", for the holder to see
        try:
            if not _try(self._lock, fcntl.LOCK_EX):
                fcntl.flock(self._lock, fcntl.LOCK_EX)  # blocks (GIL released) for at most the holder's step
        finally:
            fcntl.flock(self._want, fcntl.LOCK_UN)
        self.held = True
        self.acquisitions += 1
        self.waited_s += time.monotonic() - t0

    def release(self) -> None:
        """Give the lock up; if another process is waiting, wait (bounded) until it has taken it."""
        if not self.held:
            return
        waiting = self.waiting() if self.fair else []
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self.held = False
        if not waiting:
            return
        self.handoffs += 1
        until = time.monotonic() + self.handoff_s
        for fd in waiting:
            while time.monotonic() < until:
                if _try(fd, fcntl.LOCK_SH):  # it let go of its want file: it holds the step lock now
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    break
                time.sleep(0.0002)

    def pause(self) -> None:
        """Between steps of a long job: let a waiting process take its step, then take the lock back."""
        if self.held and self.fair and self.waiting():
            self.release()
            self.acquire()

    def __enter__(self) -> StepGate:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def close(self) -> None:
        self.release()
        for fd in [self._lock, self._want, *self._others.values()]:
            try:
                os.close(fd)
            except OSError:
                pass
        self._others = {}


class NoGate:
    """A gate that never waits (one process, or tests)."""

    held = False
    acquisitions = handoffs = 0
    waited_s = 0.0

    def acquire(self) -> None:
        pass

    def release(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def __enter__(self) -> NoGate:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def close(self) -> None:
        pass

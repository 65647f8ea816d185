"""Decoding on a busy machine: one other CPU-bound process beside the decoder, and what it costs.

A busy process is a Python busy loop started here and always killed (a `with` block). `measure` alternates quiet and
busy rounds of the same decode (quiet, busy, quiet, busy, ...) so that drift in the machine's other load hits both
alike, and reports the medians and their ratio (`slowdown`: quiet tokens/s over busy tokens/s).
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

BUSY_LOOP = "while True: pass"


@contextlib.contextmanager
def busy_process() -> Iterator[subprocess.Popen]:
    """One CPU-bound process (a Python busy loop) for the duration of the block; killed however the block ends."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.2)  # running before the first timed token
        yield proc
    finally:
        proc.kill()
        proc.wait()


def measure(run: Callable[[], float], rounds: int = 2) -> dict:
    """`run()` returns tokens/s of one decode; quiet and busy rounds alternate, `rounds` of each."""
    quiet, busy = [], []
    for _ in range(rounds):
        quiet.append(run())
        with busy_process():
            busy.append(run())
    q, b = statistics.median(quiet), statistics.median(busy)
    return {"quiet_tokens_per_s": q, "busy_tokens_per_s": b, "slowdown": q / b if b else None,
            "quiet_rounds": quiet, "busy_rounds": busy}

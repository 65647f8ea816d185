"""What the step lock (pipeline/triton/gate.py) buys: two processes decoding at once, with and without it.

The served `ensemble` and `tensorrt_llm_bls` are two processes, each with an OpenMP team sized to
the machine. This runs that situation outside Triton: two processes, each a continuous batch of
`--rows` plain rows of a random model of the given shape, `--steps` decode steps each, started
together; once with no lock (both teams run kernels at once), once with the fair gate (they take
turns), once with a plain flock (turns, but the releasing process may take the lock straight back).
It prints the wall time until both are done and each process's mean step time.

    python experiments/step_lock.py --hidden 1024 --layers 8 --rows 4 --steps 48 --threads 0
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _build(root: Path, hidden: int, layers: int) -> Path:
    from pipeline import spec as specmod
    from pipeline.engine import build_target
    from tests.conftest import make_model_dir, write_spec

    make_model_dir(root / "models" / "target", layers=layers, hidden=hidden, heads=hidden // 64,
                   kv_heads=max(1, hidden // 256))
    s = specmod.load(write_spec(root, name="gate"))
    build_target(s, log=lambda *a: None)
    return s.engine_dir


def _decode(engine_dir: str, lock_dir: str, mode: str, name: str, rows: int, steps: int, threads: int,
            start, out) -> None:
    from pipeline.runtime import kernels
    from pipeline.runtime.batcher import ContinuousBatch
    from pipeline.runtime.decode import load_bundle
    from pipeline.runtime.generate import Request
    from pipeline.triton.gate import NoGate, StepGate

    kernels.configure_threads(threads)
    b = load_bundle(Path(engine_dir), "cpu")
    gate = NoGate() if mode == "none" else StepGate(lock_dir, name, fair=mode == "fair")
    pool = ContinuousBatch(b.target, rows)
    reqs = [Request([1 + i, 5, 9, 13], steps + 4, end_ids=(0,)) for i in range(rows)]
    with gate:
        pool.admit(reqs, list(range(rows)))
        pool.step()  # warm
    start.wait(60)
    t0 = time.perf_counter()
    times = []
    for _ in range(steps):
        with gate:
            s0 = time.perf_counter()
            pool.step()
            times.append(time.perf_counter() - s0)
    out.put((name, time.perf_counter() - t0, sum(times) / len(times)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--threads", type=int, default=0, help="per process (0 = all cores, as served)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        engine = _build(Path(tmp), args.hidden, args.layers)
        report = {"args": vars(args), "modes": {}}
        for mode in ("none", "fair", "flock", "alone"):
            n = 1 if mode == "alone" else 2
            start, out = ctx.Barrier(n), ctx.Queue()
            procs = [ctx.Process(target=_decode, args=(str(engine), tmp, "none" if mode == "alone" else mode,
                                                       f"p{i}", args.rows, args.steps, args.threads, start, out))
                     for i in range(n)]
            for p in procs:
                p.start()
            got = [out.get(timeout=600) for _ in procs]
            for p in procs:
                p.join(timeout=60)
            wall = max(g[1] for g in got)
            report["modes"][mode] = {"wall_s": wall, "step_ms": [g[2] * 1000 for g in got],
                                     "per_process_wall_s": [g[1] for g in got]}
            print(f"{mode:>6}: both done in {wall:.2f}s; mean step "
                  + ", ".join(f"{g[0]} {g[2] * 1000:.1f} ms (done {g[1]:.2f}s)" for g in got), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

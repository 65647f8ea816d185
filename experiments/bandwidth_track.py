"""Does the one-token step follow the memory into its fast minutes? A bandwidth probe (bench's, 512 MB x 3) and 30
one-token steps of the spec's target at a 128-token context, alternating, each step set against the two probes around
it (issue 53: bench's roofline figure reads a whole request against probes between prompts).

    PYTHONPATH=. .venv/bin/python experiments/bandwidth_track.py build/qwen_coder.yaml [rounds]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from pipeline import spec as specmod
from pipeline.bench import measure_bandwidth_gbs, read_bytes
from pipeline.common import setup_threads
from pipeline.runtime.decode import load_bundle


def main(argv: list[str]) -> None:
    s = specmod.load(argv[0])
    rounds = int(argv[1]) if len(argv) > 1 else 14
    setup_threads(s)
    m = load_bundle(s.engine_dir, s.device, methods=("baseline",)).target
    wb = read_bytes(m)
    cache = m.new_cache(1, 256)
    with torch.inference_mode():
        m(torch.zeros(1, 128, dtype=torch.long), torch.arange(128)[None], cache)
        for _ in range(rounds):
            p0 = measure_bandwidth_gbs(512, 3)
            ts = []
            for i in range(30):
                t = time.perf_counter()
                m.logits(m(torch.zeros(1, 1, dtype=torch.long), torch.tensor([[128 + i]]), cache))
                ts.append(time.perf_counter() - t)
            p1 = measure_bandwidth_gbs(512, 3)
            step = statistics.median(ts)
            gbs = wb / step / 1e9
            print(f"probe {p0:5.1f} / {p1:5.1f} GB/s  step {step * 1e3:5.1f} ms = {gbs:5.1f} GB/s  "
                  f"fraction {gbs / ((p0 + p1) / 2):.2f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

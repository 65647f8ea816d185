"""A draft step as a fraction of a target step, both timed in the same rounds (the build's pick-k table
times them too, but a single number here is quicker to compare across two checkouts).

    PYTHONPATH=. .venv/bin/python experiments/draft_fraction.py build/qwen_coder.yaml [rounds]

Each round: 2 target steps, 8 draft steps, 2 target steps (one token after a 64-token prefill, head and
argmax included); the fraction is the median over rounds of median draft / median target.
"""

from __future__ import annotations

import statistics as st
import sys
import time

import torch

from pipeline import spec as specmod
from pipeline.common import setup_threads
from pipeline.runtime.decode import load_bundle


@torch.inference_mode()
def main(path: str, rounds: int) -> None:
    spec = specmod.load(path)
    setup_threads(spec)
    b = load_bundle(spec.engine_dir, spec.device, methods=("draft_target",))
    caches = {}
    for name, m in (("target", b.target), ("draft", b.draft)):
        caches[name] = m.new_cache(1, 72)
        m(torch.randint(0, 1000, (1, 64)), torch.arange(64)[None], caches[name])
    pos, tok = torch.tensor([[64]]), torch.tensor([[5]])

    def step(name: str) -> float:
        m = b.target if name == "target" else b.draft
        t = time.perf_counter()
        m.logits(m(tok, pos, caches[name])[:, 0]).argmax(-1)
        return time.perf_counter() - t

    for _ in range(3):
        step("target"), step("draft")
    tt, td, ratio = [], [], []
    for _ in range(rounds):
        a = [step("target") for _ in range(2)]
        d = [step("draft") for _ in range(8)]
        a += [step("target") for _ in range(2)]
        tt += a
        td += d
        ratio.append(st.median(d) / st.median(a))
    print(f"target {1e3 * st.median(tt):.1f} ms, draft {1e3 * st.median(td):.2f} ms, "
          f"draft step = {st.median(ratio):.4f} of a target step (median of {rounds} rounds)")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 15)

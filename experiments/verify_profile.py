"""Where an S-token forward of a built target goes: decoder layers, logits, and each matmul kind over all layers
(qkv, o, gate/up, down, on random activations, streamed from memory as in a step), S = 1, 2, 4, 6, 8. Best of
interleaved rounds, so a drift in the machine's memory bandwidth hits every S alike.

    PYTHONPATH=. .venv/bin/python experiments/verify_profile.py engines/qwen_coder/target [context] [rounds] [S,S,...]

Run it on a quiet machine: 8 tokens against 1 is bench.json's `verify_cost_ms` ratio, split by stage
(docs/gguf_weights.md has the Zen 4 table it printed). The last line is the floor under 8 tokens: their
multiply-adds at the kernel build's measured int8 peak (bench.json's `verify_floor`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from pipeline.bench import macs_per_token
from pipeline.runtime import kernels
from pipeline.runtime.engine_io import load_engine
from pipeline.runtime.model import wt

SIZES = [1, 2, 4, 6, 8]


def main(engine_dir: str, context: int = 128, rounds: int = 5, sizes: list[int] = SIZES) -> None:
    m = load_engine(Path(engine_dir)).model
    print(f"kernel path {kernels.path()}, {kernels.threads()} threads, context {context}")
    cfg = m.cfg
    kinds = {"qkv": ("wqkv", cfg.hidden_size), "o": ("wo", cfg.num_heads * cfg.head_dim),
             "gate/up": ("w13", cfg.hidden_size), "down": ("w2", cfg.intermediate_size)}
    cache = m.new_cache(1, context + max(sizes) + 1)
    best: dict[tuple[str, int], float] = {}

    def keep(key: tuple[str, int], seconds: float) -> None:
        best[key] = min(best.get(key, float("inf")), seconds)

    with torch.inference_mode():
        m(torch.zeros(1, context, dtype=torch.long), torch.arange(context)[None], cache)
        for r in range(rounds + 1):  # round 0 warms up and is not kept
            for S in sizes:
                tokens = torch.zeros(1, S, dtype=torch.long)
                t0 = time.perf_counter()
                h = m(tokens, context + torch.arange(S)[None], cache)
                t1 = time.perf_counter()
                m.logits(h)
                t2 = time.perf_counter()
                if r:
                    keep(("forward + logits", S), t2 - t0)
                    keep(("decoder layers", S), t1 - t0)
                    keep(("logits", S), t2 - t1)
                for name, (attr, K) in kinds.items():
                    x = torch.randn(S, K)
                    t0 = time.perf_counter()
                    for layer in m.layers:
                        kernels.linear(x, wt(getattr(layer, attr)))
                    if r:
                        keep((name, S), time.perf_counter() - t0)
    print(f"{'ms':18}" + "".join(f"{'S=' + str(S):>9}" for S in sizes) + f"    {max(sizes)} / 1")
    for name in ["forward + logits", "decoder layers", "logits", *kinds]:
        row = [best[(name, S)] * 1e3 for S in sizes]
        print(f"{name:18}" + "".join(f"{v:9.2f}" for v in row) + f"   {row[-1] / row[0]:6.2f}")
    # The floor no tile order beats: 8 tokens' multiply-adds at the build's int8 peak (bench.json's verify_floor).
    peak, macs = kernels.int8_peak(0.3), macs_per_token(cfg)
    floor = 1e3 * max(sizes) * macs / peak["macs_per_s"]
    one, top = best[("forward + logits", 1)] * 1e3, best[("forward + logits", max(sizes))] * 1e3
    print(f"int8 peak {peak['macs_per_s'] / 1e9:.0f} G multiply-adds/s ({peak['instruction']}); {max(sizes)} tokens x "
          f"{macs / 1e9:.2f} G take at least {floor:.1f} ms = {floor / one:.2f} x S=1; measured {top / one:.2f}, "
          f"{100 * floor / top:.0f}% of the peak")


if __name__ == "__main__":
    args = sys.argv[2:]
    main(sys.argv[1], *[int(a) for a in args[:2]], *([[int(s) for s in args[2].split(",")]] if len(args) > 2 else []))

"""The two parts of an S-token verification that `verify_profile.py` lumps together, at the rates the kernels reach:
each GGUF block type's matmuls over all layers (G multiply-adds a second, against the build's int8 peak), and the
attention kernel at S queries over a context (bf16 dot products: G multiply-adds a second, QK and PV together).

    PYTHONPATH=. .venv/bin/python experiments/verify_parts.py engines/qwen_coder/target [S,S,...] [ctx,ctx,...]

Best of a few calls each (random activations, weights streamed from memory as in a step); run it on a quiet machine.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import torch

from pipeline.runtime import kernels
from pipeline.runtime.engine_io import load_engine
from pipeline.runtime.gguf_weights import TYPE_NAMES
from pipeline.runtime.model import wt
from pipeline.speedpick import best_time


@torch.inference_mode()
def main(engine_dir: str, sizes: str = "1,8,32", contexts: str = "128,1024,2048") -> None:
    m = load_engine(Path(engine_dir)).model
    cfg = m.cfg
    peak = kernels.int8_peak(0.3)["macs_per_s"]
    print(f"kernel path {kernels.path()}, {kernels.threads()} threads, int8 peak {peak / 1e9:.0f} G multiply-adds/s")
    groups: dict[tuple[str, str], list] = defaultdict(list)
    for layer in m.layers:
        for attr in ("wqkv", "wo", "w13", "w2"):
            w = wt(getattr(layer, attr))
            types = "+".join(TYPE_NAMES.get(int(r[0]), str(int(r[0]))) for r in w.parts.tolist()) \
                if hasattr(w, "parts") else type(w).__name__
            groups[(attr, types)].append(w)
    for S in (int(s) for s in sizes.split(",")):
        for (attr, types), ws in groups.items():
            x = torch.randn(S, ws[0].in_features)
            t = best_time(lambda x=x, ws=ws: [kernels.linear(x, w) for w in ws], 4)
            macs = S * sum(w.in_features * w.out_features for w in ws)
            print(f"S={S:3d} {attr:5s} {types:15s} x{len(ws):2d} layers: {t * 1e3:7.2f} ms, "
                  f"{macs / t / 1e9:4.0f} G/s ({100 * macs / t / peak:.0f}% of the int8 peak)")
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    for ctx in (int(c) for c in contexts.split(",")):
        for S in (int(s) for s in sizes.split(",")):
            L = ctx + S
            q = torch.randn(1, S, hq, d)
            kc, vc = (torch.randn(1, hkv, L, d).to(kernels.KV_DTYPE) for _ in range(2))
            slots = (ctx + torch.arange(S))[None]
            t = best_time(lambda q=q, kc=kc, vc=vc, L=L, slots=slots: kernels.attention(q, kc, vc, None, L, slots), 20)
            macs = 2 * S * L * hq * d
            print(f"attention, context {ctx:5d}, S={S:3d}: {t * 1e3:.3f} ms a layer, {t * 1e3 * len(m.layers):6.1f} ms "
                  f"for {len(m.layers)} layers, {macs / t / 1e9:4.0f} G multiply-adds/s")


if __name__ == "__main__":
    main(*sys.argv[1:])

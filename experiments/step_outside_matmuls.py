"""Where a one-token decode step of a built engine goes outside its matmuls (issue 53, item 4): the whole step as
generate takes it (forward, logits, greedy pick) against the same step's matmuls alone (every layer's qkv, o, gate/up,
down and the head, on random activations of the step's shapes, in the same order), the rest being attention, norms,
RoPE, SwiGLU, the residual adds and Python. Interleaved rounds, the best round of each (a shared machine's
contention only adds time), so a drift in memory speed hits both alike.

    PYTHONPATH=. .venv/bin/python experiments/step_outside_matmuls.py engines/smollm2/target [rounds]

In process only: the served hop (scheduler, Triton, gRPC) is what validate's per-request timings add on top of this.
Quick (tens of seconds on the 1.5B); run it on a quiet machine.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from pipeline.runtime import kernels
from pipeline.runtime.engine_io import load_engine
from pipeline.runtime.model import wt


def weight_bytes(m) -> int:
    """Bytes the step's matmuls read: every linear layer's and the head's stored weights."""
    total = 0
    for blk in m.layers:
        for name in ("wqkv", "wo", "w13", "w2"):
            total += sum(b.numel() * b.element_size() for b in getattr(blk, name).buffers())
            total += sum(p.numel() * p.element_size() for p in getattr(blk, name).parameters())
    head = m.lm_head
    return total + sum(t.numel() * t.element_size() for t in [*head.buffers(), *head.parameters()])


def main(engine_dir: str, rounds: int = 30, context: int = 128) -> None:
    m = load_engine(Path(engine_dir)).model
    cfg = m.cfg
    print(f"kernel path {kernels.path()}, {kernels.threads()} threads, context {context}, "
          f"{weight_bytes(m) / 1e6:.1f} MB of matmul weights a token")
    cache = m.new_cache(1, context + rounds + 2)
    toks = torch.randint(0, cfg.vocab_size, (1, context))
    layers = [(wt(getattr(b, n)), k) for b in m.layers for n, k in
              (("wqkv", cfg.hidden_size), ("wo", cfg.num_heads * cfg.head_dim), ("w13", cfg.hidden_size),
               ("w2", cfg.intermediate_size))]
    xs = {k: torch.randn(1, k) for k in {k for _, k in layers}}
    h = torch.randn(1, 1, cfg.hidden_size)
    step_s, mm_s, head_s, pick_s = [], [], [], []
    with torch.inference_mode():
        m(toks, torch.arange(context)[None], cache)
        t = int(toks[0, -1])
        for i in range(rounds):
            t0 = time.perf_counter()
            hid = m(torch.tensor([[t]]), torch.tensor([[context + i]]), cache)
            logits = m.logits(hid)
            t1 = time.perf_counter()
            t = int(logits[0, -1].argmax())
            t2 = time.perf_counter()
            step_s.append(t2 - t0)
            pick_s.append(t2 - t1)
            t0 = time.perf_counter()
            for w, k in layers:
                kernels.linear(xs[k], w)
            t1 = time.perf_counter()
            m.logits(h)
            t2 = time.perf_counter()
            mm_s.append(t1 - t0)
            head_s.append(t2 - t1)
    best = lambda v: min(v) * 1e3  # noqa: E731
    step, mm, head, pick = best(step_s), best(mm_s), best(head_s), statistics.median(pick_s) * 1e3
    rest = step - mm - head - pick
    print(f"one-token step {step:.2f} ms: layer matmuls {mm:.2f}, head {head:.2f}, greedy pick {pick:.3f}, "
          f"outside the matmuls {rest:.2f} ({rest / step:.0%}: attention, norms, RoPE, SwiGLU, adds, Python)")
    print(f"matmul weights at {weight_bytes(m) / (mm + head) / 1e6:.1f} GB/s in the matmuls alone, "
          f"{weight_bytes(m) / step / 1e6:.1f} GB/s over the whole step")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))

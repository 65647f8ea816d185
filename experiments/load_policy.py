"""The load-adaptive draft length's decisions by batch size: on the tests' tiny pair (measured here) and, given a
draft engine, on its stored pick-k costs (no decoding).

    PYTHONPATH=. .venv/bin/python experiments/load_policy.py                       # tiny pair, costs measured here
    PYTHONPATH=. .venv/bin/python experiments/load_policy.py engines/qwen_coder    # the stored costs' choices

Tiny pair: a random 4-layer target (hidden 256) and a slightly noisy copy as draft; costs timed at 1/2/4/8 rows;
each batch size decodes 48 greedy tokens per row plainly, with k = 6 every round, and with the policy (answers
asserted identical); prints the widths chosen and tokens/s. Figures on a shared machine are rough.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from pipeline.runtime.generate import Request, generate
from pipeline.runtime.loadpolicy import Costs, DraftPolicy, choose, policy_from, row_rates
from pipeline.runtime.speculative import draft_target
from pipeline.speedpick import measure_acceptance, measure_costs_by_rows
from tests.test_speculative import prompts, tiny

K = 6


def stored(engine: Path) -> None:
    sp = json.loads((engine / "draft" / "config.json").read_text())["speculation"]
    pol = policy_from(sp, K)
    if pol is None:
        print("no stored costs (run pick-k --write)")
        return
    rates = row_rates(pol.prior, [], [], K)
    for b in (1, 2, 4, 8, 16):
        ks, rate = choose([rates] * b, [128] * b, K, pol.costs)
        plain = b / pol.costs.verify(b, 1)
        print(f"{b:>2} rows: width {max(ks)}, expected {rate:.1f} tokens/s against plain {plain:.1f} "
              f"({rate / plain:.2f}x)")


def measured() -> None:
    torch.set_num_threads(1)
    t = tiny(seed=0, hidden=256, layers=4, vocab=512)
    d = tiny(base=t, noise=0.003, seed=7)
    generate(t, [Request([3, 4, 5], 8)])
    # every batch size timed in the same rounds (speedpick.measure_costs_by_rows), keys back to ints
    by = {int(r): c for r, c in measure_costs_by_rows(t, d, K, (1, 2, 4, 8), context=64, reps=2).items()}
    costs = Costs({r: c["c_draft"] for r, c in by.items()}, {r: c["c_verify"] for r, c in by.items()})
    ps = prompts(16, 512, seed=1)
    rates = measure_acceptance(t, d, ps[:4], K, max_new=32)
    print("acceptance by position", [round(x, 2) for x in rates])
    for r, c in by.items():
        print(f"rows {r}: draft step {1e3 * c['c_draft']:.2f} ms, verify 1 / {K + 1} tokens "
              f"{1e3 * c['c_verify'][0]:.2f} / {1e3 * c['c_verify'][-1]:.2f} ms")
    for b in (1, 2, 4, 8):
        reqs = [Request(p, 48) for p in ps[:b]]
        t0 = time.perf_counter()
        base = generate(t, reqs)
        tb = time.perf_counter() - t0
        t0 = time.perf_counter()
        fixed = draft_target(t, d, reqs, K)
        tf = time.perf_counter() - t0
        pol = DraftPolicy(costs, K, rates)
        t0 = time.perf_counter()
        load = draft_target(t, d, reqs, K, policy=pol)
        tl = time.perf_counter() - t0
        assert [r.tokens for r in load] == [r.tokens for r in base] == [r.tokens for r in fixed]
        n = sum(len(r.tokens) for r in base)
        print(f"B={b}: widths chosen {dict(sorted(pol.decisions.items()))}; tokens/s baseline {n / tb:.0f}, "
              f"fixed k={K} {n / tf:.0f}, load {n / tl:.0f}")


def main(argv: list[str]) -> None:
    """An engine directory: its stored costs' choices; nothing: the tiny pair, measured here."""
    if argv:
        stored(Path(argv[0]))
    else:
        measured()


if __name__ == "__main__":
    main(sys.argv[1:])

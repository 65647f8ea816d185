"""A draft step as a fraction of a target step, both timed in the same rounds (the build's pick-k table
times them too, but a single number here is quicker to compare across two checkouts).

    PYTHONPATH=. .venv/bin/python experiments/draft_fraction.py build/qwen_coder.yaml [rounds] [--both]

Each round: 2 target steps, 8 draft steps, 2 target steps (one token after a 64-token prefill, head and
argmax included, and for the draft its confidence as the drafting loop computes it); the fraction is the median over
rounds of median draft / median target. `--both` (an int4 or int4_a8 draft) loads the same draft weights a second time
with the other activations (W4A16 / W4A8) and times the two alternately in each round, 4 steps at a time, with their
paired ratio.
"""

from __future__ import annotations

import json
import statistics as st
import sys
import time

import torch

from pipeline import spec as specmod
from pipeline.common import setup_threads
from pipeline.runtime import kernels, quant
from pipeline.runtime.decode import load_bundle
from pipeline.runtime.speculative import load_draft


def other_activations(spec) -> tuple[str, object]:
    """The draft engine loaded again with int8 activations switched (same int4 weights)."""
    orig = quant.int8_activations
    built = orig(json.loads((spec.engine_dir / "draft" / "config.json").read_text()))
    quant.int8_activations = lambda cfg: not built
    try:
        model, _ = load_draft(spec.engine_dir / "draft", spec.device)
    finally:
        quant.int8_activations = orig
    return ("W4A16" if built else "W4A8"), model


@torch.inference_mode()
def main(path: str, rounds: int, both: bool) -> None:
    spec = specmod.load(path)
    setup_threads(spec)
    b = load_bundle(spec.engine_dir, spec.device, methods=("draft_target",))
    built = "W4A8" if b.draft.layers[0].w13.act8 else "W4A16"
    models = {"target": b.target, built: b.draft}
    if both:
        name, model = other_activations(spec)
        models[name] = model
    caches = {}
    for name, m in models.items():
        caches[name] = m.new_cache(1, 72)
        m(torch.randint(0, 1000, (1, 64)), torch.arange(64)[None], caches[name])
    pos, tok = torch.tensor([[64]]), torch.tensor([[5]])

    def step(name: str) -> float:
        m = models[name]
        t = time.perf_counter()
        logits = m.logits(m(tok, pos, caches[name])[:, 0])
        kernels.argmax_prob(logits) if name != "target" else logits.argmax(-1)
        return time.perf_counter() - t

    drafts = [n for n in models if n != "target"]
    for _ in range(3):
        for n in models:
            step(n)
    tt: list[float] = []
    td: dict = {n: [] for n in drafts}
    ratio: dict = {n: [] for n in drafts}
    for _ in range(rounds):
        a = [step("target") for _ in range(2)]
        d: dict = {n: [] for n in drafts}
        for _ in range(8 // len(drafts)):
            for n in drafts:
                d[n] += [step(n) for _ in range(4 if both else 8)]
        a += [step("target") for _ in range(2)]
        tt += a
        for n in drafts:
            td[n] += d[n]
            ratio[n].append(st.median(d[n]) / st.median(a))
    print(f"target {1e3 * st.median(tt):.1f} ms")
    for n in drafts:
        print(f"draft {n}: {1e3 * st.median(td[n]):.2f} ms, draft step = {st.median(ratio[n]):.4f} of a target step "
              f"(median of {rounds} rounds)")
    if both:
        a, c = drafts
        paired = st.median(x / y for x, y in zip(ratio[c], ratio[a]))
        print(f"{c} / {a} step time, paired by round: {paired:.3f}")


if __name__ == "__main__":
    args = [x for x in sys.argv[1:] if x != "--both"]
    main(args[0], int(args[1]) if len(args) > 1 else 15, "--both" in sys.argv)

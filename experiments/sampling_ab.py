"""Sampled decoding (T > 0) in process, with sampling as it was before (torch.multinomial's draw, torch's
division and softmax on OpenMP's threads) against as it is (kernels.sample_rows, kernels.softmax_rows, torch on the
caller's thread), alternating method by method and arm by arm on the same engines, seeded prompts.

    PYTHONPATH=. .venv/bin/python experiments/sampling_ab.py build/qwen_coder.yaml --temperature 1 --reps 2
    PYTHONPATH=. .venv/bin/python experiments/sampling_ab.py build/qwen_coder.yaml --temperature 0.7 --top-p 0.95

The earlier arm keeps speculative.residual and the draft's DraftProbs as they are now (they cannot be switched).
"""

from __future__ import annotations

import argparse
import statistics as st

import torch

from pipeline import spec as specmod
from pipeline.common import chat_ids, setup_threads
from pipeline.runtime import medusa, sampling, speculative
from pipeline.runtime.decode import decode, load_bundle
from pipeline.runtime.generate import Request
from pipeline.runtime.sampling import SamplingParams

PROMPTS = ["Write a Python function that merges two sorted lists.",
           "Explain what a Python decorator is, with an example.",
           "Write a bash script that counts lines in all .py files.",
           "Implement binary search in Python with tests."]


def multinomial_sample(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=g).squeeze(-1).reshape(probs.shape[:-1])


def torch_warp(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    logits = logits.float()
    if p.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / p.temperature
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        probs = sampling._nucleus(probs, p.top_p)
    return probs


ARMS = {"before": (multinomial_sample, torch_warp), "now": (sampling.sample, sampling.warp)}


def use(arm: str) -> None:
    sample, warp = ARMS[arm]
    for m in (sampling, speculative, medusa):
        if hasattr(m, "sample"):
            m.sample = sample
        if hasattr(m, "warp"):
            m.warp = warp


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--methods", default="baseline,draft_target")
    a = ap.parse_args(argv)
    s = specmod.load(a.spec)
    setup_threads(s)
    methods = a.methods.split(",")
    b = load_bundle(s.engine_dir, s.device, methods=tuple(m for m in methods if m != "baseline"))
    ids = [chat_ids(b.tokenizer, p) for p in PROMPTS]
    got: dict[tuple[str, str], list[float]] = {}
    for rep in range(a.reps):
        for method in methods:
            for arm in ("before", "now") if rep % 2 == 0 else ("now", "before"):
                use(arm)
                for i, p in enumerate(ids):
                    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, seed=i + 10 * rep)
                    r = decode(b, method, [Request(list(p), a.new, params)])[0]
                    got.setdefault((method, arm), []).append((len(r.tokens) - 1) / (r.elapsed_s - r.first_token_s))
    use("now")
    for m in methods:
        old, new = got[(m, "before")], got[(m, "now")]
        print(f"{m}: decode tokens/s before {st.median(old):.1f}, now {st.median(new):.1f}, "
              f"paired median now/before {st.median(n / o for o, n in zip(old, new)):.3f} ({len(old)} requests)")


if __name__ == "__main__":
    main()

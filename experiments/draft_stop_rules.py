"""Rules for how long draft_target drafts, compared offline on one recording instead of one decode per setting.

    PYTHONPATH=. .venv/bin/python experiments/draft_stop_rules.py build/qwen_coder.yaml --prompts tune --k 8

One greedy run per prompt with k = --k and no stopping records every round's draft probabilities (the top
probability of each draft step, as `speculation.draft_confidence` sees it) and how many drafts the target accepted.
Each rule then gets, per round, the k it would have proposed; its accepted count is min(accepted, k), since greedy
drafts after the first rejected one never count. Its cost is charged in one-token target steps from this machine's
own curve (`speedpick.measure_costs`: a draft step with its head, argmax and confidence, and verification of 1..k+1
tokens), timed right after the recording, and every draft step a rule runs is paid: a rule that looks at the draft
token after its last and declines it pays that step too. Greedy output is the same under every rule, so tokens per
step cost is the whole comparison. The rules:
- `first_below(k, c)`: the spec's rule, stop after the first token whose probability is below c (k at most);
- `product_below(k, c)`: stop after the token where the product of the round's probabilities falls below c;
- `product_before(k, c)`: the same, but that token is not proposed (its step is paid), unless it is the first.
"""

from __future__ import annotations

import argparse
import time

import torch

from pipeline import spec as specmod
from pipeline.common import chat_ids, setup_threads
from pipeline.runtime import kernels
from pipeline.runtime import speculative as sp
from pipeline.runtime.decode import load_bundle
from pipeline.runtime.generate import Request
from pipeline.sources import read_prompts
from pipeline.speedpick import measure_costs

CONFIDENCES = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def record(b, prompts: list[list[int]], k: int, new: int) -> list[tuple[list[float], int]]:
    """(draft probabilities, accepted drafts) for every round of a k-draft greedy run per prompt, one request at a
    time. The drafter is asked for probabilities (a confidence far below any draft's) but never stops early."""
    probs: list[float] = []
    rounds: list[tuple[list[float], int]] = []
    pick, add = kernels.argmax_prob, sp._Stats.add

    def argmax_prob(logits, with_prob=True):
        idx, p = pick(logits, with_prob)
        if p is not None:  # the draft's pick (the target's greedy picks ask for no probability)
            probs.append(float(p[0]))
        return idx, p

    def stats_add(self, proposed, accepted):
        rounds.append((list(probs), accepted))
        probs.clear()
        add(self, proposed, accepted)

    kernels.argmax_prob, sp._Stats.add = argmax_prob, stats_add
    try:
        for p in prompts:
            sp.draft_target(b.target, b.draft, [Request(p, new)], k, draft_confidence=1e-30)
    finally:
        kernels.argmax_prob, sp._Stats.add = pick, add
    return rounds


def first_below(k: int, c: float):
    def rule(probs: list[float]) -> tuple[int, int]:
        for i in range(k):
            if probs[i] < c:
                return i + 1, i + 1
        return k, k
    return rule


def product_below(k: int, c: float, before: bool = False):
    def rule(probs: list[float]) -> tuple[int, int]:
        pr = 1.0
        for i in range(k):
            pr *= probs[i]
            if pr < c:
                return (max(i, 1), i + 1) if before else (i + 1, i + 1)
        return k, k
    return rule


def score(rounds, rule, draft: float, verify: list[float]) -> float:
    """Tokens per one-token step; rule(probs) -> (drafts proposed, draft steps run), verify[S] = S tokens' cost."""
    tokens = cost = 0.0
    for probs, accepted in rounds:
        k, steps = rule(probs)
        tokens += min(accepted, k) + 1
        cost += steps * draft + verify[k + 1]
    return tokens / cost


def run(path: str, which: str, k: int, new: int) -> None:
    s = specmod.load(path)
    setup_threads(s)
    b = load_bundle(s.engine_dir, s.device, methods=("draft_target",))
    texts = read_prompts(s.path(s.draft.train.prompts if which == "tune" else s.validate.prompts))
    if which == "eval":
        texts = texts[:s.validate.max_prompts]
    t0 = time.perf_counter()
    with torch.inference_mode():
        rounds = record(b, [chat_ids(b.tokenizer, t) for t in texts], k, new)
        costs = measure_costs(b.target, b.draft, k)
    one = costs["c_verify"][0]
    draft, verify = costs["c_draft"] / one, [0.0] + [c / one for c in costs["c_verify"]]
    print(f"{len(texts)} prompts, {len(rounds)} rounds in {time.perf_counter() - t0:.0f} s; one-token step "
          f"{1e3 * one:.1f} ms, draft step {draft:.3f}, verify 1..{k + 1}: {', '.join(f'{v:.2f}' for v in verify[1:])}")
    print("fixed k: " + ", ".join(f"{j}: {score(rounds, lambda _, j=j: (j, j), draft, verify):.3f}"
                                  for j in range(1, k + 1)))
    sp_ = s.speculation
    if sp_.draft_confidence > 0 and isinstance(sp_.num_draft_tokens, int):
        kk = min(sp_.num_draft_tokens, k)
        print(f"the spec's rule, first_below({kk}, {sp_.draft_confidence}): "
              f"{score(rounds, first_below(kk, sp_.draft_confidence), draft, verify):.3f}")
    for name, make in (("first_below", first_below), ("product_below", product_below),
                       ("product_before", lambda j, c: product_below(j, c, before=True))):
        table = sorted(((score(rounds, make(j, c), draft, verify), j, c) for j in range(2, k + 1) for c in CONFIDENCES),
                       reverse=True)
        print(f"{name:15} best: " + ", ".join(f"({j}, {c}) {v:.3f}" for v, j, c in table[:3]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("spec")
    ap.add_argument("--prompts", choices=("tune", "eval"), default="tune",
                    help="draft.train.prompts, or the first validate.max_prompts of validate.prompts")
    ap.add_argument("--k", type=int, default=8, help="drafts per recorded round (the most any rule may propose)")
    ap.add_argument("--new", type=int, default=128, help="new tokens per prompt")
    a = ap.parse_args()
    run(a.spec, a.prompts, a.k, a.new)


if __name__ == "__main__":
    main()

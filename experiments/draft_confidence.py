"""Sweep speculation.draft_confidence (and k) for draft_target on the spec's tuning prompts, in-process.

    PYTHONPATH=. .venv/bin/python experiments/draft_confidence.py build/qwen_coder.yaml 6 0 0.5 0.7 0.9
    PYTHONPATH=. .venv/bin/python experiments/draft_confidence.py build/qwen_coder.yaml 6:0.7 8:0.8  # k:confidence

Each prompt runs every setting in turn (interleaved, so drifts in this machine's memory bandwidth hit all
alike); totals per setting are printed with accepted/proposed drafts and rounds. Greedy output is the same for
every setting (the rule only shortens drafts), so only time differs.
"""

from __future__ import annotations

import sys
import time

from pipeline import spec as specmod
from pipeline.common import chat_ids, setup_threads
from pipeline.runtime.decode import load_bundle
from pipeline.runtime.generate import Request
from pipeline.runtime.speculative import draft_target
from pipeline.sources import read_prompts


def main(path: str, settings: list[tuple[int, float]], prompts: int = 5, new: int = 96) -> None:
    s = specmod.load(path)
    setup_threads(s)
    b = load_bundle(s.engine_dir, s.device, methods=("draft_target",))
    texts = read_prompts(s.path(s.draft.train.prompts))[:prompts]
    ids = [chat_ids(b.tokenizer, t) for t in texts]
    total = dict.fromkeys(settings, 0.0)
    stats = {kc: [0, 0, 0] for kc in settings}
    outputs: dict = {}
    for i, p in enumerate(ids):
        for kc in settings:
            k, c = kc
            t0 = time.perf_counter()
            r = draft_target(b.target, b.draft, [Request(p, new)], k, draft_confidence=c)[0]
            total[kc] += time.perf_counter() - t0
            stats[kc][0] += r.draft_accepted
            stats[kc][1] += r.draft_proposed
            stats[kc][2] += r.steps
            assert outputs.setdefault(i, r.tokens) == r.tokens, "the confidence rule changed greedy output"
    for (k, c), (a, pr, rounds) in stats.items():
        print(f"k={k} draft_confidence {c}: {total[k, c]:.2f} s, accepted {a}/{pr} drafts, {rounds} rounds")


def _settings(args: list[str]) -> list[tuple[int, float]]:
    """`k c1 c2 ...` (one k) or `k1:c1 k2:c2 ...`."""
    if all(":" in a for a in args):
        return [(int(a.split(":")[0]), float(a.split(":")[1])) for a in args]
    return [(int(args[0]), float(c)) for c in args[1:]]


if __name__ == "__main__":
    main(sys.argv[1], _settings(sys.argv[2:]))

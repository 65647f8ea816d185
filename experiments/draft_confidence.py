"""Sweep speculation.draft_confidence (and k) for draft_target on the spec's tuning prompts, in-process.

    PYTHONPATH=. .venv/bin/python experiments/draft_confidence.py build/qwen_coder.yaml 6 0 0.5 0.7 0.9

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


def main(path: str, k: int, confs: list[float], prompts: int = 5, new: int = 96) -> None:
    s = specmod.load(path)
    setup_threads(s)
    b = load_bundle(s.engine_dir, s.device, methods=("draft_target",))
    texts = read_prompts(s.path(s.draft.train.prompts))[:prompts]
    ids = [chat_ids(b.tokenizer, t) for t in texts]
    total = dict.fromkeys(confs, 0.0)
    stats = {c: [0, 0, 0] for c in confs}
    outputs: dict = {}
    for i, p in enumerate(ids):
        for c in confs:
            t0 = time.perf_counter()
            r = draft_target(b.target, b.draft, [Request(p, new)], k, draft_confidence=c)[0]
            total[c] += time.perf_counter() - t0
            stats[c][0] += r.draft_accepted
            stats[c][1] += r.draft_proposed
            stats[c][2] += r.steps
            assert outputs.setdefault(i, r.tokens) == r.tokens, "the confidence rule changed greedy output"
    for c in confs:
        a, pr, rounds = stats[c]
        print(f"k={k} draft_confidence {c}: {total[c]:.2f} s, accepted {a}/{pr} drafts, {rounds} rounds")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), [float(c) for c in sys.argv[3:]])

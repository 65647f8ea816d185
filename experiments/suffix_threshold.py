"""Measure hybrid's speculation.suffix_min_match (and suffix / draft_target beside it) on the spec's tuning prompts,
as fresh code and as an edit of that code, in-process.

    PYTHONPATH=. .venv/bin/python experiments/suffix_threshold.py build/qwen_coder.yaml 2 4 8 --prompts 2 --new 48

Each tuning prompt is asked once as written (fresh code: matches are short, the draft model should draft) and once
as an edit ("return this code with a docstring added" over the fresh answer: long matches, the suffix draft should).
Every setting runs each prompt in turn (interleaved, so drifts in this machine's memory bandwidth hit all alike);
totals per setting and kind are printed with accepted/proposed drafts and rounds. Greedy output is the same for every
setting (asserted): only time differs. No store of recent outputs (each setting would warm it for the next).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from pipeline import spec as specmod
from pipeline.common import chat_ids, setup_threads
from pipeline.runtime.decode import apply_spec, decode, load_bundle
from pipeline.runtime.generate import Request
from pipeline.sources import read_prompts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("min_match", nargs="+", type=int)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--new", type=int, default=48)
    a = ap.parse_args(argv)
    s = specmod.load(a.spec)
    setup_threads(s)
    b = apply_spec(load_bundle(s.engine_dir, s.device, methods=("draft_target", "hybrid")), s)
    base_spec = dataclasses.replace(b.spec, suffix_store_bytes=0)
    texts = read_prompts(s.path(s.draft.train.prompts))[:a.prompts]
    cases = []
    for t in texts:
        fresh = chat_ids(b.tokenizer, t)
        (r,) = decode(b.use(base_spec), "baseline", [Request(fresh, a.new)])
        code = b.tokenizer.decode(r.tokens, skip_special_tokens=True)
        edit = chat_ids(b.tokenizer, "Return this code unchanged except for a one-line docstring on its first "
                        f"function:\n\n{code}")
        cases += [("fresh", fresh), ("edit", edit)]
    settings = [("draft_target", 0), ("suffix", 0)] + [("hybrid", m) for m in a.min_match]
    total = {(st, kind): [0.0, 0, 0, 0] for st in settings for kind in ("fresh", "edit")}
    outputs: dict = {}
    for i, (kind, ids) in enumerate(cases):
        for method, m in settings:
            b.use(dataclasses.replace(base_spec, suffix_min_match=m or base_spec.suffix_min_match))
            t0 = time.perf_counter()
            (r,) = decode(b, method, [Request(ids, a.new)])
            row = total[(method, m), kind]
            row[0] += time.perf_counter() - t0
            row[1] += r.draft_accepted
            row[2] += r.draft_proposed
            row[3] += r.steps
            assert outputs.setdefault(i, r.tokens) == r.tokens, f"{method} {m} changed greedy output"
    for ((method, m), kind), (sec, acc, prop, rounds) in total.items():
        name = f"{method} min_match {m}" if m else method
        print(f"{kind:5s} {name:22s} {sec:7.2f} s  accepted {acc}/{prop} drafts, {rounds} rounds")


if __name__ == "__main__":
    main()

"""The suffix drafter's re-sync after an edit and the hybrid's short matches while its draft model waits
(`suffix.RESYNC_SPAN`, `SuffixDrafter.weak`), on against off, on the edit set in-process: hybrid with and without
`prediction` = the original file, decode tokens/s and target forwards.

    PYTHONPATH=. .venv/bin/python experiments/resync_ab.py build/qwen_coder.yaml --cases 4 --new 192

"Off" is the drafter as before both (RESYNC_SPAN 0: a mismatch is forgotten at once; `weak` drafts nothing). Every
request runs with the suffix store off and the prompt cache on, so each case's prompt is prefilled once (a 2-token
warm-up fills the target's K/V first): decode tokens/s are the tokens after the first over the time after it. The
settings alternate case by case, twice in opposite orders, so the machine's drift hits both alike; greedy output is
asserted identical to the baseline's.
"""

from __future__ import annotations

import argparse
import dataclasses

from pipeline import spec as specmod
from pipeline.common import setup_threads
from pipeline.edit_run import load_cases, messages
from pipeline.runtime import suffix
from pipeline.runtime.decode import decode, load_bundle
from pipeline.runtime.generate import Request
from pipeline.runtime.prompt_cache import PromptCache
from pipeline.runtime.specconfig import SpecDecodeConfig


def switch(on: bool, span: int = suffix.RESYNC_SPAN, weak=suffix.SuffixDrafter.weak) -> None:
    suffix.RESYNC_SPAN = span if on else 0
    suffix.SuffixDrafter.weak = weak if on else (lambda self, b, c: [])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("--cases", type=int, default=4)
    ap.add_argument("--new", type=int, default=192)
    a = ap.parse_args(argv)
    s = specmod.load(a.spec)
    setup_threads(s)
    b = load_bundle(s.engine_dir, s.device, methods=("hybrid",))
    b.prompt_cache = PromptCache(1 << 30)
    b.use(dataclasses.replace(SpecDecodeConfig.from_speculation(s.speculation, b.config["build_config"]
                                                                ["max_draft_len"], b.measured_k), suffix_store_bytes=0))
    tok = b.tokenizer
    sets = [(on, pred) for pred in (False, True) for on in (True, False)]
    rows: dict[tuple[bool, bool], list[tuple[int, float, int]]] = {k: [] for k in sets}
    for case in load_cases(s.path(s.validate.edit_set), a.cases):
        enc = tok.apply_chat_template(messages(case), add_generation_prompt=True)
        prompt = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
        original = tok(case["original"], add_special_tokens=False)["input_ids"]
        (ref,) = decode(b, "baseline", [Request(prompt, a.new, end_ids=b.end_ids)])
        for order in (sets, sets[::-1]):
            for on, pred in order:
                switch(on)
                (r,) = decode(b, "hybrid", [Request(prompt, a.new, end_ids=b.end_ids,
                                                    prediction=original if pred else None)])
                assert r.tokens == ref.tokens, f"re-sync {on}, prediction {pred} changed the answer on {case['id']}"
                rows[(on, pred)].append((len(r.tokens) - 1, r.elapsed_s - r.first_token_s, r.steps))
        switch(True)
        print(f"case {case['id']}: " + ", ".join(
            f"{'on' if on else 'off'}{' + prediction' if p else ''} "
            f"{sum(x[0] for x in rows[(on, p)][-2:]) / sum(x[1] for x in rows[(on, p)][-2:]):.1f}" for on, p in sets)
            + " tok/s")
    print(f"\n{a.cases} cases x 2 passes, {a.new} new tokens at most; decode tokens/s summed; forwards after the first")
    for on, pred in sets:
        xs = rows[(on, pred)]
        print(f"hybrid, re-sync and short matches {'on ' if on else 'off'}{' + prediction' if pred else '':14s} "
              f"{sum(x[0] for x in xs) / sum(x[1] for x in xs):6.1f} tok/s  forwards {sum(x[2] for x in xs)}")


if __name__ == "__main__":
    main()

"""validate's concurrency-curve burst (`validate._burst`: its prompts, the spec's `validate.curve_tokens`,
`cache_prompt: false`), repeated at one level with the methods interleaved (forward, then reversed order), against a
running server: how far apart two runs of the same level read, which a single curve point cannot say.

    make serve &   # the flagship, then:
    PYTHONPATH=. .venv/bin/python experiments/curve_repeats.py build/qwen_coder.yaml --methods baseline,hybrid \
        --concurrency 2 --reps 6
"""

from __future__ import annotations

import argparse
import statistics as st

from pipeline import spec as specmod
from pipeline import validate
from pipeline.sources import spec_prompts
from pipeline.triton import server


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("--methods", default="baseline,hybrid", help="the first is the one the others are divided by")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--new", type=int, default=0, help="new tokens a request (0: the spec's validate.curve_tokens)")
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer  # lazy: a second or two

    s = specmod.load(a.spec)
    tok = AutoTokenizer.from_pretrained(str(s.engine_dir / "target"))
    v = s.validate
    texts = [validate.chat_text(tok, p) for p in spec_prompts(s, v.max_prompts + 1 if v.max_prompts else 0)[1:]]
    url, methods, new = server.grpc_url(s), a.methods.split(","), a.new or validate.curve_tokens(v)
    got: dict[str, list[float]] = {m: [] for m in methods}
    for r in range(a.reps):
        for m in methods if r % 2 == 0 else methods[::-1]:
            got[m].append(validate._burst(url, texts, m, a.concurrency, new)["tokens_per_s"])
    for m in methods:
        print(f"{m:14s} tokens/s {[round(x, 1) for x in got[m]]}  median {st.median(got[m]):.1f}")
    for m in methods[1:]:
        paired = [x / y for x, y in zip(got[m], got[methods[0]])]
        print(f"{m} / {methods[0]} at concurrency {a.concurrency}, paired by repetition: "
              f"{[round(x, 3) for x in paired]}  median {st.median(paired):.3f}")


if __name__ == "__main__":
    main()

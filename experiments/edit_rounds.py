"""Where an edit's rounds go: each round of the edit set's answers in process, which source drafted how many tokens,
how many the target committed and how long the round took; and, with --cost, each method's rounds, verified tokens
and verify cost by the stored curve (deterministic: the same code gives the same figures in any minute, so two
checkouts compare without the machine's memory speed in between).

    PYTHONPATH=. .venv/bin/python experiments/edit_rounds.py build/qwen_coder.yaml --cases 4 --new 192
    PYTHONPATH=. .venv/bin/python experiments/edit_rounds.py build/qwen_coder.yaml --cases 13 --cost

A round prints as `[source L] committed/ms 'text'` (source: pre(diction), con(text), sto(re), res(ync), ski(p), or
`-` for no suffix draft, twice where the hybrid asked its weak lookup too). Requests go as validate sends them
(`cache_prompt: false`); greedy answers are asserted equal to the baseline's.
"""

from __future__ import annotations

import argparse
import time

from pipeline import spec as specmod
from pipeline.common import setup_threads
from pipeline.edit_run import load_cases, messages
from pipeline.runtime import suffix
from pipeline.runtime.decode import decode, load_bundle
from pipeline.runtime.generate import Request
from pipeline.runtime.prompt_cache import PromptCache

KINDS = (("hybrid", "hybrid", False), ("hybrid + prediction", "hybrid", True), ("suffix", "suffix", False))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("--cases", type=int, default=4)
    ap.add_argument("--new", type=int, default=192)
    ap.add_argument("--cost", action="store_true", help="rounds, verified tokens and verify cost per method only")
    a = ap.parse_args(argv)
    s = specmod.load(a.spec)
    setup_threads(s)
    b = load_bundle(s.engine_dir, s.device, methods=("hybrid", "suffix"))
    b.prompt_cache = PromptCache(1 << 30)
    tok = b.tokenizer
    log: list[tuple] = []
    widths: list[int] = []
    draft_of = suffix.SuffixDrafter.row_draft

    def row_draft(self, row, c, min_match=0):
        d = draft_of(self, row, c, min_match)
        last = self.rows[row].last
        log.append(("draft", (last[0][:3] if last else "-"), len(d)))
        return d

    suffix.SuffixDrafter.row_draft = row_draft
    forward = type(b.target).forward

    def counted(model, tokens, *args, **kw):
        if model is b.target:
            widths.append(tokens.shape[1])
        return forward(model, tokens, *args, **kw)

    type(b.target).forward = counted
    totals: dict[str, list[float]] = {}
    for case in load_cases(s.path(s.validate.edit_set), a.cases):
        enc = tok.apply_chat_template(messages(case), add_generation_prompt=True)
        prompt = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
        pred = tok(case["original"], add_special_tokens=False)["input_ids"]
        (ref,) = decode(b, "baseline", [Request(prompt, a.new, end_ids=b.end_ids)])
        for name, method, with_pred in KINDS:
            log.clear()
            widths.clear()

            def emit(_row, toks):
                log.append(("emit", time.perf_counter(), len(toks), tok.decode(toks)))

            (r,) = decode(b, method, [Request(prompt, a.new, end_ids=b.end_ids, prediction=pred if with_pred else None,
                                              cache_prompt=False)], on_emit=emit)
            assert r.tokens == ref.tokens, f"{name} changed the answer on {case['id']}"
            rounds = widths[1:]  # the first forward is the prefill
            cost = sum(b.verify_cost[w - 1] for w in rounds)
            t = totals.setdefault(name, [0, 0, 0.0])
            t[0], t[1], t[2] = t[0] + len(rounds), t[1] + sum(rounds), t[2] + cost
            dt = r.elapsed_s - r.first_token_s
            print(f"{case['id']} {name}: {len(r.tokens) - 1} tokens in {dt * 1e3:.0f} ms, {len(rounds)} rounds, "
                  f"{sum(rounds)} verified, cost {cost:.1f} one-token steps")
            if not a.cost:
                out, prev = [], None
                for e in log:
                    if e[0] == "draft":
                        out.append(f"[{e[1]} {e[2]}]")
                    else:
                        if prev is not None:
                            out.append(f"{e[2]}/{(e[1] - prev) * 1e3:.0f} {e[3]!r}")
                        prev = e[1]
                print("  " + " ".join(out))
    print(f"\n{a.cases} cases, {a.new} new tokens at most: rounds, verified tokens, verify cost (one-token steps)")
    for name, (n, v, c) in totals.items():
        print(f"{name:22s} {n:5d} {v:6d} {c:8.1f}")


if __name__ == "__main__":
    main()

"""Long suffix drafts on the edit set, in-process: hybrid with limits.max_draft_len 8 against 32 (the draft model's
k unchanged), with and without `prediction` = the original file, and hybrid's suffix_min_match beside them.

    PYTHONPATH=. .venv/bin/python experiments/long_suffix.py build/qwen_coder.yaml --engines engines/qwen_coder \
        --cases 3 --new 128 --lens 8 32 --min-match 2 4 8 [--verify 33]

max_draft_len only sizes the runtime (docs/speculation-config.md): the engine's config.json is set to each length in
memory here, as `make engine` writes it in place. Every request runs with the suffix store off (a request of one
setting must not draft another's answer) and with the prompt cache on, so each case's prompt is prefilled once (a
2-token warm-up of hybrid fills the target's and the draft's K/V before anything is timed): decode tokens/s are the
tokens after the first over the time after it. Settings run case by case in turn, twice in opposite orders, so this
machine's drift hits all alike; greedy output is asserted identical to the baseline's. `--verify N` first times the
target's verify curve to N tokens (bench's `verify_cost_curve`, 3 rounds) and drafts with it; otherwise with the
engine's stored curve (verify_cost.json, from `make bench`) or, lacking it, the built-in Zen 4 curve.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path

from pipeline import spec as specmod
from pipeline.bench import verify_cost_curve
from pipeline.common import setup_threads
from pipeline.edit_run import load_cases, messages
from pipeline.runtime.decode import decode, load_bundle
from pipeline.runtime.generate import Request
from pipeline.runtime.prompt_cache import PromptCache
from pipeline.runtime.specconfig import SpecDecodeConfig
from pipeline.runtime.suffix import VERIFY_COST


def settings(lens: list[int], min_match: list[int], default_mm: int) -> list[tuple[str, str, int, str, int]]:
    """(label, method, max_draft_len, prediction kind, suffix_min_match) per setting."""
    out = [("baseline", "baseline", lens[0], "", default_mm)]
    for n in lens:
        out.append((f"hybrid mdl {n}", "hybrid", n, "", default_mm))
    for n in lens:
        out.append((f"hybrid mdl {n} + prediction", "hybrid", n, "original", default_mm))
    out.append((f"hybrid mdl {lens[-1]} + unrelated prediction", "hybrid", lens[-1], "unrelated", default_mm))
    for m in min_match:
        if m != default_mm:
            out.append((f"hybrid mdl {lens[-1]} min_match {m}", "hybrid", lens[-1], "", m))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("--engines", default="", help="engine directory (default: the spec's)")
    ap.add_argument("--cases", type=int, default=3)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--lens", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--min-match", type=int, nargs="*", default=[])
    ap.add_argument("--verify", type=int, default=0, help="time the verify curve to this many tokens first")
    a = ap.parse_args(argv)
    s = specmod.load(a.spec)
    setup_threads(s)
    b = load_bundle(Path(a.engines) if a.engines else s.engine_dir, s.device, methods=("hybrid",))
    stored = b.verify_cost is not VERIFY_COST
    if a.verify:
        curve = verify_cost_curve(b.target, a.verify, reps=3)
        b.verify_cost = tuple(c["relative"] for c in curve)
        print("verify curve (one-token steps), S=1..: " + ", ".join(f"{c['relative']:.2f}" for c in curve))
        print("  best-round ms: " + ", ".join(f"{c['ms']:.0f}" for c in curve))
    print(f"drafting with the {'measured' if a.verify else 'stored' if stored else 'built-in Zen 4'} verify curve")
    b.prompt_cache = PromptCache(1 << 30)
    base_cfg = {n: dataclasses.replace(SpecDecodeConfig.from_speculation(s.speculation, n, b.measured_k),
                                       suffix_store_bytes=0) for n in a.lens}
    default_mm = base_cfg[a.lens[0]].suffix_min_match
    sets = settings(a.lens, a.min_match, default_mm)
    cases = load_cases(s.path(s.validate.edit_set), a.cases)
    tok = b.tokenizer
    rows: dict[str, list] = {label: [] for label, *_ in sets}
    for i, case in enumerate(cases):
        enc = tok.apply_chat_template(messages(case), add_generation_prompt=True)
        prompt = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
        other = cases[(i + 1) % len(cases)]["original"]
        preds = {"": None, "original": tok(case["original"], add_special_tokens=False)["input_ids"],
                 "unrelated": tok(other, add_special_tokens=False)["input_ids"]}
        b.config["build_config"]["max_draft_len"] = a.lens[-1]  # what `make engine` writes in place
        b.use(base_cfg[a.lens[-1]])
        decode(b, "hybrid", [Request(prompt, 2)])  # warm-up: the target's and the draft's prompt K/V cached
        ref = None
        for order in (sets, sets[::-1]):
            for label, method, n, pk, mm in order:
                b.config["build_config"]["max_draft_len"] = n
                b.use(dataclasses.replace(base_cfg[n], suffix_min_match=mm))
                (r,) = decode(b, method, [Request(prompt, a.new, end_ids=b.end_ids, prediction=preds[pk])])
                ref = ref or (r.tokens if method == "baseline" else None)
                if ref is not None:
                    assert r.tokens == ref, f"{label} changed greedy output on {case['id']}"
                run = max((j + 1 for j, c in enumerate(r.accepted_per_position) if c), default=0)
                rows[label].append((len(r.tokens), r.elapsed_s - r.first_token_s, r.steps, r.draft_accepted,
                                    r.draft_proposed, run))
        print(f"case {case['id']} ({len(prompt)} prompt tokens, {len(ref or [])} new): "
              + ", ".join(f"{lb} {(x[0] - 1) / x[1]:.1f}" for lb, xs in rows.items() for x in xs[-1:]) + " tok/s")
    ref_label = f"hybrid mdl {a.lens[0]}"
    print(f"\n{len(cases)} cases x 2 passes, {a.new} new tokens at most; decode tokens/s summed, rounds = target "
          f"forwards after the first token; ratio = per-run median of decode tokens/s over {ref_label}'s same run")
    for label, xs in rows.items():
        tokens, secs = sum(x[0] - 1 for x in xs), sum(x[1] for x in xs)
        rel = statistics.median((x[0] - 1) / x[1] / ((y[0] - 1) / y[1]) for x, y in zip(xs, rows[ref_label]))
        print(f"{label:38s} {tokens / secs:6.1f} tok/s  x{rel:.2f}  rounds {sum(x[2] for x in xs):4d}  "
              f"accepted {sum(x[3] for x in xs)}/{sum(x[4] for x in xs)}  longest accepted run {max(x[5] for x in xs)}")


if __name__ == "__main__":
    main()

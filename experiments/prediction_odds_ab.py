"""The suffix drafter of this checkout against another checkout's (`--old-suffix`), in one process on the edit set:
hybrid with no prediction, with the original file as the prediction, and with another case's file (an unrelated
prediction), decode tokens/s and target forwards.

    git worktree add /tmp/old b49e7c6
    PYTHONPATH=. .venv/bin/python experiments/prediction_odds_ab.py build/qwen_coder.yaml \
        --old-suffix /tmp/old/pipeline/runtime/suffix.py --cases 4 --new 192

Written for the per-request prediction odds (ced0cee): a served model's requests share the store's odds, so each
drafter gets its own store here, kept across the requests of its side as a deployment keeps it; outputs are not
added to it (the edit set's requests are `cache_prompt: false` when validate measures them), so only the odds carry
over. The sides alternate case by case, in opposite orders, so the machine's drift hits both alike; greedy output
is asserted identical to the baseline's. The prompt cache is on: each case's prompt is prefilled once.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from pipeline import spec as specmod
from pipeline.common import setup_threads
from pipeline.edit_run import load_cases, messages
from pipeline.runtime import suffix
from pipeline.runtime.decode import decode, load_bundle
from pipeline.runtime.generate import Request
from pipeline.runtime.prompt_cache import PromptCache

PREDICTIONS = ("none", "original", "unrelated")


def load_old(path: str):
    """The other checkout's suffix module, imported under its own name (it imports this checkout's runtime)."""
    spec = importlib.util.spec_from_file_location("old_suffix", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_suffix"] = mod
    spec.loader.exec_module(mod)
    return mod


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def run(spec_path: str, old_path: str, n_cases: int, new: int) -> dict:
    s = specmod.load(spec_path)
    setup_threads(s)
    b = load_bundle(s.engine_dir, s.device, methods=("hybrid",))
    b.prompt_cache = PromptCache(1 << 30)
    old = load_old(old_path)
    mods = {"new": suffix, "old": old}
    drafters = {side: m.SuffixDrafter for side, m in mods.items()}
    for m in mods.values():
        m.SuffixStore.add = lambda self, toks: None  # the odds carry over, not the outputs
    stores = {side: m.SuffixStore(1 << 20) for side, m in mods.items()}
    tok = b.tokenizer
    cases = load_cases(s.path(s.validate.edit_set), n_cases)
    rows: dict[tuple[str, str], list[tuple[int, float, int]]] = {(v, p): [] for v in mods for p in PREDICTIONS}
    for i, case in enumerate(cases):
        enc = tok.apply_chat_template(messages(case), add_generation_prompt=True)
        prompt = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
        preds = {"none": None, "original": ids(tok, case["original"]),
                 "unrelated": ids(tok, cases[(i + 1) % len(cases)]["original"])}
        (ref,) = decode(b, "baseline", [Request(prompt, new, end_ids=b.end_ids)])
        for order in (("new", "old"), ("old", "new")):
            for side in order:
                suffix.SuffixDrafter, b.suffix_store = drafters[side], stores[side]
                for p in PREDICTIONS:
                    (r,) = decode(b, "hybrid", [Request(prompt, new, end_ids=b.end_ids, prediction=preds[p])])
                    assert r.tokens == ref.tokens, f"{side} drafter, prediction {p}: the answer changed on {case['id']}"
                    rows[(side, p)].append((len(r.tokens) - 1, r.elapsed_s - r.first_token_s, r.steps))
        suffix.SuffixDrafter = drafters["new"]
        print(f"case {case['id']} done", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("--old-suffix", required=True, help="another checkout's pipeline/runtime/suffix.py")
    ap.add_argument("--cases", type=int, default=4)
    ap.add_argument("--new", type=int, default=192)
    a = ap.parse_args(argv)
    rows = run(a.spec, a.old_suffix, a.cases, a.new)
    print(f"\n{a.cases} cases x 2 passes, {a.new} new tokens at most; decode tokens/s summed; forwards after the first")
    for (side, p), xs in rows.items():
        print(f"{side:4s} {p:10s} {sum(x[0] for x in xs) / sum(x[1] for x in xs):6.1f} tok/s  "
              f"forwards {sum(x[2] for x in xs)}")


if __name__ == "__main__":
    main()

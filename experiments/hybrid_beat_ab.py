"""The hybrid's rule that leaves a suffix match the draft model would beat to the model (`SuffixDrafter(beat=)`:
pick-k's expected tokens per step), on against off, beside draft_target, on validate's chat prompts in-process:
greedy, no caches, the order alternating prompt by prompt; decode tokens/s (tokens after the first over the time
after it), and every answer asserted equal to the first setting's.

    PYTHONPATH=. .venv/bin/python experiments/hybrid_beat_ab.py [new tokens, default 128]
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline import spec as specmod
from pipeline.common import setup_threads
from pipeline.runtime import suffix
from pipeline.runtime.decode import apply_spec, decode, load_bundle
from pipeline.runtime.generate import Request
from pipeline.validate import chat_text

ON = suffix.SuffixDrafter.__init__


def off(self, *args, **kw) -> None:
    """SuffixDrafter without the rule (beat 0), whatever the hybrid passes."""
    args = list(args)
    if len(args) >= 7:
        args[6] = 0.0
    kw.pop("beat", None)
    ON(self, *args, **kw)


def main(new: int = 128) -> None:
    s = specmod.load("build/qwen_coder.yaml")
    setup_threads(s)
    b = apply_spec(load_bundle(s.engine_dir, "cpu"), s)
    tok = b.tokenizer
    lines = Path(s.path(s.validate.prompts)).read_text().splitlines()
    texts = [t for t in lines if t.strip() and not t.startswith("#")]
    ids = [tok(chat_text(tok, t), add_special_tokens=False)["input_ids"] for t in texts[1:9]]  # validate's 8
    tot: dict[str, list] = {}
    for i, p in enumerate(ids):
        ref = None
        for label in (["beat", "no beat", "draft_target"] if i % 2 == 0 else ["draft_target", "no beat", "beat"]):
            suffix.SuffixDrafter.__init__ = off if label == "no beat" else ON
            (r,) = decode(b, "draft_target" if label == "draft_target" else "hybrid",
                          [Request(p, new, end_ids=b.end_ids, cache_prompt=False)])
            suffix.SuffixDrafter.__init__ = ON
            ref = ref or r.tokens
            assert r.tokens == ref, f"{label} changed the answer to prompt {i}"
            t = tot.setdefault(label, [0, 0.0])
            t[0] += len(r.tokens) - 1
            t[1] += r.elapsed_s - r.first_token_s
        print(f"prompt {i} done", flush=True)
    for label, (n, secs) in tot.items():
        print(f"{label:14s} {n / secs:6.1f} decode tokens/s")


if __name__ == "__main__":
    main(*[int(a) for a in sys.argv[1:]])

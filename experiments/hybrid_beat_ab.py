"""The hybrid's rule that leaves a suffix match the draft model would beat to the model (`SuffixDrafter(beat=)`, pick-k's
expected tokens per step), on against off, beside draft_target, on validate's chat prompts in-process: greedy, no
caches, alternating the order prompt by prompt; decode tokens/s (tokens after the first over the time after it).

    PYTHONPATH=. .venv/bin/python experiments/hybrid_beat_ab.py [new tokens, default 128]
"""

import sys
from pathlib import Path

from pipeline import spec as specmod
from pipeline.common import setup_threads
from pipeline.runtime import suffix as sx
from pipeline.runtime.decode import apply_spec, decode, load_bundle
from pipeline.runtime.generate import Request
from pipeline.validate import chat_text

s = specmod.load("build/qwen_coder.yaml"); setup_threads(s)
b = apply_spec(load_bundle(s.engine_dir, "cpu"), s)
tok = b.tokenizer
texts = [t for t in Path("build/code_prompts.txt").read_text().splitlines() if t.strip() and not t.startswith("#")][1:9]
ids = [tok(chat_text(tok, t), add_special_tokens=False)["input_ids"] for t in texts]
orig = sx.SuffixDrafter.__init__
def off(self, *a, **k):
    a = list(a)
    if len(a) >= 7: a[6] = 0.0
    k.pop("beat", None)
    orig(self, *a, **k)
tot = {}
new = int(sys.argv[1]) if len(sys.argv) > 1 else 128
for i, p in enumerate(ids):
    ref = None
    for label in (["beat", "nobeat", "draft_target"] if i % 2 == 0 else ["draft_target", "nobeat", "beat"]):
        sx.SuffixDrafter.__init__ = off if label == "nobeat" else orig
        m = "draft_target" if label == "draft_target" else "hybrid"
        (r,) = decode(b, m, [Request(p, new, end_ids=b.end_ids, cache_prompt=False)])
        ref = ref or r.tokens
        assert r.tokens == ref
        t = r.elapsed_s - r.first_token_s
        tot.setdefault(label, [0, 0.0, []]); tot[label][0] += len(r.tokens) - 1; tot[label][1] += t; tot[label][2].append((len(r.tokens)-1)/t)
    print(i, {k: round(v[2][-1], 1) for k, v in tot.items()}, flush=True)
sx.SuffixDrafter.__init__ = orig
for k, v in tot.items(): print(k, round(v[0] / v[1], 1), "decode tok/s")

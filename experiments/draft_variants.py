"""What the draft's numerics and head size cost in acceptance: the built draft against variants of the same pretrained
draft, on the same prompts, decoded in turn prompt by prompt (order reversed every other prompt).

    PYTHONPATH=. .venv/bin/python experiments/draft_variants.py build/qwen_coder.yaml \
        --quant bf16,int4_a8:64 --heads 49152,32768 --prompts 8 --new 128

`--quant`: the draft's source weights (the GGUF dequantized, as the build reads them) as `bf16` (the exact draft),
`int8`, `int4:G` or `int4_a8:G` (group size G), each with the built draft's reduced-vocabulary ids and its head
quantized as the build quantizes it (`int4_a8:128` is the flagship's draft rebuilt from its source: within
0.4% of `built` in tokens per round).
`--heads`: the built draft with its head cut to the first N of its ids (they are ordered: special tokens, the tuning
prompts' tokens, then the lowest BPE ids). Every variant is checked greedy-identical to the built draft's output
(the target decides every token); the table gives tokens per round (the figure numerics change), acceptance and
tokens/s. Only tokens per round is free of memory-speed drift; a variant's cost per round is its bytes, which the
build's own pick-k measures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def variant_drafts(spec, built, quants: list[str], heads: list[int]) -> dict:
    """{label: draft Transformer} for each requested variant (the built draft is 'built')."""
    from pipeline import sources
    from pipeline.runtime import quant
    from pipeline.runtime.model import ModelConfig, build_model, hf_to_runtime
    from pipeline.runtime.speculative import attach_draft_head

    out = {"built": (built, built.lm_head, built.vocab_ids)}
    for n in heads:
        if n > len(built.vocab_ids):
            raise SystemExit(f"--heads {n}: the built draft's head has {len(built.vocab_ids)} ids; cut it, not grow it")
        out[f"head {n}"] = (built, quant.head_rows(built.lm_head, torch.arange(n)), built.vocab_ids[:n].clone())
    if not quants:
        return out
    hf_cfg, state, _ = sources.load_hf(sources.resolve(spec.draft.source, Path(spec.root), key="draft.source"))
    mcfg = ModelConfig.from_hf(hf_cfg)
    rt = hf_to_runtime(state, mcfg)
    del state
    ids = built.vocab_ids
    head = rt.get("lm_head.weight", rt["embed.weight"])[ids].float()
    for q in quants:
        algo, _, g = q.partition(":")
        if algo == "bf16":
            m = build_model(mcfg, dict(rt), torch.bfloat16, "cpu")
        elif algo in ("int8", "int4", "int4_a8"):
            m = build_model(mcfg, quant.quantize_state(dict(rt), algo, int(g or 128)), torch.bfloat16, "cpu",
                            act8=algo == "int4_a8")
        else:
            raise SystemExit(f"--quant {q!r}: use bf16, int8, int4:G or int4_a8:G")
        if algo == "bf16":
            attach_draft_head(m, head.to(torch.bfloat16), ids)
        else:  # the head quantized as the build quantizes it (draft_head.safetensors)
            hq = quant.quantize_head(head, algo, int(g or 128))
            attach_draft_head(m, quant.QLinear(hq["qweight"], hq["scales"],
                                               act8=algo == "int4_a8" and hq["qweight"].dtype == torch.uint8), ids)
        out[q] = (m, m.lm_head, m.vocab_ids)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec")
    ap.add_argument("--quant", default="", help="comma-separated: bf16, int8, int4:G, int4_a8:G")
    ap.add_argument("--heads", default="", help="comma-separated head sizes (the first N of the built draft's ids)")
    ap.add_argument("--prompts", type=int, default=8, help="how many (0: all)")
    ap.add_argument("--prompts-file", default="", help="one prompt per line (default: the spec's validate.prompts; "
                    "decide on the tuning prompts, confirm on the evaluation ones)")
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()

    from pipeline import spec as specmod
    from pipeline.client import chat_text
    from pipeline.common import setup_threads
    from pipeline.runtime.decode import apply_spec, decode, load_bundle
    from pipeline.runtime.generate import Request
    from pipeline.sources import read_prompts, spec_prompts

    s = specmod.load(args.spec)
    setup_threads(s)
    b = apply_spec(load_bundle(s.engine_dir, s.device, methods=("baseline", "draft_target")), s)
    if getattr(b.draft, "vocab_ids", None) is None:
        raise SystemExit("the built draft has no reduced-vocabulary head (draft.vocab); this compares against one")
    variants = variant_drafts(s, b.draft, [q for q in args.quant.split(",") if q],
                              [int(n) for n in args.heads.split(",") if n])
    texts = read_prompts(Path(args.prompts_file)) if args.prompts_file else spec_prompts(s)
    texts = texts[:args.prompts] if args.prompts else texts
    prompts = [b.tokenizer.encode(chat_text(b.tokenizer, p)) for p in texts]
    tot = {v: {"tokens": 0, "rounds": 0, "accepted": 0, "proposed": 0, "s": 0.0, "tps": []} for v in variants}
    names = list(variants)
    for i, p in enumerate(prompts):
        outs = {}
        for v in names if i % 2 == 0 else names[::-1]:
            model, head, ids = variants[v]
            b.draft, model.lm_head, model.vocab_ids = model, head, ids
            t0 = time.perf_counter()
            r = decode(b, "draft_target", [Request(prompt=p, max_new_tokens=args.new, end_ids=b.end_ids)])[0]
            w = time.perf_counter() - t0
            t = tot[v]
            t["tokens"] += len(r.tokens)
            t["rounds"] += r.steps
            t["accepted"] += r.draft_accepted
            t["proposed"] += r.draft_proposed
            t["s"] += w
            t["tps"].append(len(r.tokens) / w)
            outs[v] = r.tokens
        differ = [v for v in names if outs[v] != outs["built"]]
        print(f"prompt {i}: " + "  ".join(f"{v}: {tot[v]['tps'][-1]:.1f} tok/s" for v in names), flush=True)
        if differ:
            raise SystemExit(f"prompt {i}: {differ} decoded other tokens than the built draft: a bug, not a variant")
    print(f"\n{len(prompts)} prompts x {args.new} new tokens, greedy, every variant identical to the built draft\n")
    print("| draft | tokens per round | acceptance | tokens/s (median per prompt) |\n|---|---|---|---|")
    for v in names:
        t = tot[v]
        print(f"| {v} | {t['tokens'] / max(1, t['rounds']):.3f} | {t['accepted'] / max(1, t['proposed']):.3f} | "
              f"{statistics.median(t['tps']):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

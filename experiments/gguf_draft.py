"""The flagship's draft on its GGUF's own blocks (`draft.quantization: gguf`) against the built draft (int4_a8): one
draft step's time and draft_target's acceptance and speed, on the same prompts, the two alternating.

    PYTHONPATH=. .venv/bin/python experiments/gguf_draft.py build/qwen_coder.yaml --prompts 4 --new 96

The GGUF draft is built in process as the engine build builds it (gguf_weights.gguf_state from the draft's GGUF, its
reduced head the GGUF head's rows at the built draft's ids, so both heads propose the same tokens). Step: one token
at a `--context`-token context, body + head + argmax (as speedpick times a draft step), best of 10 per round, the
two drafts and a target step alternating for `--rounds` rounds (median of the rounds' bests; the target's gives each
draft's share of a target step). Decoding: each prompt draft_target with each draft in turn (order reversed every
other prompt), greedy, prompt cache off; both must give the same tokens (the target decides every one).
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


def gguf_draft(spec, ids: torch.Tensor):
    """The spec's draft source on its GGUF's own blocks, with a reduced head of the GGUF head's rows at `ids`."""
    from pipeline import sources
    from pipeline.runtime import gguf_weights, quant
    from pipeline.runtime.model import ModelConfig, build_model, hf_to_runtime
    from pipeline.runtime.speculative import attach_draft_head

    src = sources.resolve(spec.draft.source, Path(spec.root), key="draft.source")
    hf_cfg, state, _ = sources.load_hf(src)
    mcfg = ModelConfig.from_hf(hf_cfg)
    rt = hf_to_runtime(state, mcfg)
    del state
    st = quant.cast_state(gguf_weights.gguf_state(rt, src.path, mcfg.num_layers), torch.float32)
    del rt
    m = build_model(mcfg, st, torch.bfloat16, "cpu")
    return attach_draft_head(m, quant.head_rows(m.lm_head, ids), ids)


def step_timer(model, context: list[int]):
    """A function timing one one-token step (best of `reps`) after `context`, as speedpick's draft_step."""
    from pipeline.runtime import kernels
    from pipeline.speedpick import best_time

    cache = model.new_cache(1, len(context) + 8)
    model(torch.tensor([context]), torch.arange(len(context))[None], cache)
    tok, pos = torch.tensor([[context[-1]]]), torch.tensor([[len(context)]])

    def step() -> None:
        kernels.argmax_prob(model.logits(model(tok, pos, cache)[:, 0]))

    step()
    return lambda reps=10: best_time(step, reps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompts-file", default="", help="one prompt per line (default: the spec's validate.prompts)")
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=8)
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
    built = b.draft
    algo = (b.draft_config or {}).get("pretrained_config", {}).get("quantization", {}).get("quant_algo")
    if getattr(built, "vocab_ids", None) is None:
        raise SystemExit("the built draft has no reduced-vocabulary head (draft.vocab); this compares against one")
    t0 = time.perf_counter()
    drafts = {f"built ({algo})": built, "gguf": gguf_draft(s, built.vocab_ids)}
    print(f"GGUF draft built in process in {time.perf_counter() - t0:.0f}s", flush=True)
    names = list(drafts)

    texts = read_prompts(Path(args.prompts_file)) if args.prompts_file else spec_prompts(s)
    texts = texts[:args.prompts] if args.prompts else texts
    prompts = [b.tokenizer.encode(chat_text(b.tokenizer, p)) for p in texts]

    ctx = (prompts[0] * (args.context // len(prompts[0]) + 1))[:args.context]
    timers = {v: step_timer(m, ctx) for v, m in drafts.items()}
    target = step_timer(b.target, ctx)
    steps: dict[str, list[float]] = {v: [] for v in [*names, "target"]}
    for r in range(args.rounds):
        for v in names if r % 2 == 0 else names[::-1]:
            steps[v].append(timers[v]())
        steps["target"].append(target())
    med = {v: statistics.median(x) for v, x in steps.items()}
    print("one-token step, ms (median of the rounds' bests / best): " + ", ".join(
        f"{v} {med[v] * 1e3:.2f} / {min(steps[v]) * 1e3:.2f}" for v in steps), flush=True)

    tot = {v: {"tokens": 0, "rounds": 0, "accepted": 0, "proposed": 0, "tps": []} for v in names}
    for i, p in enumerate(prompts):
        outs = {}
        for v in names if i % 2 == 0 else names[::-1]:
            b.draft = drafts[v]
            t0 = time.perf_counter()
            res = decode(b, "draft_target", [Request(p, args.new, end_ids=b.end_ids, cache_prompt=False)])[0]
            w = time.perf_counter() - t0
            t = tot[v]
            t["tokens"] += len(res.tokens)
            t["rounds"] += res.steps
            t["accepted"] += res.draft_accepted
            t["proposed"] += res.draft_proposed
            t["tps"].append(len(res.tokens) / w)
            outs[v] = res.tokens
        print(f"prompt {i}: " + "  ".join(f"{v}: {tot[v]['tps'][-1]:.1f} tok/s" for v in names), flush=True)
        if outs[names[0]] != outs[names[1]]:
            raise SystemExit(f"prompt {i}: the two drafts gave different tokens: a bug (the target decides each)")

    print(f"\n{len(prompts)} prompts x {args.new} new tokens, greedy, k and draft_confidence as the spec sets them; "
          f"draft step at a {args.context}-token context, {args.rounds} alternating rounds\n")
    print("| draft | draft step ms (median / best) | share of a target step | acceptance | tokens per round "
          "| draft_target tokens/s (median per prompt) |\n|---|---|---|---|---|---|")
    for v in names:
        t = tot[v]
        print(f"| {v} | {med[v] * 1e3:.2f} / {min(steps[v]) * 1e3:.2f} | {med[v] / med['target']:.3f} | "
              f"{t['accepted'] / max(1, t['proposed']):.3f} | {t['tokens'] / max(1, t['rounds']):.3f} | "
              f"{statistics.median(t['tps']):.1f} |")
    print(f"| target step | {med['target'] * 1e3:.2f} / {min(steps['target']) * 1e3:.2f} | 1 | | | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

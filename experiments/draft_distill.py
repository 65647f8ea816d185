"""Does a short distillation lift the pretrained draft's agreement with the target, and what would it be worth?

    PYTHONPATH=. .venv/bin/python experiments/draft_distill.py build/qwen_coder.yaml [--prompts 20] [--new 128]
        [--data 256] [--seq 192] [--steps 200] [--batch 4] [--lr 2e-5] [--eval-every 50] [--draft-step 0.226]

On the built engines. Training data: the target's own answers (greedy, then sampled at T = 0.8) to the tuning prompts
and build/train_prompts.txt, with its top-32 probabilities at each answer position (pipeline.train.draft's
self_generate, cached in /tmp); never the evaluation prompts. The draft's fp32 source weights (layers, final norm and
its reduced head's rows) are fine-tuned on them with the soft-label loss the small spec's draft trains with. Every
`--eval-every` steps, and at the end, the fp32 draft is teacher-forced along the target's greedy answers to the first
`--prompts` evaluation prompts (experiments/draft_quant.py's positions) and its top-1 agreement printed; at the end the
tuned draft is rounded as the build rounds it (int4, scales searched and weighed by its inputs on the tuning prompts:
W4A8) and its agreement and draft_tree.py's simulated tokens a one-token step printed beside the built draft's.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--data", type=int, default=256, help="training sequences (greedy once per prompt, then sampled)")
    ap.add_argument("--seq", type=int, default=192)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--draft-step", type=float, default=0.226)
    args = ap.parse_args()

    from draft_quant import target_answers, teacher_forced
    from draft_tree import curve, simulate

    from pipeline import spec as specmod
    from pipeline.client import chat_text
    from pipeline.common import setup_threads
    from pipeline.runtime import quant
    from pipeline.runtime.decode import apply_spec, load_bundle
    from pipeline.runtime.generate import Request, generate
    from pipeline.runtime.model import build_model, linear_input_power
    from pipeline.runtime.quant import QLinear
    from pipeline.runtime.speculative import attach_draft_head
    from pipeline.sources import read_prompts, spec_prompts
    from pipeline.train.draft import (
        TEACHER_TOPK,
        forward_train,
        load_source_draft,
        pad,
        self_generate,
        soft_label_loss,
    )

    s = specmod.load(args.spec)
    setup_threads(s)
    b = apply_spec(load_bundle(s.engine_dir, s.device, methods=("baseline", "draft_target")), s)
    tok = b.tokenizer
    evals = [tok.encode(chat_text(tok, p)) for p in spec_prompts(s, args.prompts)]
    answers = target_answers(b, s, evals, args.new)

    tune = [tok.encode(chat_text(tok, p)) for p in read_prompts(s.path(s.draft.train.prompts))]
    general = [tok.encode(chat_text(tok, p)) for p in read_prompts(s.path("build/train_prompts.txt"))]
    train_prompts = tune + general
    data_f = Path(f"/tmp/draft_distill_data_{s.name}_{args.data}_{args.seq}.pt")
    if data_f.is_file():
        data = torch.load(data_f)
    else:
        t0 = time.perf_counter()
        data = self_generate(b.target, train_prompts, args.data, args.seq, tuple(b.end_ids), seed=0)
        torch.save(data, data_f)
        n_tok = sum(len(q) - p for q, p in zip(data["seqs"], data["prompt_lens"]))
        print(f"training data: {args.data} sequences, {n_tok} target tokens in {time.perf_counter() - t0:.0f} s",
              flush=True)

    built = b.draft
    ids = built.vocab_ids
    src, _, _, _ = load_source_draft(s, tok, log=lambda *_: None)
    V = b.target.cfg.vocab_size
    remap = torch.full((V,), -1, dtype=torch.long)
    remap[ids] = torch.arange(len(ids))
    emb = src.embed.weight if src.cfg.tie_embeddings else src.lm_head.weight
    head = torch.nn.Parameter(emb[ids].detach().clone().float())

    eval_tokens = [torch.tensor([p + a]) for p, a in zip(evals, answers)]

    def agree_fp32() -> float:
        hits = []
        with torch.no_grad():
            for p, a, t in zip(evals, answers, eval_tokens):
                h = forward_train(src, t)[0, len(p) - 1:len(p) + len(a) - 1]
                hits += (ids[F.linear(h, head).argmax(-1)] == torch.tensor(a)).tolist()
        return statistics.mean(hits)

    seqs, plens, vals, tids = data["seqs"], data["prompt_lens"], data["vals"], data["ids"]
    S = vals.shape[1]
    tokens = pad(seqs, S)
    lens = torch.tensor([len(q) for q in seqs])
    pos = torch.arange(S)[None]
    mask = (pos >= torch.tensor(plens)[:, None] - 1) & (pos < lens[:, None] - 1)
    print(f"data: {len(seqs)} sequences, {int(mask.sum())} training positions (top-{TEACHER_TOPK} teacher)",
          flush=True)
    print(f"fp32 draft before tuning: top-1 agreement {agree_fp32():.4f}", flush=True)

    params = [p for n, p in src.named_parameters() if n.startswith(("layers.", "norm."))] + [head]
    for p in src.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    warm = max(1, args.steps // 20)
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    losses = []
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        rows = torch.randint(len(seqs), (args.batch,), generator=g)
        m = mask[rows]
        used = int(m.any(0).nonzero().max()) + 2
        h = forward_train(src, tokens[rows, :used])[m[:, :used]]
        loss = soft_label_loss(h, head, vals[rows, :used][m[:, :used]], tids[rows, :used][m[:, :used]], remap)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if (step + 1) % 10 == 0:
            print(f"step {step + 1}: loss {statistics.mean(losses[-10:]):.4f} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            print(f"step {step + 1}: fp32 top-1 agreement {agree_fp32():.4f}", flush=True)
    for p in params:
        p.requires_grad_(False)

    # rounded as the build rounds a pretrained int4_a8 draft: scales weighed by the inputs' mean square on 16 tuning
    # prompts and 128 tokens the (built) draft writes for each
    calib = [p + list(r.tokens) for p, r in zip(tune[:16], generate(built, [Request(p, 128, end_ids=b.end_ids)
                                                                            for p in tune[:16]]))]
    fstate = {k: v.detach().float() for k, v in src.state_dict().items()}
    fm = build_model(src.cfg, dict(fstate), torch.float32, "cpu")
    attach_draft_head(fm, head.detach().clone(), ids)
    power = linear_input_power(fm, calib)
    del fm
    qz, gs = s.draft.quantization, s.draft.group_size
    st = {kk: v for kk, v in fstate.items() if kk != "lm_head.weight"}
    if not src.cfg.tie_embeddings:
        st["lm_head.weight"] = fstate["embed.weight"]  # a placeholder, as the build writes: the reduced head rules
    st = quant.cast_state(quant.quantize_state(st, qz, gs, tie_embeddings=False, importance=power), torch.bfloat16)
    tuned = build_model(src.cfg, st, torch.bfloat16, "cpu", act8=qz == "int4_a8")
    hq = quant.quantize_head(head.detach(), qz, gs, power.get("lm_head"))
    attach_draft_head(tuned, QLinear(hq["qweight"], hq["scales"], act8=qz == "int4_a8"), ids)

    V = curve()
    k, theta = b.spec.k_for("draft_target"), b.spec.draft_confidence
    print(f"\n| draft (step {args.draft_step}) | top-1 agreement | tokens a step (k {k}, {theta}) | tokens a round |"
          "\n|---|---|---|---|")
    for name, m in (("built", built), (f"tuned ({args.steps} steps x {args.batch}, lr {args.lr})", tuned)):
        a, rows = teacher_forced(m, evals, answers, ids)
        rate, per = simulate(rows, args.draft_step, V, k, theta)
        print(f"| {name} | {a:.4f} | {rate:.3f} | {per:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

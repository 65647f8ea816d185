"""How the draft's int4 rounding changes what it proposes: teacher-forced agreement of draft variants with the target.

    PYTHONPATH=. .venv/bin/python experiments/draft_rounding.py build/qwen_coder.yaml --prompts 8 --new 128 \
        --rounding rtn7,rtn8,mse,imse

The target's greedy answers are decoded once (baseline, the built engines); each draft variant then runs prompt +
answer in one forward and its reduced head's argmax at every answer position is compared with the target's token.
That is the chance a one-token draft is accepted (pick-k's accept_pos at k = 1 is the same figure decoded), so
variants of the same bytes compare without decoding (a variant's step costs what its bytes do). `bf16` is the
unquantized draft (the ceiling); `built` the engine as it is. Roundings (int4_a8, group 128, the same kernel):
`rtn7` the build's (q in [-7, 7], scale max|w| / 7), `rtn8` q in [-8, 7] with the largest-magnitude weight at -8 or
7, `mse` the scale from a search of 32 candidates minimising each group's squared error, `imse` the same error
weighted by each input column's mean square activation on the tuning prompts (llama.cpp's importance matrix idea).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def agreement(model, ids: torch.Tensor, seqs: list[tuple[list[int], list[int]]]) -> tuple[int, int, list[int]]:
    """(agreeing positions, positions, run lengths): the draft's argmax against the target's answer tokens."""
    agree = total = 0
    runs: list[int] = []
    with torch.inference_mode():
        for prompt, ans in seqs:
            toks = prompt + ans
            cache = model.new_cache(1, (len(toks) + 64) // 64 * 64)
            t = torch.tensor([toks])
            h = model(t, torch.arange(len(toks))[None], cache)
            lg = model.logits(h[0, len(prompt) - 1:len(toks) - 1])
            pred = ids[lg.argmax(-1)].tolist()
            run = 0
            for p, a in zip(pred, ans):
                agree += p == a
                total += 1
                if p == a:
                    run += 1
                else:
                    runs.append(run)
                    run = 0
            runs.append(run)
    return agree, total, runs


def column_importance(mcfg, rt: dict, seqs: list[list[int]]) -> dict[str, torch.Tensor]:
    """Mean square input per column of every linear layer (fused qkv and gate/up share their input), from the bf16
    draft run in plain torch over `seqs`."""
    from pipeline.runtime import model as modelmod
    from pipeline.runtime.model import build_model

    m = build_model(mcfg, dict(rt), torch.float32, "cpu")
    names = {mod.weight.data_ptr(): name for name, mod in m.named_modules()
             if isinstance(mod, torch.nn.Linear) and name != "lm_head"}
    acc: dict[str, list] = {}
    plain = modelmod.linear

    def record(x, w, *a, **k):  # the layers call model.linear(x, weight): its input is what a column sees
        name = names.get(getattr(w, "data_ptr", lambda: None)())
        if name is not None:
            xf = x.detach().float().reshape(-1, x.shape[-1])
            s = acc.setdefault(name, [torch.zeros(xf.shape[1]), 0])
            s[0] += (xf * xf).sum(0)
            s[1] += xf.shape[0]
        return plain(x, w, *a, **k)

    modelmod.linear = record
    try:
        with torch.no_grad(), torch.enable_grad():  # grad on: the plain torch path, layer by layer
            for toks in seqs:
                cache = m.new_cache(1, (len(toks) + 64) // 64 * 64)
                m(torch.tensor([toks]), torch.arange(len(toks))[None], cache)
    finally:
        modelmod.linear = plain
    if len(acc) != len(names):
        raise SystemExit(f"activations reached {len(acc)} of {len(names)} linear layers: the hook missed some")
    return {n: s / c for n, (s, c) in acc.items()}


def round_int4(w: torch.Tensor, group: int, how: str, imp: torch.Tensor | None = None):
    """(packed, bf16 scales) in the build's int4 layout, rounded by `how` (see the module docstring)."""
    from pipeline.runtime import quant

    if how == "rtn7":
        return quant.quantize_int4(w, group)
    N, K = w.shape
    wf = w.detach().float().view(N, K // group, group)
    weight = (torch.ones_like(wf) if imp is None
              else imp.float().clamp_min(1e-12).view(1, K // group, group).expand_as(wf))
    amax_i = wf.abs().argmax(dim=2, keepdim=True)
    signed = torch.gather(wf, 2, amax_i).squeeze(2)  # the largest-magnitude weight, signed
    if how == "rtn8":
        cands = [signed / -8.0]  # it lands on -8 (q = 7 the other side has half a step more room)
    else:
        cands = [signed / d for d in torch.linspace(-9.0, -6.0, 16).tolist()] + \
                [signed / d for d in torch.linspace(6.0, 7.5, 16).tolist()]
    best_err = torch.full(wf.shape[:2], float("inf"))
    best = torch.ones(wf.shape[:2])
    for c in cands:
        s = c.bfloat16().float()
        s = torch.where(s.abs() > 0, s, torch.ones_like(s))
        q = torch.round(wf / s[..., None]).clamp_(-8, 7)
        err = ((q * s[..., None] - wf) ** 2 * weight).sum(2)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, s, best)
    # the kernel reads w = (u - 8) * scale with a positive or negative bf16 scale alike
    u = (torch.round(wf / best[..., None]).clamp_(-8, 7).to(torch.int16).view(N, K) + 8).to(torch.uint8)
    lo, hi = quant.nibble_columns(K)
    packed = u[:, lo] | (u[:, hi] << 4)
    return packed.contiguous(), best.bfloat16().contiguous()


def variant(mcfg, rt: dict, head: torch.Tensor, ids: torch.Tensor, how: str, group: int,
            imp: dict[str, torch.Tensor] | None):
    from pipeline.runtime import quant
    from pipeline.runtime.model import build_model
    from pipeline.runtime.speculative import attach_draft_head

    if how == "bf16":
        m = build_model(mcfg, dict(rt), torch.bfloat16, "cpu")
        return attach_draft_head(m, head.to(torch.bfloat16), ids)
    state = {}
    for k, v in rt.items():
        if quant.LINEAR.match(k):
            name = k[: -len(".weight")]
            q, s = round_int4(v, group, how, imp.get(name) if imp else None)
            state[name + ".qweight"], state[name + ".scales"] = q, s
        else:
            state[k] = v
    if "lm_head.weight" not in rt:
        state["lm_head.qweight"], state["lm_head.scales"] = round_int4(rt["embed.weight"], group, how)
    m = build_model(mcfg, state, torch.bfloat16, "cpu", act8=True)
    hq, hs = round_int4(head, group, how)  # the head: no importance (its input is the final norm's, not hooked)
    return attach_draft_head(m, quant.QLinear(hq, hs, act8=True), ids)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec")
    ap.add_argument("--rounding", default="rtn7,rtn8,mse,imse")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompts-file", default="")
    ap.add_argument("--calib-file", default="build/code_tune_prompts.txt", help="prompts for imse's importance")
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()

    from pipeline import sources
    from pipeline import spec as specmod
    from pipeline.client import chat_text
    from pipeline.common import setup_threads
    from pipeline.runtime.decode import apply_spec, decode, load_bundle
    from pipeline.runtime.generate import Request
    from pipeline.runtime.model import ModelConfig, hf_to_runtime
    from pipeline.sources import read_prompts, spec_prompts

    s = specmod.load(args.spec)
    setup_threads(s)
    b = apply_spec(load_bundle(s.engine_dir, s.device, methods=("baseline", "draft_target")), s)
    texts = read_prompts(Path(args.prompts_file)) if args.prompts_file else spec_prompts(s)
    texts = texts[:args.prompts] if args.prompts else texts
    seqs = []
    t0 = time.perf_counter()
    for p in texts:
        ids = b.tokenizer.encode(chat_text(b.tokenizer, p))
        r = decode(b, "baseline", [Request(prompt=ids, max_new_tokens=args.new, end_ids=b.end_ids)])[0]
        seqs.append((ids, list(r.tokens)))
    print(f"{len(seqs)} target answers, {sum(len(a) for _, a in seqs)} tokens ({time.perf_counter() - t0:.0f} s)",
          flush=True)
    built, vids = b.draft, b.draft.vocab_ids
    hf_cfg, state, _ = sources.load_hf(sources.resolve(s.draft.source, Path(s.root), key="draft.source"))
    mcfg = ModelConfig.from_hf(hf_cfg)
    rt = hf_to_runtime(state, mcfg)
    del state
    head = rt.get("lm_head.weight", rt["embed.weight"])[vids].float()
    hows = [h for h in args.rounding.split(",") if h]
    imp = None
    if "imse" in hows:
        calib = [b.tokenizer.encode(chat_text(b.tokenizer, p)) for p in read_prompts(ROOT / args.calib_file)]
        t0 = time.perf_counter()
        imp = column_importance(mcfg, rt, calib)
        print(f"importance from {len(calib)} prompts ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows = []
    for how in ["built", *hows]:
        t0 = time.perf_counter()
        m = built if how == "built" else variant(mcfg, rt, head, vids, "mse" if how == "imse" else how, args.group,
                                                  imp if how == "imse" else None)
        a, n, runs = agreement(m, m.vocab_ids, seqs)
        mean_run = sum(runs) / len(runs)
        rows.append((how, a / n, mean_run))
        print(f"{how}: agreement {a / n:.4f} ({a}/{n}), mean accepted run {mean_run:.2f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        if how != "built":
            del m
    print("\n| draft rounding | agreement with the target | mean run |\n|---|---|---|")
    for how, ag, mr in rows:
        print(f"| {how} | {ag:.4f} | {mr:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

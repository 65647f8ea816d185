"""How much acceptance does the draft's int4 rounding cost, and does a better rounding buy it back?

    PYTHONPATH=. .venv/bin/python experiments/draft_quant.py build/qwen_coder.yaml [--prompts 20] [--new 128]
        [--calib 16] [--variants fp32,built,nearest,searched,weighted,gptq,mix3_4,skip1,sp40-a-1@0.148]
        [--time 12 --rounds 2]

On the built engines: the target's greedy answers to the evaluation prompts (decoded once, cached in /tmp), then for
each variant of the draft (its source weights as loaded, fp32; the built engine; int4 rounded to nearest as before
2026-12-06; quant.quantize_int4's searched scales, plain or weighed by the inputs' mean square; GPTQ; `mixB_C`: B-bit
MLP and C-bit other layers in fp32, an estimate for formats no kernel reads; `skipN`: the built draft without its N
least influential layers by ShortGPT's block influence, 1 - cos(a layer's input, its output), on the calibration
positions: fewer bytes a step, no retraining; `sp<P>-<parts>-<G>`: the built draft with P% of some linear layers'
input columns zeroed on every token row, in blocks of G columns, the smallest first: activation sparsity, which a
kernel could turn into fewer bytes read, see experiments/skip_stream.c) the draft runs prompt + answer
teacher-forced over its reduced head, and
the script prints its top-1 agreement with the target and draft_tree.py's simulated tokens a one-token step
(at --draft-step, or at the step a variant names after `@`: `sp40-a-1@0.148` costs the draft 0.148 target steps). Every
int4 variant is the same format (int4, bf16 scale per 128 columns, W4A8 kernel): only the rounding differs. The
calibration activations come from the draft's own answers to the tuning prompts (never the evaluation prompts).
`--time N`: draft_target decoded on N evaluation prompts, one request at a time, with each int4 variant, alternating
prompt by prompt, answers asserted equal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def full_inputs(model, seqs: list[list[int]]) -> dict[int, torch.Tensor]:
    """X^T X of every linear layer's input (keyed by its weight's data_ptr), over all positions of `seqs`, in the
    torch path of the fp32 model: GPTQ's matrix. Its diagonal alone is model.linear_input_power (the build's)."""
    from pipeline.runtime import model as mm

    H: dict[int, torch.Tensor] = {}
    orig = mm.linear

    def spy(x, w):
        x2 = x.reshape(-1, x.shape[-1]).double()
        h = H.get(w.data_ptr())
        H[w.data_ptr()] = x2.T @ x2 if h is None else h + x2.T @ x2
        return orig(x, w)

    mm.linear = spy
    try:
        with torch.enable_grad():  # the torch path (kernels.fast_path is off under grad), weights need no grad
            for s in seqs:
                cache = model.new_cache(1, (len(s) + 64) // 64 * 64)
                h = model(torch.tensor([s]), torch.arange(len(s))[None], cache)
                model.logits(h)
    finally:
        mm.linear = orig
    return H


def target_answers(b, s, prompts: list[list[int]], new: int) -> list[list[int]]:
    """The target's greedy answers to `prompts` (cached in /tmp by spec, prompt count and length): the positions every
    draft variant is teacher-forced along."""
    from pipeline.runtime.decode import decode
    from pipeline.runtime.generate import Request

    cache_f = Path(f"/tmp/draft_quant_answers_{s.name}_{len(prompts)}_{new}.pt")
    if cache_f.is_file():
        return torch.load(cache_f)
    t0 = time.perf_counter()
    answers = [list(r.tokens) for r in decode(b, "baseline", [Request(prompt=p, max_new_tokens=new, end_ids=b.end_ids)
                                                               for p in prompts])]
    torch.save(answers, cache_f)
    print(f"target answers: {sum(map(len, answers))} tokens in {time.perf_counter() - t0:.0f} s", flush=True)
    return answers


def teacher_forced(m, prompts: list[list[int]], answers: list[list[int]], ids: torch.Tensor) -> tuple[float, list]:
    """A draft run along prompt + answer in one forward over its reduced head (`ids`): its top-1 agreement with the
    target, and per answer its top-4 and their probabilities (draft_tree.simulate's input)."""
    data = []
    with torch.inference_mode():
        for pr, ans in zip(prompts, answers):
            toks = pr + ans
            cache = m.new_cache(1, (len(toks) + 64) // 64 * 64)
            h = m(torch.tensor([toks]), torch.arange(len(toks))[None], cache)
            top = torch.softmax(m.logits(h[0, len(pr) - 1:len(toks) - 1]).float(), -1).topk(4, -1)
            data.append({"target": ans, "top": ids[top.indices].tolist(), "prob": top.values.tolist()})
    agree = [p[0] == t for d in data for p, t in zip(d["top"], d["target"])]
    return statistics.mean(agree), data


def gptq_int4(w: torch.Tensor, gs: int, H: torch.Tensor, damp: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """quant.quantize_int4's format with GPTQ's rounding (Frantar et al., 2022): columns rounded in order, each one's
    error spread over the columns not yet rounded through the inverse of H = X^T X; a group's scale searched
    (diag(H) weighted) when its first column comes up. Kept here: it agreed less than the weighted search."""
    from pipeline.runtime import quant

    N, K = w.shape
    W, H = w.float().clone(), H.double().clone()
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H.diagonal().add_(damp * torch.diagonal(H).mean())
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).float()
    hdiag = torch.diagonal(H).float()
    u, scales = torch.empty(N, K, dtype=torch.uint8), torch.empty(N, K // gs)
    for g, i1 in enumerate(range(0, K, gs)):
        W1, E1, Hi = W[:, i1:i1 + gs].clone(), torch.empty(N, gs), Hinv[i1:i1 + gs, i1:i1 + gs]
        sc = quant._search_scales(W1[:, None, :], hdiag[i1:i1 + gs].view(1, 1, -1))[:, 0]
        scales[:, g] = sc
        for i in range(gs):
            q = torch.round(W1[:, i] / sc).clamp_(-8, 7)
            u[:, i1 + i] = (q + 8).to(torch.uint8)
            err = (W1[:, i] - q * sc) / Hi[i, i]
            W1[:, i:] -= err[:, None] * Hi[i, i:][None, :]
            E1[:, i] = err
        W[:, i1 + gs:] -= E1 @ Hinv[i1:i1 + gs, i1 + gs:]
    return quant._pack4(u), scales.bfloat16()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--calib", type=int, default=16, help="tuning prompts whose draft answers calibrate GPTQ")
    ap.add_argument("--variants", default="fp32,built,nearest,searched,weighted,gptq")
    ap.add_argument("--time", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--draft-step", type=float, default=0.234)
    args = ap.parse_args()

    from draft_tree import curve, simulate

    from pipeline import spec as specmod
    from pipeline.client import chat_text
    from pipeline.common import setup_threads
    from pipeline.runtime import quant
    from pipeline.runtime.decode import apply_spec, decode, load_bundle
    from pipeline.runtime.generate import Request, generate
    from pipeline.runtime.model import build_model, linear_input_power
    from pipeline.runtime.quant import QLinear
    from pipeline.runtime.speculative import attach_draft_head
    from pipeline.sources import read_prompts, spec_prompts
    from pipeline.train.draft import load_source_draft

    s = specmod.load(args.spec)
    setup_threads(s)
    b = apply_spec(load_bundle(s.engine_dir, s.device, methods=("baseline", "draft_target")), s)
    tok = b.tokenizer
    prompts = [tok.encode(chat_text(tok, p)) for p in spec_prompts(s, args.prompts)]
    answers = target_answers(b, s, prompts, args.new)

    built = b.draft
    ids = built.vocab_ids
    src, _, _, _ = load_source_draft(s, tok, log=lambda *_: None)
    src.eval()
    fstate = {k: v.float() for k, v in src.state_dict().items()}
    head_f = fstate["embed.weight" if src.cfg.tie_embeddings else "lm_head.weight"][ids].contiguous()
    gs = s.draft.group_size

    calib = []
    Hs: dict[str, torch.Tensor] = {}  # GPTQ's X^T X by layer
    power: dict[str, torch.Tensor] = {}  # the inputs' mean square by layer, as the draft build weighs its rounding
    if any(v in ("weighted", "gptq") or v.startswith(("mix", "skip")) for v in args.variants.split(",")):
        tune = read_prompts(s.path(s.draft.train.prompts))[:args.calib]
        tids = [tok.encode(chat_text(tok, p)) for p in tune]
        t0 = time.perf_counter()
        outs = generate(built, [Request(p, args.new, end_ids=b.end_ids) for p in tids])
        calib = [p + list(r.tokens) for p, r in zip(tids, outs)]
        print(f"calibration: {len(calib)} tuning prompts, {sum(map(len, calib))} positions "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        fm = build_model(src.cfg, {k: v for k, v in fstate.items()}, torch.float32, "cpu")
        attach_draft_head(fm, head_f.clone(), ids)
        power = linear_input_power(fm, calib)
        if "gptq" in args.variants.split(","):
            by_ptr = full_inputs(fm, calib)
            for name, mod in fm.named_modules():
                w = getattr(mod, "weight", None)
                if w is not None and w.data_ptr() in by_ptr:
                    Hs[name] = by_ptr[w.data_ptr()]
        print(f"calibrated {len(power)} layers ({time.perf_counter() - t0:.0f} s)", flush=True)
        del fm

    def int4_model(how: str):
        st = {}
        t0 = time.perf_counter()
        for k, v in fstate.items():
            if quant.LINEAR.match(k) and not k.startswith("lm_head"):
                name = k[: -len(".weight")]
                st[name + ".qweight"], st[name + ".scales"] = quant_variant(v, how, gs, name)
            elif k != "lm_head.weight":
                st[k] = v
        if not src.cfg.tie_embeddings:
            st["lm_head.weight"] = fstate["embed.weight"]  # a placeholder: the reduced head replaces it below
        hq, hs = quant_variant(head_f, how, gs, "lm_head")
        print(f"  {how}: quantized in {time.perf_counter() - t0:.0f} s", flush=True)
        st = quant.cast_state(st, torch.bfloat16)
        m = build_model(src.cfg, st, torch.bfloat16, "cpu", act8=True)
        attach_draft_head(m, QLinear(hq, hs, act8=True), ids)
        return m

    def fake_bits(w, bits, gs, imp):
        """w rounded to `bits`-bit integers (levels -2^(b-1) .. 2^(b-1) - 1) with scales searched by
        quant._search_scales, dequantized back to fp32: an estimate for a format no kernel reads yet."""
        N, K = w.shape
        lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        wg = w.float().view(N, K // gs, gs)
        ig = None if imp is None else imp.float().view(1, K // gs, gs)
        best = quant._search_scales(wg, ig, lo, hi)
        return (torch.round(wg / best[..., None]).clamp_(lo, hi) * best[..., None]).view(N, K)

    def skipped_model(n: int):
        """The built draft without its n least influential layers (block influence on the calibration positions,
        through the torch path where each layer's input and output can be seen)."""
        import copy

        layers = list(built.layers)
        cos = [[] for _ in layers]

        def seen(i):
            def hook(mod, inp, out):
                x, y = inp[0].float().reshape(-1, inp[0].shape[-1]), out.float().reshape(-1, out.shape[-1])
                cos[i].append(float(torch.nn.functional.cosine_similarity(x, y, -1).mean()))
            return hook

        hooks = [layer.register_forward_hook(seen(i)) for i, layer in enumerate(layers)]
        try:
            with torch.enable_grad():  # the torch path (kernels.fast_path is off under grad)
                for t in calib:
                    built(torch.tensor([t]), torch.arange(len(t))[None], built.new_cache(1, (len(t) + 64) // 64 * 64))
        finally:
            for h in hooks:
                h.remove()
        influence = [1 - statistics.mean(c) for c in cos]
        drop = set(sorted(range(len(layers)), key=lambda i: influence[i])[:n])
        print(f"skip{n}: layers {sorted(drop)} (block influence {[round(influence[i], 3) for i in sorted(drop)]}; "
              f"the least of all {min(influence):.3f}, the most {max(influence):.3f})", flush=True)
        m = copy.copy(built)
        m._modules = dict(built._modules)  # its own module table: the built draft keeps all its layers
        m.__dict__.pop("_plans", None)  # the fused step's layer plans, rebuilt for the layers kept
        m.layers = torch.nn.ModuleList([layer for i, layer in enumerate(layers) if i not in drop])
        return m

    def sparse_model(v: str):
        """`sp<P>-<parts>-<G>`: the built draft with P% of the input columns of some linear layers (parts: d = the
        MLP's down projection, g = gate/up, m = gate/up and down, a = every layer's four) zeroed on each token row, in
        blocks of G columns, the blocks of least L2 norm: activation sparsity (TEAL, CATS), so a kernel could skip the
        weight bytes those columns multiply. Run through the torch path, where model.linear can be wrapped."""
        from pipeline.runtime import model as mm

        pct, parts, g = v[2:].split("-")
        frac, g = int(pct) / 100, int(g)
        names = {"d": ("w2",), "g": ("w13",), "m": ("w13", "w2"), "a": ("wqkv", "wo", "w13", "w2")}[parts]
        sparse_ids = {id(mm.wt(getattr(layer, n))) for layer in built.layers for n in names}
        orig = mm.linear

        def sparse_linear(x, w):
            if id(w) in sparse_ids:
                K = x.shape[-1]
                xb = x.reshape(-1, K // g, g)
                norm = xb.float().square().sum(-1)
                drop = int(round(frac * (K // g)))
                if drop:
                    idx = norm.topk(drop, -1, largest=False).indices
                    xb = xb.clone()
                    xb.scatter_(1, idx[..., None].expand(-1, -1, g), 0)
                x = xb.reshape(x.shape)
            return orig(x, w)

        class Wrapped:
            def __init__(self, m):
                self.m = m

            def __call__(self, *a, **kw):
                mm.linear, mm._observer = sparse_linear, (lambda x, w: None)
                try:
                    return self.m(*a, **kw)
                finally:
                    mm.linear, mm._observer = orig, None

            def __getattr__(self, name):
                return getattr(self.m, name)

        return Wrapped(built)

    def mixed_model(bits_mlp: int, bits_rest: int):
        st = {}
        for k, v in fstate.items():
            if quant.LINEAR.match(k) and not k.startswith("lm_head"):
                name = k[: -len(".weight")]
                st[k] = fake_bits(v, bits_mlp if (".w13." in k or ".w2." in k) else bits_rest, gs, power.get(name))
            elif k != "lm_head.weight":
                st[k] = v
        if not src.cfg.tie_embeddings:
            st["lm_head.weight"] = fstate["lm_head.weight"]
        m = build_model(src.cfg, st, torch.float32, "cpu")
        attach_draft_head(m, fake_bits(head_f, bits_rest, gs, power.get("lm_head")), ids)
        return m

    def quant_variant(w, how, gs, name):
        if how == "nearest":  # the rounding before 2026-12-06: scale = largest |w| / 7, q in [-7, 7]
            wg = w.float().view(w.shape[0], -1, gs)
            sc = (wg.abs().amax(2) / 7).bfloat16().float()
            sc = torch.where(sc > 0, sc, torch.ones_like(sc))
            u = (torch.round(wg / sc[..., None]).clamp_(-7, 7).view(w.shape) + 8).to(torch.uint8)
            return quant._pack4(u), sc.bfloat16()
        if how == "searched":  # quant.quantize_int4 without calibration
            return quant.quantize_int4(w, gs)
        if how == "weighted":  # quant.quantize_int4 weighed by the inputs' mean square (as the draft build does)
            return quant.quantize_int4(w, gs, power.get(name))
        if how == "gptq":
            return gptq_int4(w, gs, Hs[name])
        raise ValueError(how)

    V = curve()
    k, theta = b.spec.k_for("draft_target"), b.spec.draft_confidence
    models = {}
    print(f"\n| draft | top-1 agreement | tokens a step (k {k}, {theta}) | tokens a round |\n|---|---|---|---|")
    for v in args.variants.split(","):
        v, _, step = v.partition("@")  # `variant@0.2`: simulated at that draft step (fewer bytes read)
        step = float(step) if step else args.draft_step
        if v == "built":
            m = built
        elif v.startswith("mix"):
            m = mixed_model(int(v[3]), int(v[5]))
        elif v.startswith("skip"):
            m = skipped_model(int(v[4:]))
        elif v.startswith("sp"):
            m = sparse_model(v)
        elif v == "fp32":
            st = {kk: vv for kk, vv in fstate.items() if kk != "lm_head.weight"}
            if not src.cfg.tie_embeddings:
                st["lm_head.weight"] = fstate["lm_head.weight"]
            m = build_model(src.cfg, st, torch.float32, "cpu")
            attach_draft_head(m, head_f.clone(), ids)
        else:
            m = int4_model(v)
        a, data = teacher_forced(m, prompts, answers, ids)
        rate, per = simulate(data, step, V, k, theta)
        print(f"| {v} (draft step {step}) | {a:.4f} | {rate:.3f} | {per:.2f} |", flush=True)
        if v != "fp32" and not v.startswith("sp"):  # a sparse variant runs the torch path: its time means nothing
            models[v] = m
    if args.time:
        # one request at a time, as validate sends them; variants alternate prompt by prompt, order flipped each round
        tim = {v: [[] for _ in range(args.time)] for v in models}
        for r in range(args.rounds):
            for i, p in enumerate(prompts[:args.time]):
                for v in (list(models) if (r + i) % 2 == 0 else list(reversed(models))):
                    b.draft = models[v]
                    t0 = time.perf_counter()
                    out = decode(b, "draft_target", [Request(prompt=p, max_new_tokens=args.new, end_ids=b.end_ids)])
                    tim[v][i].append(time.perf_counter() - t0)
                    assert list(out[0].tokens) == answers[i], v
        first = list(models)[0]
        best = {v: [min(t) for t in ts] for v, ts in tim.items()}
        for v in models:
            ratio = statistics.median(a / b_ for a, b_ in zip(best[first], best[v]))
            print(f"{v}: {sum(best[v]):.2f} s for {args.time} prompts (best of {args.rounds}); {first} time / {v} "
                  f"time per prompt, median {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Old kernel against new kernel, side by side in one process, on the real qwen_coder engines.

The old skinny.c is read from git (`--old-rev`, default the commit before the bf16 dot-product
kernel), compiled next to the current one, and the runtime's kernel library is swapped between the
two before every timed call, so both see the same machine load. Reported:

- the bf16 target's forward + logits for 1..8 token rows after a 64-token context: threads=2 wall
  time (median and min of the reps) and threads=1 CPU time (median);
- the one-token step of the target quantized in-process to int8 and int4 (group 128, from the bf16
  engine weights, as precision.py does) and of the draft as built (int8, reduced head) and as int4
  (quantized from draft_hf), old and new kernel (the old kernel gets int4 weights in its own layout);
- greedy agreement of the bf16 target, new kernel against old, on a few coding prompts.

    .venv/bin/python experiments/kernel_ab.py --engines /work/main/engines/qwen_coder
    .venv/bin/python experiments/kernel_ab.py --engines ... --skip-quant --tokens 32   # quicker
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.runtime import kernels, quant  # noqa: E402
from pipeline.runtime.model import ModelConfig, build_model  # noqa: E402

PROMPTS = ["def quicksort(arr):\n    \"\"\"Sort a list of integers.\"\"\"\n",
           "# Python: read a CSV file and print the average of the 'price' column\nimport csv\n",
           "class LRUCache:\n    def __init__(self, capacity: int):\n"]
OLD_LO = torch.tensor([4 * (b % 4) + b // 4 for b in range(16)])  # the qlinear/2 int4 byte order


def compile_lib(src: Path, flags: list[str]) -> ctypes.CDLL:
    so = Path(tempfile.mkdtemp()) / "skinny.so"
    subprocess.run(["gcc", "-O3", *flags, "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    return kernels.bind(so)


def use(lib) -> None:
    kernels._lib = lib


def to_old_int4(state: dict) -> dict:
    """int4 qweights repacked from the current layout into the old one (values unchanged)."""
    out = dict(state)
    for k, v in state.items():
        if k.endswith(".qweight") and v.dtype == torch.uint8:
            n, half = v.shape
            u = quant.unpack_int4(v).view(n, half // 16, 32)
            out[k] = (u[..., OLD_LO] | (u[..., OLD_LO + 16] << 4)).reshape(n, half).contiguous()
    return out


@torch.inference_mode()
def step_timer(model, n: int, context: int = 64):
    cache = model.new_cache(1, context + n + 2)
    model(torch.zeros(1, context, dtype=torch.long), torch.arange(context)[None], cache)
    tok, pos = torch.zeros(1, n, dtype=torch.long), context + torch.arange(n)[None]

    @torch.inference_mode()
    def run():
        model.logits(model(tok, pos, cache))
    return run


def ab(fns: dict, libs: dict, reps: int, clock) -> dict:
    """{(name, lib): [seconds]} timing every fn with every lib, interleaved, after one warm-up round."""
    out: dict = {}
    for r in range(reps + 1):
        for name, fn in fns.items():
            for lname, lib in libs.items():
                use(lib)
                t = clock()
                fn()
                if r:
                    out.setdefault((name, lname), []).append(clock() - t)
    return out


def both(fns: dict, libs: dict, reps: int) -> dict:
    """{"cpu1": (old, new), "wall2": (old, new)} seconds of fns["old"] with the old library and fns["new"] with
    the new one: threads=1 CPU time, then threads=2 wall time, interleaved."""
    out = {}
    for clock, nt, fn in (("cpu1", 1, time.process_time), ("wall2", 2, time.perf_counter)):
        kernels.configure_threads(nt)
        res: dict = {"old": [], "new": []}
        for r in range(reps + 1):
            for lname in ("old", "new"):
                use(libs[lname])
                t = fn()
                fns[lname]()
                if r:
                    res[lname].append(fn() - t)
        out[clock] = (res["old"], res["new"])
    kernels.configure_threads(2)
    return out


def med(v):
    return statistics.median(v) * 1e3


@torch.inference_mode()
def greedy(model, ids: list[int], n: int) -> list[int]:
    cache = model.new_cache(1, len(ids) + n + 1)
    h = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache)
    out = []
    tok = int(model.logits(h[:, -1]).argmax(-1))
    for i in range(n):
        out.append(tok)
        h = model(torch.tensor([[tok]]), torch.tensor([[len(ids) + i]]), cache)
        tok = int(model.logits(h[:, -1]).argmax(-1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=Path, default=ROOT / "engines" / "qwen_coder")
    ap.add_argument("--old-rev", default="1c1d0f3")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rows", default="1,2,3,4,5,6,8")
    ap.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt for the agreement check")
    ap.add_argument("--skip-quant", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from safetensors.torch import load_file

    from pipeline.runtime.engine_io import load_tokenizer, read_config
    from pipeline.runtime.speculative import attach_draft_head, load_draft

    assert kernels.path() == "avx512", f"kernel path {kernels.path()}: this A/B needs the AVX-512 build"
    old_src = Path(tempfile.mkdtemp()) / "skinny_old.c"
    old_src.write_text(subprocess.run(["git", "show", f"{args.old_rev}:pipeline/runtime/skinny.c"], cwd=ROOT,
                                      capture_output=True, text=True, check=True).stdout)
    old_flags = [f for f in kernels.ISA_FLAGS["avx512"] if f != "-mavx512bf16"]
    libs = {"old": compile_lib(old_src, old_flags), "new": compile_lib(kernels.SRC, kernels.ISA_FLAGS["avx512"])}
    rows = [int(r) for r in args.rows.split(",")]
    report: dict = {}

    tdir = args.engines / "target"
    cfg = read_config(tdir, verify=False)
    mcfg = ModelConfig(**cfg["runtime"]["model"])
    state = load_file(str(tdir / "model.safetensors"))
    target = build_model(mcfg, state, torch.bfloat16, "cpu")

    # 1. bf16 verify cost curve
    fns = {n: step_timer(target, n) for n in rows}
    kernels.configure_threads(2)
    wall = ab(fns, libs, args.reps, time.perf_counter)
    kernels.configure_threads(1)
    cpu = ab(fns, libs, max(2, args.reps // 2), time.process_time)
    kernels.configure_threads(2)
    print("bf16 target forward+logits, ms (threads=2 wall median [min]; threads=1 CPU median)")
    print(f"{'rows':>4} {'old t2':>14} {'new t2':>14} {'new/old':>7} {'old t1cpu':>9} {'new t1cpu':>9} {'new/old':>7}")
    report["bf16_verify"] = {}
    for n in rows:
        ow, nw, oc, nc = wall[n, "old"], wall[n, "new"], cpu[n, "old"], cpu[n, "new"]
        print(f"{n:>4} {med(ow):7.1f} [{min(ow) * 1e3:5.1f}] {med(nw):7.1f} [{min(nw) * 1e3:5.1f}] "
              f"{med(nw) / med(ow):7.2f} {med(oc):9.1f} {med(nc):9.1f} {med(nc) / med(oc):7.2f}", flush=True)
        report["bf16_verify"][n] = {"old_t2_ms": med(ow), "new_t2_ms": med(nw), "old_t1_cpu_ms": med(oc),
                                    "new_t1_cpu_ms": med(nc)}

    # 2. greedy agreement bf16, new vs old
    tok = load_tokenizer(tdir)
    agree = []
    for p in PROMPTS:
        ids = tok(p)["input_ids"]
        use(libs["old"])
        a = greedy(target, ids, args.tokens)
        use(libs["new"])
        b = greedy(target, ids, args.tokens)
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        same = sum(x == y for x, y in zip(a, b))
        agree.append({"prompt": p[:30], "identical_prefix": first, "positionwise_equal": same, "tokens": len(a)})
        print(f"greedy {p[:30]!r}: identical for the first {first}/{len(a)} tokens, {same}/{len(a)} positions equal",
              flush=True)
    report["greedy_agreement"] = agree
    t1 = step_timer(target, 1)

    # 3. one-token steps of quantized targets and drafts
    steps = {("target", "bf16"): both({"old": t1, "new": t1}, libs, args.reps)}
    if not args.skip_quant:
        del target, fns, t1
        gc.collect()
        for algo in ("int8", "int4"):
            qs = quant.quantize_state(state, algo, 128, tie_embeddings=mcfg.tie_embeddings)
            new_m = build_model(mcfg, qs, torch.bfloat16, "cpu")
            old_m = build_model(mcfg, to_old_int4(qs), torch.bfloat16, "cpu") if algo == "int4" else new_m
            del qs
            steps["target", algo] = both({"old": step_timer(old_m, 1), "new": step_timer(new_m, 1)}, libs, args.reps)
            del new_m, old_m
            gc.collect()
        del state
        gc.collect()
        ddir = args.engines / "draft"
        draft8, _ = load_draft(ddir, verify=False)
        f8 = step_timer(draft8, 1)
        steps["draft", "int8"] = both({"old": f8, "new": f8}, libs, args.reps)
        ids, head8 = draft8.vocab_ids, draft8.lm_head
        dcfg = draft8.cfg
        del draft8, f8
        gc.collect()
        from pipeline import sources
        from pipeline.runtime.model import hf_to_runtime

        _, hf_state, _ = sources.load_hf(sources.resolve(str(args.engines / "draft_hf"), args.engines))
        dstate = hf_to_runtime(hf_state, dcfg)
        del hf_state
        dstate = {k: v.bfloat16() for k, v in dstate.items()}
        if dcfg.tie_embeddings:
            dstate.pop("lm_head.weight", None)
        q4 = quant.quantize_state(dstate, "int4", 128, tie_embeddings=dcfg.tie_embeddings)
        hq, hs = quant.quantize(dstate["embed.weight"][ids].float(), "int4", 128)
        models = {}
        for lname, st in (("new", q4), ("old", to_old_int4(q4))):
            m = build_model(dcfg, st, torch.bfloat16, "cpu")
            h = {"h.qweight": hq, "h.scales": hs}
            h = to_old_int4(h) if lname == "old" else h
            attach_draft_head(m, quant.QLinear(h["h.qweight"], h["h.scales"]), ids)
            models[lname] = step_timer(m, 1)
        del head8
        steps["draft", "int4"] = both(models, libs, args.reps)
    print("one-token step (forward + logits), ms: threads=1 CPU median; threads=2 wall median [min]")
    report["one_token_step"] = {}
    for clock in ("cpu1", "wall2"):
        tb_old, tb_new = med(steps["target", "bf16"][clock][0]), med(steps["target", "bf16"][clock][1])
        for (who, prec), d in steps.items():
            o, n = d[clock]
            print(f"{clock} {who:>6} {prec:>5}: old {med(o):7.1f} [{min(o) * 1e3:6.1f}]  new {med(n):7.1f} "
                  f"[{min(n) * 1e3:6.1f}]  new/old {med(n) / med(o):.2f}  / bf16 target of the same kernel: "
                  f"old {med(o) / tb_old:.3f} new {med(n) / tb_new:.3f}", flush=True)
            report["one_token_step"][f"{clock}_{who}_{prec}"] = {"old_ms": med(o), "new_ms": med(n)}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

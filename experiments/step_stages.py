"""Where a one-token step of the spec's target goes, stage by stage, against the memory's speed of the minute (issue 53,
item 4). A copy of the kernels with timers around decoder_layer's six stages (q/k/v, RoPE, attention, o, gate/up,
down) is compiled beside the real one and swapped in; each round is a bandwidth probe, 7 one-token steps at a
128-token context (the best of the last 5 kept), and another probe, so a stage's GB/s can be read against the probes
around it. With `--against DIR` a second checkout's kernels (same timers) take alternate turns, for a paired A/B:
its stage and step times over this checkout's, round by round.

    PYTHONPATH=. .venv/bin/python experiments/step_stages.py build/qwen_coder.yaml [--rounds 16] [--against DIR] \
        [--model draft]

The rounds are grouped by the probes: "usual" below 45 GB/s, "fast" from 45 (this VM's memory has both modes,
docs/gguf_weights.md). The timers read CLOCK_MONOTONIC around each stage (about 0.1 us each, 168 a step).
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pipeline import spec as specmod
from pipeline.bench import measure_bandwidth_gbs
from pipeline.common import setup_threads
from pipeline.runtime import kernels
from pipeline.runtime.decode import load_bundle
from pipeline.runtime.quant import weight_bytes

STAGES = ("qkv", "rope", "attention", "o", "gate/up", "down")
# decoder_layer's body as skinny.c has it (compared without regard to whitespace; the script stops with a message when
# it has changed), from its first line to the first scratch_done after it.
BODY = """    if (qkv && q && o && h &&
        !(rc = fused_linear(x, L->attn_norm, L->eps, L->qkv.w, L->qkv.sc, qkv, T, H, L->qkv.N, threads, L->qkv.wt,
                            L->qkv.gs, 1, 0))) {
        rope_write(qkv, L->bias, pos, slots, cos_t, sin_t, q, kc, vc, B, S, L->hq, L->hkv, L->d, cache_len);
        if (!(rc = attention(q, kc, vc, mask, slots, o, B, S, L->hq, L->hkv, L->d, cache_len, kv_len, L->scale,
                             threads)) &&
            !(rc = fused_linear(o, NULL, 0.f, L->o.w, L->o.sc, x, T, L->o.K, L->o.N, threads, L->o.wt, L->o.gs, 0,
                                1)) &&
            !(rc = fused_linear(x, L->ffn_norm, L->eps, L->up.w, L->up.sc, h, T, H, L->up.N, threads, L->up.wt,
                                L->up.gs, 1, 0)))
            rc = fused_linear(h, NULL, 0.f, L->down.w, L->down.sc, x, T, L->down.K, L->down.N, threads, L->down.wt,
                              L->down.gs, 2, 1);
    }"""
TIMED = """    double t0 = st_now(), t1;
#define ST(i) (t1 = st_now(), st_acc[i] += t1 - t0, t0 = t1)
    if (qkv && q && o && h &&
        !(rc = fused_linear(x, L->attn_norm, L->eps, L->qkv.w, L->qkv.sc, qkv, T, H, L->qkv.N, threads, L->qkv.wt,
                            L->qkv.gs, 1, 0))) {
        ST(0);
        rope_write(qkv, L->bias, pos, slots, cos_t, sin_t, q, kc, vc, B, S, L->hq, L->hkv, L->d, cache_len);
        ST(1);
        rc = attention(q, kc, vc, mask, slots, o, B, S, L->hq, L->hkv, L->d, cache_len, kv_len, L->scale, threads);
        ST(2);
        if (!rc) rc = fused_linear(o, NULL, 0.f, L->o.w, L->o.sc, x, T, L->o.K, L->o.N, threads, L->o.wt, L->o.gs, 0,
                                   1);
        ST(3);
        if (!rc) rc = fused_linear(x, L->ffn_norm, L->eps, L->up.w, L->up.sc, h, T, H, L->up.N, threads, L->up.wt,
                                   L->up.gs, 1, 0);
        ST(4);
        if (!rc) rc = fused_linear(h, NULL, 0.f, L->down.w, L->down.sc, x, T, L->down.K, L->down.N, threads,
                                   L->down.wt, L->down.gs, 2, 1);
        ST(5);
    }
#undef ST"""
TIMERS = """
static double st_acc[8];
static inline double st_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
void st_read(double *out) { for (int i = 0; i < 8; i++) out[i] = st_acc[i], st_acc[i] = 0; }
"""


def timed_library(runtime: Path, out: Path) -> ctypes.CDLL:
    """skinny.c of `runtime` (a pipeline/runtime directory) with stage timers, compiled as kernels compiles it."""
    src = out / "runtime"
    shutil.copytree(runtime, src, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    c = (src / "skinny.c").read_text()
    anchor, first, last = "int decoder_layer(", BODY.split("\n")[0], "    scratch_done(qkv, o1);"
    start = c.find(first, c.find(anchor))
    end = c.find(last, start)
    if min(c.find(anchor), start, end) < 0 or c[start:end].split() != BODY.split():
        raise SystemExit(f"{runtime}/skinny.c: decoder_layer is not as this script knows it; update BODY and TIMED")
    c = c[:start] + TIMED + "\n" + c[end:]
    c = c.replace(anchor, TIMERS + anchor, 1)
    (src / "skinny.c").write_text(c)
    isa = kernels.path().split("+")[0]
    so = out / "timed.so"
    subprocess.run(["cc", *kernels.CFLAGS, *kernels.ISA_FLAGS[isa], str(src / "skinny.c"), "-o", str(so)], check=True)
    lib = kernels.bind(so)
    lib.st_read.argtypes = [ctypes.c_void_p]
    return lib


def stage_bytes(m) -> list[int]:
    """Weight bytes each stage reads (0 for RoPE and attention, whose K/V at 128 slots is small)."""
    per = {n: sum(weight_bytes(getattr(b, n)) for b in m.layers) for n in ("wqkv", "wo", "w13", "w2")}
    return [per["wqkv"], 0, 0, per["wo"], per["w13"], per["w2"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--against", help="a second checkout whose kernels take alternate turns")
    ap.add_argument("--model", choices=("target", "draft"), default="target", help="whose step (default: target)")
    a = ap.parse_args()
    s = specmod.load(a.spec)
    setup_threads(s)
    b = load_bundle(s.engine_dir, s.device, methods=("draft_target",) if a.model == "draft" else ("baseline",))
    m = b.target if a.model == "target" else b.draft
    if m is None:
        raise SystemExit(f"{s.engine_dir} has no draft engine: build it (make engine) or use --model target")
    tmp = Path(tempfile.mkdtemp(prefix="step_stages-"))
    libs = {"this": timed_library(Path(kernels.__file__).parent, tmp / "this")}
    if a.against:
        libs["against"] = timed_library(Path(a.against) / "pipeline" / "runtime", tmp / "against")
    buf = (ctypes.c_double * 8)()

    def probe() -> float:  # bench's bandwidth probe, smaller: a round's two readings take about 0.1 s
        return measure_bandwidth_gbs(256, reps=3)

    ctx = 128
    cache = m.new_cache(1, ctx + 2)
    rows: dict[str, list[tuple[float, float, float, list[float]]]] = {n: [] for n in libs}
    tok = 0  # every step writes slot 128 again: the same context length in every round
    with torch.inference_mode():
        m(torch.randint(0, 1000, (1, ctx)), torch.arange(ctx)[None], cache)
        for r in range(a.rounds):
            for name, lib in (list(libs.items()) if r % 2 == 0 else list(libs.items())[::-1]):
                kernels._lib = lib  # every kernel call below goes through this library
                p0, best = probe(), None
                for j in range(7):
                    lib.st_read(buf)
                    t0 = time.perf_counter()
                    hid = m(torch.tensor([[tok]]), torch.tensor([[ctx]]), cache)
                    t1 = time.perf_counter()
                    tok = int(m.logits(hid)[0, -1].argmax())
                    t2 = time.perf_counter()
                    lib.st_read(buf)
                    if j >= 2 and (best is None or t2 - t0 < best[0]):
                        best = (t2 - t0, t2 - t1, list(buf)[:6])
                rows[name].append(((p0 + probe()) / 2, *best))
    shutil.rmtree(tmp)
    sb = stage_bytes(m)
    head_b = weight_bytes(m.lm_head)
    for name, rs in rows.items():
        for mode, sel in (("usual (< 45 GB/s)", lambda p: p < 45), ("fast (>= 45 GB/s)", lambda p: p >= 45)):
            rr = [r for r in rs if sel(r[0])]
            if not rr:
                continue
            med = lambda v: statistics.median(v)  # noqa: E731
            probe_m = med([r[0] for r in rr])
            print(f"{name}, {mode}: {len(rr)} rounds, probes {probe_m:.1f} GB/s (median)")
            step = med([r[1] for r in rr])
            total = sum(sb) + head_b
            gbs = total / step / 1e9
            print(f"  step {step * 1e3:6.2f} ms  {gbs:5.1f} GB/s  {gbs / probe_m:.2f} of the probes")
            for i, st in enumerate(STAGES):
                t = med([r[3][i] for r in rr])
                gbs = f"{sb[i] / t / 1e9:5.1f} GB/s  {sb[i] / t / 1e9 / probe_m:.2f}" if sb[i] else ""
                print(f"  {st:9s} {t * 1e3:6.2f} ms  {gbs}")
            t = med([r[2] for r in rr])
            print(f"  {'head':9s} {t * 1e3:6.2f} ms  {head_b / t / 1e9:5.1f} GB/s  {head_b / t / 1e9 / probe_m:.2f}")
    if a.against:
        n = len(rows["this"])
        for i, st in enumerate(("step", *STAGES)):
            ratio = [(rows["this"][k][1] / rows["against"][k][1]) if i == 0 else
                     rows["this"][k][3][i - 1] / max(rows["against"][k][3][i - 1], 1e-9) for k in range(n)]
            print(f"this / against, {st}: median of {n} paired rounds {statistics.median(ratio):.3f}")


if __name__ == "__main__":
    main()

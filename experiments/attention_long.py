"""Long-context attention on the 1.5B's shapes (Hq 12, Hkv 2, D 128): a causal prefill chunk of `--chunk` queries
ending at each `--kv` (2048: a 4k prompt's first chunk, 4096 its second, 16384 a 16k prompt's last) and one decode
query (S 1) against each. This tree's kernel against another commit's (`--baseline REV`, built from git with the
same flags): outputs compared bit for bit, each timed (median of `--reps` interleaved calls). With `--engine`, a
cold prefill of `--prompt-tokens` random tokens in process on that engine's target, with each kernel.

    PYTHONPATH=. .venv/bin/python experiments/attention_long.py --baseline main --kv 2048,4096,16384
    PYTHONPATH=. .venv/bin/python experiments/attention_long.py --baseline main --kv 2048 \\
        --engine engines/qwen_coder --prompt-tokens 4096

Run it on a quiet machine; docs/kernels.md ("Attention by kv head") has the figures it printed.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build_at(rev: str | None, isa: str, out_dir: Path, define: str | None = None):
    """skinny.c as it is at git revision `rev` (None: this tree), compiled with today's flags for `isa` (and
    -D`define`) and bound; `.kv_dtype` the cache it reads (bf16, or fp32 before 2026-12-05)."""
    import torch

    from pipeline.runtime import kernels

    out_dir.mkdir(parents=True, exist_ok=True)

    def read(name: str) -> str:
        if rev is None:
            return (ROOT / "pipeline" / "runtime" / name).read_text()
        return subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:pipeline/runtime/{name}"], check=True,
                              capture_output=True, text=True).stdout

    texts = {p.name: read(p.name) for p in kernels.source_files(read)}  # skinny.c and its #includes at `rev`
    for name, text in texts.items():
        (out_dir / name).write_text(text)
    bf16_cache = any("const uint16_t *kc" in t for t in texts.values())  # fp32 K/V before 2026-12-05
    so = out_dir / f"skinny-{isa}.so"
    extra = [f"-D{define}"] if define else []
    subprocess.run(["cc", *kernels.CFLAGS, *kernels.ISA_FLAGS[isa], *extra, str(out_dir / "skinny.c"), "-o", str(so)],
                   check=True)
    lib = kernels.bind(so)
    lib.kv_dtype = kernels.KV_DTYPE if bf16_cache else torch.float32
    return lib


def call(lib, q, kc, vc, slots, kv: int, threads: int):
    import torch

    out = torch.empty_like(q)
    B, S, Hq, D = q.shape
    rc = lib.attention(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), None, slots.data_ptr(), out.data_ptr(), B, S, Hq,
                       kc.shape[1], D, kc.shape[2], kv, D ** -0.5, threads)
    assert rc == 0, rc
    return out


def kernel_rows(libs: dict, kvs: list[int], chunk: int, threads: int, reps: int) -> None:
    import torch

    Hq, Hkv, D = 12, 2, 128
    g = torch.Generator().manual_seed(0)
    for kv in kvs:
        kc, vc = (torch.randn(1, Hkv, kv, D, generator=g) for _ in range(2))
        kcs = {lib.kv_dtype: kc.to(lib.kv_dtype) for lib in libs.values()}
        vcs = {lib.kv_dtype: vc.to(lib.kv_dtype) for lib in libs.values()}
        for S in (min(chunk, kv), 1):
            q = torch.randn(1, S, Hq, D, generator=g) * 2
            slots = (kv - S + torch.arange(S))[None].contiguous()
            outs, times = {}, {name: [] for name in libs}
            for _ in range(reps):
                for name, lib in libs.items():
                    t0 = time.perf_counter()
                    outs[name] = call(lib, q, kcs[lib.kv_dtype], vcs[lib.kv_dtype], slots, kv, threads)
                    times[name].append(time.perf_counter() - t0)
            seen = sum(int(s) + 1 for s in slots[0])  # (query, slot) pairs a causal mask lets through, per head
            macs = 2 * seen * Hq * D
            line = f"S {S:5d} kv {kv:6d}:"
            for name, ts in times.items():
                t = statistics.median(ts)
                line += f"  {name} {t * 1e3:9.2f} ms ({macs / t / 1e9:5.1f} GMAC/s seen)"
            if len(outs) > 1:
                ref = next(iter(outs.values()))
                if all(torch.equal(o, ref) for o in outs.values()):
                    line += "  bits equal"
                else:  # (fp32 against bf16 K/V: how far, not whether)
                    line += f"  bits DIFFER (max |diff| {max(float((o - ref).abs().max()) for o in outs.values()):.2e})"
            print(line, flush=True)


def cold_prefill(libs: dict, engine: str, tokens: int) -> None:
    import torch

    from pipeline.runtime import kernels
    from pipeline.runtime.engine_io import load_engine
    from pipeline.runtime.model import KVCache, prefill

    model = load_engine(Path(engine) / "target").model
    ids = torch.randint(100, 150000, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    hidden = {}
    for name, lib in libs.items():
        prev, prev_dtype = kernels._lib, kernels.KV_DTYPE
        kernels._lib, kernels.KV_DTYPE = lib, lib.kv_dtype
        try:
            cache = KVCache(model.cfg, 1, tokens + 16, lib.kv_dtype, "cpu")
            t0 = time.perf_counter()
            hidden[name] = prefill(model, cache, [ids])
            print(f"cold prefill {tokens} tokens, {name}: {time.perf_counter() - t0:.2f} s", flush=True)
        finally:
            kernels._lib, kernels.KV_DTYPE = prev, prev_dtype
    if len(hidden) > 1:
        ref = next(iter(hidden.values()))
        print("last hidden state bits", "equal" if all(torch.equal(h, ref) for h in hidden.values()) else "DIFFER")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", help="git revision whose skinny.c to time beside this tree's (e.g. main)")
    ap.add_argument("--kv", default="2048,4096", help="comma-separated kv lengths")
    ap.add_argument("--chunk", type=int, default=2048, help="queries of a prefill chunk (PREFILL_TOKENS)")
    ap.add_argument("--define", default="", help="comma-separated NAME=VALUE: this tree built with each -D as well "
                    "(e.g. ATT_TILE=1, the tiles' A/B)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--engine", help="an engine directory (its target/): also time a cold prefill in process")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    args = ap.parse_args(argv)

    from pipeline.runtime import kernels

    kernels.configure_threads(args.threads)
    libs = {"this tree": kernels._load()}
    libs["this tree"].kv_dtype = kernels.KV_DTYPE
    isa = kernels._path  # the build (avx512 / avx2) whose flags the baseline is compiled with
    print(f"kernel build {isa}, {args.threads} threads")
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            libs = {args.baseline: build_at(args.baseline, isa, Path(tmp) / "base"), **libs}
        for i, d in enumerate(filter(None, args.define.split(","))):
            libs[d] = build_at(None, isa, Path(tmp) / f"d{i}", d)
        kernel_rows(libs, [int(k) for k in args.kv.split(",")], args.chunk, args.threads, args.reps)
        if args.engine:
            cold_prefill(libs, args.engine, args.prompt_tokens)


if __name__ == "__main__":
    main()

"""Decode-step speed of the torch runtime per weight precision, against the memory roofline.

Random-weight models of Qwen2.5-Coder-1.5B's shape (the target) and Qwen2.5-0.5B's (the draft) are
built in-process (no checkpoint needed: the time of a step depends on shapes and bytes, not on the
values), then one decode step of 1 token and a verification step of k+1 tokens are timed for each
of bf16, int8 and int4 (float32 optional). The roofline is the measured read bandwidth divided by
the bytes a step reads (every weight but the embedding, which is a row lookup).

    .venv/bin/python experiments/kernel_roofline.py                 # 1.5B target + 0.5B draft, 2 threads
    .venv/bin/python experiments/kernel_roofline.py --small         # a 4x smaller shape, for a quick look
    .venv/bin/python experiments/kernel_roofline.py --json out.json

Figures are the fastest of `--reps` steps (medians alongside); on a shared machine run it twice and
compare ratios, or use `--clock cpu` (one thread, its CPU time: other processes' time slices are not
counted).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.runtime import kernels, quant  # noqa: E402
from pipeline.runtime.model import ModelConfig, Transformer, build_model  # noqa: E402

TARGET = ModelConfig(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
                     num_kv_heads=2, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, tie_embeddings=False,
                     max_position_embeddings=4096)
DRAFT = ModelConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                    num_kv_heads=2, head_dim=64, rope_theta=1e6, rms_norm_eps=1e-6, tie_embeddings=True,
                    max_position_embeddings=4096)


def scaled(cfg: ModelConfig, f: int) -> ModelConfig:
    d = cfg.to_dict()
    return ModelConfig(**{**d, "num_layers": max(1, cfg.num_layers // f), "vocab_size": cfg.vocab_size // f})


def random_model(cfg: ModelConfig, precision: str, group_size: int, seed: int = 0) -> Transformer:
    """A model of `cfg`'s shape with random weights stored as `precision` (quantized one tensor at a time)."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(cfg).state_dict().items()
                  if not (cfg.tie_embeddings and k == "lm_head.weight")}
    g = torch.Generator().manual_seed(seed)
    wdtype = torch.float32 if precision == "float32" else torch.bfloat16
    state: dict[str, torch.Tensor] = {}
    for k, shp in shapes.items():
        if len(shp) == 1:
            state[k] = torch.ones(shp)
            continue
        w = (torch.randn(shp, generator=g) * 0.02).to(wdtype)
        if precision in quant.ALGOS and quant.LINEAR.match(k):
            q, s = quant.quantize(w, precision, group_size)
            state[k[:-7] + ".qweight"], state[k[:-7] + ".scales"] = q, s
        else:
            state[k] = w
    if cfg.tie_embeddings and precision in quant.ALGOS:
        state["lm_head.qweight"], state["lm_head.scales"] = quant.quantize(state["embed.weight"], precision, group_size)
    return build_model(cfg, state, wdtype, "cpu")


def read_bytes(model: Transformer) -> int:
    """Bytes a decode step reads: every weight except the embedding table (a row lookup)."""
    total = quant.weight_bytes(model)
    if model.lm_head is not None and getattr(model.lm_head, "weight", None) is model.embed.weight:
        return total  # tied, unquantized: the table is read whole as the head
    return total - model.embed.weight.numel() * model.embed.weight.element_size()


CLOCK = time.perf_counter


def bandwidth_gbs(mb: int = 1024, reps: int = 7) -> float:
    """Sustained read bandwidth with the same threads and clock: sum a buffer much larger than the caches."""
    x = torch.ones(mb * 1024 * 1024 // 4)
    x.sum()
    ts = []
    for _ in range(reps):
        t = CLOCK()
        x.sum()
        ts.append(CLOCK() - t)
    return x.numel() * 4 / min(ts) / 1e9


@torch.inference_mode()
def step_ms(model: Transformer, rows: int, reps: int, ctx: int = 64) -> tuple[float, float]:
    """(median, fastest) time of one forward over `rows` new tokens after `ctx` tokens, with the head.

    On a shared machine the fastest of several steps is the better estimate of what the code costs
    (other processes only ever add time); both are reported.
    """
    cache = model.new_cache(1, ctx + rows + 8)
    toks = torch.randint(0, model.cfg.vocab_size, (1, ctx))
    model.logits(model(toks, torch.arange(ctx)[None], cache)[:, -1:])
    new = torch.randint(0, model.cfg.vocab_size, (1, rows))
    pos = torch.arange(ctx, ctx + rows)[None]
    ts = []
    for _ in range(reps + 1):
        t = CLOCK()
        model.logits(model(new, pos, cache))
        ts.append(CLOCK() - t)
    return 1000 * statistics.median(ts[1:]), 1000 * min(ts[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--k", type=int, default=4, help="verification step is k+1 tokens")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--precisions", default="bfloat16,int8,int4")
    ap.add_argument("--small", action="store_true", help="1/4 of the layers and vocabulary")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="rows of the draft's head (a reduced-vocabulary head, e.g. 32768 as build/qwen_coder.yaml)")
    ap.add_argument("--only", choices=["target", "draft"], help="time one model only")
    ap.add_argument("--base-ms", type=float, default=0.0,
                    help="with --only draft: the bf16 target step (ms) of an earlier run, for the draft/target ratio")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: the thread's CPU time, one thread (robust to other processes on a shared machine: "
                         "time spent descheduled is not counted, memory stalls are)")
    a = ap.parse_args()
    global CLOCK
    if a.clock == "cpu":
        CLOCK, a.threads = time.thread_time, 1
    kernels.configure_threads(a.threads)
    tcfg, dcfg = (scaled(TARGET, 4), scaled(DRAFT, 4)) if a.small else (TARGET, DRAFT)
    if a.draft_vocab:
        # The step reads only the kept head rows; an untied head of that many rows costs the same bytes.
        dcfg = ModelConfig(**{**dcfg.to_dict(), "vocab_size": a.draft_vocab, "tie_embeddings": False})
    out = {"kernel_path": kernels.path(), "threads": a.threads, "clock": a.clock, "group_size": a.group_size,
           "small": a.small, "draft_vocab": a.draft_vocab or dcfg.vocab_size,
           "target": {}, "draft": {}}
    bws = []
    for role, cfg in (("target", tcfg), ("draft", dcfg)):
        if a.only and role != a.only:
            continue
        for prec in a.precisions.split(","):
            m = random_model(cfg, prec, a.group_size)
            nbytes = read_bytes(m)
            bws.append(bandwidth_gbs())
            one_med, one = step_ms(m, 1, a.reps)
            ver_med, ver = step_ms(m, a.k + 1, a.reps)
            bws.append(bandwidth_gbs())
            bw = statistics.median(bws[-2:])
            out[role][prec] = {"bytes_per_token": nbytes, "step_ms": round(one, 2), "step_ms_median": round(one_med, 2),
                               f"verify_{a.k + 1}_ms": round(ver, 2), f"verify_{a.k + 1}_ms_median": round(ver_med, 2),
                               "tokens_per_s": round(1000 / one, 2), "bandwidth_gbs": round(bw, 1),
                               "roofline_tokens_per_s": round(bw * 1e9 / nbytes, 2),
                               "roofline_fraction": round((1000 / one) / (bw * 1e9 / nbytes), 3)}
            print(f"{role:6s} {prec:8s} {nbytes / 1e9:6.3f} GB/step  1 token {one:8.1f} ms  {a.k + 1} tokens "
                  f"{ver:8.1f} ms  {1000 / one:6.2f} tok/s  roofline {out[role][prec]['roofline_fraction']:.2f} "
                  f"(bw {bw:.1f} GB/s)", flush=True)
            del m
            gc.collect()
    t, d = out["target"], out["draft"]
    if a.base_ms and "bfloat16" not in t:
        t["bfloat16"] = {"step_ms": a.base_ms}
    if "bfloat16" in t:
        base = t["bfloat16"]["step_ms"]
        for prec in t:
            t[prec]["speed_vs_bf16"] = round(base / t[prec]["step_ms"], 2)
        for prec in d:
            d[prec]["step_vs_bf16_target"] = round(d[prec]["step_ms"] / base, 3)
        print("target speed vs bf16:", {p: v["speed_vs_bf16"] for p, v in t.items()})
        print("draft step / bf16 target step:", {p: v["step_vs_bf16_target"] for p, v in d.items()})
    out["bandwidth_gbs_median"] = round(statistics.median(bws), 1)
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

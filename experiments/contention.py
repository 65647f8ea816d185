"""What one busy process costs our decoding, per OpenMP wait policy and thread count (issue 28, item 6).

Since 2026-12-03 the C kernels run on their own pool (skinny.c `pool_run`), whose wait follows the machine's load;
the OpenMP policies here now reach torch's own regions only, and the tables this produced are in docs/peers.md.

Each configuration runs in a fresh process (libgomp reads its environment once, when torch loads it): it loads the
engine, warms up, then decodes `--new` greedy tokens of one prompt, quiet and beside a Python busy loop, alternating
(`pipeline.contention.measure`). It prints quiet and busy tokens/s and the slowdown per configuration.

    python experiments/contention.py --engine engines/qwen_coder --new 32 --method baseline
    python experiments/contention.py --layers 8 --new 64        # a random model of the target's layer shape, built here

A configuration is `threads:policy`, policy one of `default` (libgomp's own), `passive` (OMP_WAIT_POLICY=PASSIVE),
`active` or a GOMP_SPINCOUNT value.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _env(policy: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy in ("passive", "active"):
        env["OMP_WAIT_POLICY"] = policy.upper()
    elif policy != "default":
        env["GOMP_SPINCOUNT"] = policy
    env["PIPELINE_OMP_POLICY"] = "off"  # the pipeline's own choice stays out of the experiment
    return env


def _build(root: Path, hidden: int, layers: int, intermediate: int) -> Path:
    """A random Qwen2 model with the flagship target's layer shape (hidden 1536, 12 heads, 2 KV heads, MLP 8960)
    and fewer layers, built into an engine as the pipeline builds one (bf16)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pipeline import spec as specmod
    from pipeline.engine import build_target
    from tests.conftest import train_tokenizer, write_spec

    tok = train_tokenizer(2048)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=hidden // 128, num_key_value_heads=2,
                      max_position_embeddings=4096, tie_word_embeddings=True, use_sliding_window=False)
    out = root / "models" / "target"
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    s = specmod.load(write_spec(root, name="busy", dtype="bfloat16"))
    build_target(s, log=lambda *a: None)
    return s.engine_dir


def worker(engine: str, threads: int, new: int, rounds: int, method: str) -> None:
    import time

    from pipeline import contention
    from pipeline.runtime import kernels
    from pipeline.runtime.decode import decode, load_bundle
    from pipeline.runtime.generate import Request

    kernels.configure_threads(threads)
    b = load_bundle(Path(engine), "cpu")
    prompt = list(range(20, 60))
    decode(b, method, [Request(prompt, 8)])

    def run() -> float:
        t = time.perf_counter()
        (r,) = decode(b, method, [Request(prompt, new)])
        return len(r.tokens) / (time.perf_counter() - t)

    print(json.dumps(contention.measure(run, rounds)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="", help="an engine directory (default: a random model built here)")
    ap.add_argument("--root", default="", help="where to build the random model (kept; default: a temporary dir)")
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=8960)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--method", default="baseline")
    ap.add_argument("--configs", default="2:default,2:passive,2:1000,2:10000,2:100000,1:default")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.new, args.rounds, args.method)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.root or tmp)
        built = root / "engines" / "busy" / "config.json"
        engine = args.engine or str(built.parent if built.is_file()
                                    else _build(root, args.hidden, args.layers, args.intermediate))
        out = {}
        for cfg in args.configs.split(","):
            threads, policy = cfg.split(":")
            res = subprocess.run([sys.executable, __file__, "--worker", engine, threads, "--new", str(args.new),
                                  "--rounds", str(args.rounds), "--method", args.method],
                                 env=_env(policy), capture_output=True, text=True)
            if res.returncode != 0:
                print(cfg, "failed:", res.stderr[-2000:])
                continue
            r = json.loads(res.stdout.strip().splitlines()[-1])
            out[cfg] = r
            print(f"{cfg:>14}: quiet {r['quiet_tokens_per_s']:.1f} tokens/s, busy {r['busy_tokens_per_s']:.1f}, "
                  f"slowdown {r['slowdown']:.2f}x  (rounds {[round(x, 1) for x in r['quiet_rounds']]} / "
                  f"{[round(x, 1) for x in r['busy_rounds']]})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

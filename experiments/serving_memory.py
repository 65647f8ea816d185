"""Resident memory of the served pair (`ensemble` + `tensorrt_llm_bls`, two tritonserver python stubs) with the weights
shared (one mapped copy, pipeline/runtime/shared.py) or private (a copy per stub), against one copy of the weights.

    PYTHONPATH=. .venv/bin/python experiments/serving_memory.py build/qwen_coder.yaml [--private] [--tokens N]

Starts the spec's server on its repository (written if missing; `--private` sets the models' `shared_weights`
parameter to false), sends each served model one request of N new tokens (so every stub has run its KV caches and
scratch), reads /proc/PID/smaps_rollup of each stub, prints one JSON line and stops the server. Figures: per stub Rss
and Pss, their sum (Pss adds up to what the pair really holds: a shared page counts half in each), the weights' bytes
(engine files, as loaded: what one copy costs) and the KV caches' bytes (both stubs, allocated at max_batch_size x
max_seq_len).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import psutil

from pipeline import spec as specmod
from pipeline.client import generate
from pipeline.runtime import shared
from pipeline.triton import server as srvmod
from pipeline.triton.repo import MODELS, write_repo


def set_shared(repo: Path, on: bool) -> None:
    """Rewrite every served model's `shared_weights` parameter in place."""
    for cfg in repo.glob("*/config.pbtxt"):
        text = cfg.read_text()
        new = re.sub(r'(key: "shared_weights"\s*value \{\s*string_value: )"(true|false)"',
                     lambda m: m.group(1) + ('"true"' if on else '"false"'), text)
        if new == text and "shared_weights" not in text:
            raise SystemExit(f"{cfg}: no shared_weights parameter (write the repository with this checkout)")
        cfg.write_text(new)


def stubs(pid: int) -> dict[str, int]:
    """Served model name -> pid of its python backend stub."""
    out = {}
    for p in psutil.Process(pid).children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "triton_python_backend_stub" in cmd:
            for name in MODELS:
                if f"/{name}/1/model.py" in cmd:
                    out[name] = p.pid
    return out


def weight_bytes(engine_dir: Path) -> int:
    return sum(f.stat().st_size for f in engine_dir.glob("*/*.safetensors"))


def kv_bytes(spec) -> int:
    """Both stubs' KV caches: the bundle's models at max_batch_size x max_seq_len, fp32."""
    total = 0
    for part in ("target", "draft"):
        cfg_path = spec.engine_dir / part / "config.json"
        if not cfg_path.is_file():
            continue
        m = json.loads(cfg_path.read_text())["runtime"]["model"]
        per_token = 2 * m["num_layers"] * m["num_kv_heads"] * m["head_dim"] * 4
        total += per_token * spec.limits.max_batch_size * spec.limits.max_seq_len
    return 2 * total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec")
    ap.add_argument("--private", action="store_true", help="a copy of the weights per stub (before)")
    ap.add_argument("--tokens", type=int, default=8)
    args = ap.parse_args()
    spec = specmod.load(args.spec)
    write_repo(spec, log=lambda *a: None)
    set_shared(spec.repo_dir, not args.private)
    srv = srvmod.start(spec, log=lambda *a: print(*a, file=sys.stderr))
    try:
        for name in spec.triton.models:
            generate(srv.grpc_url, name, "def quicksort(arr):", args.tokens)
        pids = stubs(srv.pid)
        per = {name: shared.resident(pid) for name, pid in pids.items()}
        maps = {name: shared.shared_mappings(pid) for name, pid in pids.items()}
    finally:
        srvmod.stop(spec)
    mib = 1 << 20
    w, kv = weight_bytes(spec.engine_dir), kv_bytes(spec)
    pss = sum(r.get("Pss", 0) for r in per.values())
    print(json.dumps({
        "spec": spec.name, "weights": "private" if args.private else "shared",
        "stubs": {n: {k: round(v / mib, 1) for k, v in r.items()} for n, r in per.items()},
        "shared_files_mib": {n: {Path(f).name: {k: round(v / mib, 1) for k, v in d.items()} for f, d in m.items()}
                             for n, m in maps.items()},
        "pss_total_mib": round(pss / mib, 1),
        "rss_total_mib": round(sum(r.get("Rss", 0) for r in per.values()) / mib, 1),
        "weights_one_copy_mib": round(w / mib, 1), "kv_caches_mib": round(kv / mib, 1),
        "pss_over_one_copy_plus_kv": round(pss / (w + kv), 3), "pss_over_one_copy": round(pss / w, 3),
    }))


if __name__ == "__main__":
    main()

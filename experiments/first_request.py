"""Where the first served request's time goes: a fresh server, validate's warm-up requests, then prompts in turn.

Starts tritonserver on the spec's repository (with each model's `warmup_tokens` set as given: 0 turns the served
models' own warm-up off), sends validate's 8-token warm-up request per method, then `--prompts` prompts of `--new`
tokens, and prints each one's tokens/s, so the first can be set against the rest; then stops the server.

    python experiments/first_request.py build/qwen_coder.yaml --warmup-tokens 0 --new 64 --prompts 4
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("--warmup-tokens", type=int, default=-1, help="set each model's warmup_tokens (-1: leave)")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--method", default="baseline")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from pipeline import spec as specmod
    from pipeline.client import chat_text
    from pipeline.sources import spec_prompts
    from pipeline.triton import server
    from pipeline.validate import _request

    s = specmod.load(args.spec)
    if args.warmup_tokens >= 0:
        for cfg in s.repo_dir.glob("*/config.pbtxt"):
            text = re.sub(r'parameters \{\s*key: "warmup_tokens".*?\}\s*\}\s*', "", cfg.read_text(), flags=re.S)
            value = f'string_value: "{args.warmup_tokens}"'
            text += f'parameters {{\n  key: "warmup_tokens"\n  value {{\n    {value}\n  }}\n}}\n'
            cfg.write_text(text)
    tok = AutoTokenizer.from_pretrained(str(s.engine_dir / "target"))
    prompts = [chat_text(tok, p) for p in spec_prompts(s, args.prompts + 1)]
    srv = server.start(s)
    try:
        url = server.grpc_url(s)
        _request(url, prompts[0], 8, args.method)  # validate's warm-up request
        tps = []
        for i, p in enumerate(prompts[1:]):
            r = _request(url, p, args.new, args.method)
            tps.append(r["num_output_tokens"] / r["latency_s"])
            print(f"prompt {i + 1}: {tps[-1]:.2f} tokens/s (ttft {r['ttft_s']:.2f} s)", flush=True)
        print(f"first / median of the rest: {tps[0] / statistics.median(tps[1:]):.2f}")
        log = (s.report_dir / "triton.log")
        for line in log.read_text().splitlines() if log.is_file() else []:
            if "serving" in line:
                print(line[-300:])
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Does the prompt cache hold its byte budget? Distinct long prompts, more than the budget holds, through one
deployment's prompt cache (in process, target and draft), with the process's resident memory read after each.

Each prompt is a different slice of the project's own source, chat-formatted, `--tokens` tokens; `--method` decodes
`--new` tokens of it; the cache's bytes, blocks and evictions and the process's RSS are printed after every request,
then the same prompts again (the most recent ones hit, the oldest were evicted).

    python experiments/prompt_cache_soak.py --engine engines/qwen_coder --budget-mib 512 --prompts 6 --tokens 1500
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", default="engines/qwen_coder")
    ap.add_argument("--budget-mib", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--new", type=int, default=4)
    ap.add_argument("--method", default="baseline")
    args = ap.parse_args(argv)

    import torch

    from pipeline.runtime.decode import decode, load_bundle
    from pipeline.runtime.generate import Request
    from pipeline.runtime.prompt_cache import PromptCache

    torch.set_grad_enabled(False)
    b = load_bundle(Path(args.engine), "cpu")
    source = "".join(p.read_text() for p in sorted((ROOT / "pipeline").rglob("*.py")))
    ids = b.tokenizer(source, add_special_tokens=False)["input_ids"]
    prompts = [ids[i * args.tokens:(i + 1) * args.tokens] for i in range(args.prompts)]
    b.prompt_cache = pc = PromptCache(args.budget_mib * 2**20, 64)
    print(f"budget {args.budget_mib} MiB; RSS {rss_mb():.0f} MB after loading", flush=True)
    for rnd in ("first", "again"):
        for i, p in enumerate(prompts):
            t = time.perf_counter()
            (r,) = decode(b, args.method, [Request(list(p), args.new)])
            print(f"{rnd} prompt {i}: first token {r.first_token_s:.2f} s, reused {r.cached_tokens} tokens; cache "
                  f"{pc.bytes / 2**20:.0f} MiB in {len(pc)} blocks, {pc.stats.evicted_blocks} evicted; RSS "
                  f"{rss_mb():.0f} MB ({time.perf_counter() - t:.1f} s)", flush=True)


if __name__ == "__main__":
    main()

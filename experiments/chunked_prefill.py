"""Running streams while a long prompt is admitted: their inter-token latency with the prompt prefilled whole, and
in chunks of `kv_cache.prefill_chunk` tokens between their steps (pipeline/runtime/batcher.py).

In process, on a built engine's target (plain rows of the continuous batch, as the server runs them): `--streams`
short requests decode; after `--warm` of their steps a prompt of `--prompt-tokens` tokens is admitted, and they go
on `--after` steps once it has its first token. Prints, per chunk size, the streams' gaps between consecutive
tokens over their whole run (median, p99, the largest), the median before the admission, and the long prompt's
time to its first token.

    python experiments/chunked_prefill.py --engine engines/qwen_coder --prompt-tokens 4096 --chunks 0,16,32,64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", default="engines/qwen_coder", help="engine directory (its target is used)")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--chunks", default="0,16,32,64", help="prefill_chunk values to try (0: whole)")
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--warm", type=int, default=24, help="stream steps before the long prompt arrives")
    ap.add_argument("--after", type=int, default=32, help="stream steps after its first token")
    args = ap.parse_args(argv)

    import torch

    from pipeline.admission import streams_while_admitting
    from pipeline.runtime.engine_io import load_engine

    torch.set_grad_enabled(False)
    eng = load_engine(Path(args.engine) / "target", "cpu")
    vocab = eng.model.cfg.vocab_size
    print(f"{args.streams} streams; a {args.prompt_tokens}-token prompt admitted after {args.warm} steps")
    for chunk in (int(c) for c in args.chunks.split(",")):
        r = streams_while_admitting(eng.model, chunk, args.streams, args.prompt_tokens, args.warm, args.after, vocab)
        print(f"chunk {r['chunk']:>4}: streams' gaps (n={r['gaps']}) median {r['median_ms']:.0f} ms, p99 "
              f"{r['p99_ms']:.0f} ms ({r['p99_ms'] / r['median_ms']:.2f}x), largest {r['max_ms']:.0f} ms; median "
              f"before the prompt {r['before_median_ms']:.0f} ms; its first token after {r['ttft_s']:.1f} s",
              flush=True)


if __name__ == "__main__":
    main()

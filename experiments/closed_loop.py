"""Closed-loop clients against the served model's scheduler, in process: `--clients` clients each send their next
request the moment the last is answered (no network, no Triton: the scheduler's own loop, driven tick by tick),
each method in turn, alternating `--reps` times; tokens/s over the wall time of `--requests` requests, and, with
`--profile`, where the worker's time went (cProfile, the top functions by own time). Gaps: the time between a
stream's pieces after its first, all streams pooled (validate's inter-token latency), p50 / p99 / max. The served
model's K/V budget and prefill chunk (spec kv_cache) apply as in the server; `--chunk N` replaces the chunk.

    PYTHONPATH=. .venv/bin/python experiments/closed_loop.py build/qwen_coder.yaml --clients 4 --methods baseline,hybrid

Why: validate's curve through gRPC read the default method 0.92-0.97x baseline at 4 clients when the load policy
already stepped plainly; this isolates the scheduler's share from the network and the server's threads.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class Client:
    """A Responder (pipeline.triton.replies) that keeps the final answer's tokens."""

    def __init__(self):
        self.done, self.err, self.tokens = False, None, 0
        self.at: list[float] = []  # when each piece came

    def send(self, texts, results, final):
        if texts:
            self.at.append(time.perf_counter())
        if final:
            self.done = True
            self.tokens = sum(len(r.tokens) for r in results or [])

    def error(self, message, cancelled=False):
        self.done, self.err = True, message

    def cancelled(self):
        return False


def run(sched, parser, texts: list[str], method: str, clients: int, requests: int, new: int,
        gaps: list[float] | None = None, disable_at: int = 0) -> tuple[float, int]:
    """`requests` requests by `clients` closed-loop clients; `disable_at`: their disable_at_batch (0: the method
    itself at every load, as validate measures it)."""
    def submit(i: int) -> Client:
        d = {"text_input": np.array([[texts[i % len(texts)].encode()]], dtype=object),
             "max_tokens": np.array([[new]], np.int32), "method": np.array([[method.encode()]], dtype=object),
             "disable_at_batch": np.array([[disable_at]], np.int32), "cache_prompt": np.array([[False]]),
             "return_perf_metrics": np.array([[True]]), "stream": np.array([[True]])}
        c = Client()
        sched.submit(parser.parse(d.get, ""), c)
        return c

    sent, tokens = 0, 0
    live = []
    t0 = time.perf_counter()
    for _ in range(min(clients, requests)):
        live.append(submit(sent))
        sent += 1
    while live:
        sched.tick()
        for c in [c for c in live if c.done]:
            if c.err:
                raise RuntimeError(c.err)
            live.remove(c)
            tokens += c.tokens
            if gaps is not None:
                gaps += [1e3 * (b - a) for a, b in zip(c.at[1:], c.at[2:])]
            if sent < requests:
                live.append(submit(sent))
                sent += 1
    return time.perf_counter() - t0, tokens


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", help="the spec (its speculation block configures the served methods, as the server does)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--methods", default="baseline,hybrid")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--disable-at", type=int, default=0, help="the requests' disable_at_batch (0: never)")
    ap.add_argument("--chunk", type=int, default=-1, help="kv_cache.prefill_chunk (default: the spec's)")
    ap.add_argument("--prompts", default=str(ROOT / "build" / "code_prompts.txt"))
    args = ap.parse_args(argv)
    from pipeline import spec as specmod
    from pipeline.runtime.decode import apply_spec, load_bundle
    from pipeline.triton.parse import Limits, RequestParser
    from pipeline.triton.scheduler import Scheduler

    spec = specmod.load(args.spec)
    b = apply_spec(load_bundle(spec.engine_dir, "cpu"), spec)
    bc = b.config["build_config"]
    parser = RequestParser(b.tokenizer, Limits(
        max_batch_size=16, max_input_len=int(bc["max_input_len"]), max_seq_len=int(bc["max_seq_len"]),
        vocab=int(b.target.cfg.vocab_size), end_ids=tuple(b.end_ids), methods=b.methods(),
        default_method="baseline", spec=b.spec, decoupled=True))
    texts = [t for t in Path(args.prompts).read_text().splitlines() if t.strip() and not t.startswith("#")][:8]
    sched = Scheduler(b, 16)
    sched.configure_kv(spec.kv_cache.bytes, spec.kv_cache.prefill_chunk if args.chunk < 0 else args.chunk)
    run(sched, parser, texts, "baseline", 1, 1, 4)  # warm
    for rep in range(args.reps):
        for m in args.methods.split(","):
            prof = cProfile.Profile() if args.profile and rep == args.reps - 1 else None
            if prof:
                prof.enable()
            gaps: list[float] = []
            wall, toks = run(sched, parser, texts, m, args.clients, args.requests, args.new, gaps,
                             args.disable_at)
            if prof:
                prof.disable()
            g = np.array(gaps) if gaps else np.zeros(1)
            print(f"{m:14s} clients {args.clients}: {toks / wall:6.1f} tokens/s ({toks} in {wall:.1f} s); gaps ms "
                  f"p50 {np.percentile(g, 50):.0f} p99 {np.percentile(g, 99):.0f} max {g.max():.0f}", flush=True)
            if prof:
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
                print("\n".join(s.getvalue().splitlines()[:40]))


if __name__ == "__main__":
    main()

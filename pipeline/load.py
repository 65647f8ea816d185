"""`python -m pipeline load SPEC`: N concurrent streaming clients for S seconds against the local server.

Every greedy answer must equal the reference answer for its prompt (taken first, one request at a
time), every response must be complete, and the server's memory (tritonserver plus its stubs) is
measured before and after. Bounded in clients and time, and loopback only: this is a soak test
for the deployment on this machine, not a tool for loading other hosts.
"""

from __future__ import annotations

import ipaddress
import json
import threading
import time
from pathlib import Path

from pipeline import spec as specmod
from pipeline.sources import spec_prompts

MAX_CONCURRENCY = 256
MAX_DURATION_S = 3600.0


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    ys = sorted(xs)
    i = min(len(ys) - 1, max(0, round(q / 100 * (len(ys) - 1))))
    return ys[i]


def _loopback_url(spec: specmod.Spec) -> str:
    from pipeline.triton.server import local_host

    host = local_host(spec.triton.host)
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"triton.host: {spec.triton.host!r}; the load test only targets this machine's loopback "
                         "(serve on 127.0.0.1 or 0.0.0.0)")
    return f"{host}:{spec.triton.grpc_port}"


def run_load(spec: specmod.Spec, concurrency: int, duration: float, max_tokens: int = 32,
             methods: tuple[str, ...] = ("baseline",), model: str = "ensemble", num_prompts: int = 8,
             sample_every: int = 4, chat: bool = True, log=print) -> dict:
    """Drive the running server; return (and write to reports/<name>/load.json) the summary."""
    from pipeline.client import RequestError, chat_text, generate
    from pipeline.triton.server import running_pid, server_rss_mb

    if not 1 <= concurrency <= MAX_CONCURRENCY:
        raise ValueError(f"--concurrency: got {concurrency}; must be between 1 and {MAX_CONCURRENCY}")
    if not 0 < duration <= MAX_DURATION_S:
        raise ValueError(f"--duration: got {duration}; must be between 0 and {MAX_DURATION_S:.0f} seconds")
    if max_tokens < 1:
        raise ValueError(f"--max-tokens: got {max_tokens}; must be 1 or more")
    url = _loopback_url(spec)
    pid = running_pid(spec)
    if pid is None:
        raise RuntimeError(f"no server is running for {spec.name!r}; start it with `make serve SPEC=...`")
    prompts = spec_prompts(spec, num_prompts)
    if chat:
        from pipeline.engine import load_tokenizer

        tok_dir = spec.engine_dir / "target"
        if (tok_dir / "tokenizer_config.json").is_file():
            tok = load_tokenizer(tok_dir)
            prompts = [chat_text(tok, p) for p in prompts]
    log(f"reference answers for {len(prompts)} prompts (greedy, baseline, one at a time) ...")
    reference = [generate(url, model, p, max_tokens, method="baseline")["text"] for p in prompts]
    rss_before = server_rss_mb(pid)
    lock = threading.Lock()
    stats = {"requests": 0, "errors": 0, "incomplete": 0, "greedy_mismatches": 0, "tokens": 0, "greedy": 0}
    latencies: list[float] = []
    ttfts: list[float] = []
    samples: list[str] = []
    deadline = time.monotonic() + duration

    def worker(w: int) -> None:
        i = w
        while time.monotonic() < deadline:
            p = i % len(prompts)
            method = methods[i % len(methods)]
            sampled = sample_every > 0 and i % sample_every == sample_every - 1
            opts = {"temperature": 0.8, "top_p": 0.95, "seed": i} if sampled else {}
            i += concurrency
            try:
                r = generate(url, model, prompts[p], max_tokens, method=method, stream=True,
                             timeout=max(60.0, duration * 4), **opts)
            except RequestError as e:
                with lock:
                    stats["requests"] += 1
                    stats["errors"] += 1
                    if len(samples) < 5:
                        samples.append(f"{method}: {e}")
                continue
            with lock:
                stats["requests"] += 1
                if not r["complete"] or r.get("num_output_tokens") is None:
                    stats["incomplete"] += 1
                    continue
                stats["tokens"] += r["num_output_tokens"]
                latencies.append(r["latency_s"] * 1000)
                ttfts.append(r["ttft_s"] * 1000)
                if not sampled:
                    stats["greedy"] += 1
                    if r["text"] != reference[p]:
                        stats["greedy_mismatches"] += 1
                        if len(samples) < 5:
                            samples.append(f"{method} prompt {p}: got {r['text'][:60]!r}, "
                                           f"expected {reference[p][:60]!r}")

    log(f"{concurrency} streaming clients for {duration:.0f}s ({', '.join(methods)}; max_tokens {max_tokens}) ...")
    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    rss_after = server_rss_mb(pid)
    out = {
        "requests": stats["requests"], "errors": stats["errors"], "incomplete": stats["incomplete"],
        "greedy_requests": stats["greedy"], "greedy_mismatches": stats["greedy_mismatches"],
        "output_tokens": stats["tokens"], "tokens_per_s": stats["tokens"] / wall if wall > 0 else 0.0,
        "latency_ms": {"p50": _percentile(latencies, 50), "p95": _percentile(latencies, 95)},
        "ttft_ms": {"p50": _percentile(ttfts, 50), "p95": _percentile(ttfts, 95)},
        "rss_mb": {"before": rss_before, "after": rss_after},
        "concurrency": concurrency, "duration_s": wall, "max_tokens": max_tokens, "methods": list(methods),
        "model": model, "problems": samples,
    }
    spec.report_dir.mkdir(parents=True, exist_ok=True)
    path = Path(spec.report_dir) / "load.json"
    path.write_text(json.dumps(out, indent=2))
    log(f"{out['requests']} requests, {out['errors']} errors, {out['incomplete']} incomplete, "
        f"{out['greedy_mismatches']} greedy mismatches; {out['tokens_per_s']:.1f} tokens/s; latency p50 "
        f"{out['latency_ms']['p50']:.0f} ms, p95 {out['latency_ms']['p95']:.0f} ms; server RSS "
        f"{rss_before:.0f} -> {rss_after:.0f} MB; wrote {path}")
    return out


def cmd_load(args) -> int:
    s = specmod.load(args.spec)
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    out = run_load(s, args.concurrency, args.duration, args.max_tokens, methods, model=args.model,
                   num_prompts=args.prompts)
    bad = out["errors"] + out["incomplete"] + out["greedy_mismatches"]
    return 1 if bad else 0


def register(verb) -> None:
    sp = verb("load", cmd_load, "N concurrent streaming gRPC clients for S seconds; writes reports/<name>/load.json")
    sp.add_argument("--concurrency", type=int, default=8)
    sp.add_argument("--duration", type=float, default=10.0, help="seconds")
    sp.add_argument("--max-tokens", type=int, default=32)
    sp.add_argument("--methods", default="baseline", help="comma-separated, e.g. baseline,prompt_lookup")
    sp.add_argument("--model", default="ensemble")
    sp.add_argument("--prompts", type=int, default=8, help="distinct prompts (each gets a greedy reference first)")

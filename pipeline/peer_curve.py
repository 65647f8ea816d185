"""llama.cpp's llama-server at concurrency, beside our concurrency curve, and the figures published against it.

validate's concurrency curve (`validate.batch_curve`) measures ours at each level; `peer_curve` starts
`llama-server -np N` (N slots, the same GGUF, the context scaled so each slot keeps `peers.SERVER_CTX`) at each level
N, runs N clients that each send their next greedy request when the last is answered (as ours: every prompt at
least once per level) and records the same figures: aggregate tokens/s, time to first token and
inter-token latency p50/p99. The entries join validate.json's `batch_curve` as method `llama-server`.

The figures that compare us with the peer are computed in one place, pipeline/peers.py: `best_mode` (which of the
peer's modes is its best: the one with more end-to-end tokens/s) and `ratio` (ours over the peer's best), so the
choice cannot be inverted in one place and not another (tests/test_peer_figures.py pins both on a stand-in
llama-server).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from pipeline import peers
from pipeline.figures import curve_point, steal_ms, steal_since
from pipeline.peers import ratio

PEER_METHOD = "llama-server"  # the method name of the peer's entries in batch_curve



def curve_requests(c: int, prompts: int) -> int:
    """Requests per level of the concurrency curve, ours and the peer's: every prompt once at least (a level of one
    request had measured one prompt, the first: hybrid 1.42x baseline there where the eight prompts gave 1.92x), and
    at least c."""
    return max(c, prompts)


def burst(srv: peers.LlamaServer, texts: list[str], c: int, new: int) -> dict:
    """c clients on a server with c slots, each sending its next request when the last is answered, as many requests
    as ours at the level (`curve_requests`): aggregate tokens/s over the wall time; per request, time to first
    token (its wall time less the server's decode time: queueing and prompt) and inter-token latency (its decode
    time over its tokens), as p50/p99 over the requests."""
    def one(i: int) -> tuple[dict, float]:
        t = time.perf_counter()
        r = srv.chat(texts[i % len(texts)], new)
        return r, time.perf_counter() - t

    t0, s0 = time.perf_counter(), steal_ms()
    with ThreadPoolExecutor(c) as ex:
        rs = list(ex.map(one, range(curve_requests(c, len(texts)))))
    wall, stolen = time.perf_counter() - t0, steal_since(s0)
    return curve_point([{"tokens": sum(r["tokens"] for r, _ in rs), "wall_s": wall,
                         "latency_ms": [1e3 * w for _, w in rs], "ttft_ms": [1e3 * w - r["decode_ms"] for r, w in rs],
                         "itl_ms": [r["decode_ms"] / r["tokens"] for r, _ in rs if r["tokens"]], "steal_ms": stolen}])


def peer_curve(spec, texts: list[str], levels: list[int], new: int, log=print) -> list[dict]:
    """`llama-server -np N` at each level N on the spec's target GGUF, plain: batch_curve entries (method
    `llama-server`). [] where the target is not a GGUF; one entry with a `note` where the server is not built or
    failed (the run goes on)."""
    gguf = peers.gguf_of(spec)
    if gguf is None:
        return []
    exe = peers.binary()
    if exe is None:
        return [{"concurrency": None, "method": PEER_METHOD, "tokens_per_s": None, "note": peers.NOT_BUILT}]
    threads, out = peers.server_threads(spec), []
    log_dir = spec.report_dir / "llama-server"
    for c in levels:
        port = peers.free_port()
        cmd = peers.server_command(exe, gguf, port, threads, ctx=peers.SERVER_CTX * c, slots=c)
        try:
            with peers.LlamaServer(cmd, port, log_dir / f"llama-server-np{c}.log") as srv:
                srv.chat(texts[0], 8)  # warm
                out.append({"concurrency": c, "method": PEER_METHOD, "slots": c, **burst(srv, texts, c, new)})
        except (OSError, RuntimeError, ValueError, TimeoutError) as e:
            log(f"  llama-server -np {c} failed: {type(e).__name__}: {str(e)[:300]}")
            out.append({"concurrency": c, "method": PEER_METHOD, "tokens_per_s": None,
                        "note": f"llama-server failed: {type(e).__name__}: {str(e)[:300]}"})
            break
        log(f"  concurrency {c}: llama-server -np {c} {out[-1]['tokens_per_s']:.1f} tokens/s")
    return out


def ratios_at_concurrency(curve: list[dict], method: str) -> dict[str, float]:
    """Per level, `method`'s aggregate tokens/s over llama-server's at the same level in the same curve."""
    by = {(e["concurrency"], e["method"]): e.get("tokens_per_s") for e in curve}
    out = {}
    for c in sorted({e["concurrency"] for e in curve if e["method"] == PEER_METHOD and e["concurrency"]}):
        r = ratio(by.get((c, method)), {"tokens_per_s": by.get((c, PEER_METHOD))})
        if r is not None:
            out[str(c)] = round(r, 3)
    return out

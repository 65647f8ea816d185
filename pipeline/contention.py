"""Decoding on a busy machine: one other CPU-bound process beside the decoder, and what it costs.

A busy process is a Python busy loop started here and always killed (a `with` block). `measure` alternates quiet and
busy rounds of the same decode (quiet, busy, quiet, busy, ...) so that drift in the machine's other load hits both
alike, and reports the medians and their ratio (`slowdown`: quiet tokens/s over busy tokens/s).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

from pipeline import peers
from pipeline.client import chat_text, generate
from pipeline.common import OMP_ENV
from pipeline.triton import server

BUSY_LOOP = "while True: pass"


@contextlib.contextmanager
def busy_process() -> Iterator[subprocess.Popen]:
    """One CPU-bound process (a Python busy loop) for the duration of the block; killed however the block ends."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.2)  # running before the first timed token
        yield proc
    finally:
        proc.kill()
        proc.wait()


def measure(run: Callable[[], float], rounds: int = 2) -> dict:
    """`run()` returns tokens/s of one decode; quiet and busy rounds alternate, `rounds` of each."""
    quiet, busy = [], []
    for _ in range(rounds):
        quiet.append(run())
        with busy_process():
            busy.append(run())
    q, b = statistics.median(quiet), statistics.median(busy)
    return {"quiet_tokens_per_s": q, "busy_tokens_per_s": b, "slowdown": q / b if b else None,
            "quiet_rounds": quiet, "busy_rounds": busy}



def _served(generate, url: str, text: str, max_tokens: int, method: str) -> dict:
    """One greedy request to the served model as validate sends it (perf metrics on, switch-off disabled)."""
    return generate(url, "tensorrt_llm_bls", text, max_tokens, method=method, stream=True, temperature=0.0,
                    return_perf_metrics=True, disable_at_batch=0)


def served_section(spec, tokenizer, prompt: str, methods: list[str], new: int = 64, rounds: int = 2,
                   log=print) -> dict:
    """bench.json's `contention`: ours through the served gRPC path (each method in `methods` the server serves)
    and llama-server plain on the target's GGUF, quiet against one busy process, `new` tokens of one prompt.

    Ours runs through tritonserver (started here unless it is up, stopped again if started here), since the
    served decode thread is what a user meets; a server that cannot start is a note, not a figure."""
    out: dict = {"new_tokens": new, "rounds": rounds, "cores": os.cpu_count(),
                 "busy_process": f"python -c '{BUSY_LOOP}'",
                 "openmp": {k: os.environ.get(k, v) for k, v in OMP_ENV.items()}, "ours": {}}
    started = None
    try:
        if server.running_pid(spec) is None or not server.is_ready(spec):
            started = server.start(spec, log=log)
        url, text = server.grpc_url(spec), chat_text(tokenizer, prompt)
        for m in methods:
            _served(generate, url, text, 8, m)

            def run(m=m) -> float:
                r = _served(generate, url, text, new, m)
                return r["num_output_tokens"] / r["latency_s"]

            out["ours"][m] = measure(run, rounds)
            log(f"  contention, ours {m}: {out['ours'][m]['quiet_tokens_per_s']:.1f} -> "
                f"{out['ours'][m]['busy_tokens_per_s']:.1f} tokens/s ({out['ours'][m]['slowdown']:.2f}x)")
    except (server.ServerError, RuntimeError, OSError) as e:
        out["ours"] = {"note": f"not served: {type(e).__name__}: {str(e)[:300]}"}
    finally:
        if started is not None:
            started.stop()
    gguf, exe = peers.gguf_of(spec), peers.binary()
    if gguf is None:
        return out
    if exe is None:
        out["llama_cpp_server"] = {"note": peers.NOT_BUILT}
        return out
    port = peers.free_port()
    cmd = peers.server_command(exe, gguf, port, peers.server_threads(spec))
    try:
        with peers.LlamaServer(cmd, port, spec.report_dir / "llama-server" / "contention.log") as srv:
            srv.chat(prompt, 8)
            out["llama_cpp_server"] = {"plain": measure(lambda: srv.chat(prompt, new)["tokens_per_s"], rounds)}
        p = out["llama_cpp_server"]["plain"]
        log(f"  contention, llama-server plain: {p['quiet_tokens_per_s']:.1f} -> {p['busy_tokens_per_s']:.1f} "
            f"tokens/s ({p['slowdown']:.2f}x)")
    except (OSError, RuntimeError, ValueError) as e:
        out["llama_cpp_server"] = {"note": f"llama-server failed: {type(e).__name__}: {str(e)[:300]}"}
    return out

"""The OpenAI front under a crowd (issue 50's full-size figures; tests/test_front_door.py runs a small one).

Serves a tiny random model (made here, as the tests make theirs) with PIPELINE_API_KEY set, then: a normal client's
latency alone; the same while `--idle` connections sit silent and `--slow` clients trickle their body a byte at a
time; how the crowd was answered (408 for both kinds once their time is up); a burst past `openai.max_concurrent`
(429 with Retry-After); and the front's threads and file descriptors before (after a warm-up at the request limit,
which makes the checking pool the front keeps), during and after, with its connections to Triton's gRPC port.

    PYTHONPATH=. .venv/bin/python experiments/front_door_crowd.py --idle 512 --slow 256
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEY = "crowd-key"


def deployment(root: Path, header_s: float, body_s: float, limit: int) -> Path:
    """A tiny target served by `python -m pipeline serve` (spec written to root/build/crowd.yaml)."""
    sys.path.insert(0, str(ROOT))
    # the tests' tiny-model helpers: this script needs a model and makes one as they do
    from pipeline import spec as specmod
    from pipeline.cli import main
    from pipeline.engine import build_target
    from pipeline.triton import server as srvmod
    from tests.conftest import make_model_dir, train_tokenizer, write_spec

    make_model_dir(root / "models" / "target", tokenizer=train_tokenizer())
    ports = {"grpc_port": srvmod.free_port(), "http_port": srvmod.free_port(), "metrics_port": srvmod.free_port()}
    path = write_spec(root, name="crowd", triton={**ports, "models": ["ensemble"]},
                      openai={"port": srvmod.free_port(), "max_concurrent": limit, "header_timeout_s": header_s,
                              "body_timeout_s": body_s},
                      limits={"max_batch_size": max(1, limit // 2), "max_input_len": 128, "max_seq_len": 512,
                              "max_draft_len": 8})
    build_target(specmod.load(path), log=lambda *a: None)
    assert main(["serve", str(path)]) == 0
    return path


def post(url: str, body: dict, timeout: float = 120) -> tuple[int, float, object]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status, time.perf_counter() - t0, r.headers
    except urllib.error.HTTPError as e:
        e.read()
        return e.code, time.perf_counter() - t0, e.headers


def latencies(url: str, body: dict, n: int) -> list[float]:
    out = []
    for _ in range(n):
        status, took, _ = post(url, body)
        assert status == 200, status
        out.append(took)
    return out


def status_of(sock: socket.socket) -> str:
    try:
        head = sock.recv(64)
    except OSError as e:
        return f"error {type(e).__name__}"
    return head.split(b"\r\n", 1)[0].decode(errors="replace") or "closed"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--idle", type=int, default=512)
    ap.add_argument("--slow", type=int, default=256)
    ap.add_argument("--header-s", type=float, default=10.0)
    ap.add_argument("--body-s", type=float, default=30.0)
    ap.add_argument("--limit", type=int, default=16, help="openai.max_concurrent")
    ap.add_argument("--tokens", type=int, default=16, help="new tokens per normal request")
    args = ap.parse_args()

    import psutil

    from pipeline import spec as specmod
    from pipeline.cli import main as cli
    from pipeline.triton import openai_api

    os.environ["PIPELINE_API_KEY"] = KEY
    root = Path(tempfile.mkdtemp(prefix="crowd-"))
    path = deployment(root, args.header_s, args.body_s, args.limit)
    s = specmod.load(path)
    out: dict = {"idle": args.idle, "slow": args.slow, "limit": args.limit}
    try:
        url = openai_api.base_url(s) + "/completions"
        body = {"model": s.name, "prompt": "Explain how rain forms over the ocean.", "max_tokens": args.tokens,
                "temperature": 0}
        front = psutil.Process(openai_api.running_pid(s))

        def state() -> dict:  # threads, file descriptors, and TCP connections to Triton's gRPC port (one channel)
            grpc = [c for c in front.net_connections("inet") if c.raddr and c.raddr.port == s.triton.grpc_port
                    and c.status == psutil.CONN_ESTABLISHED]
            return {"threads": front.num_threads(), "fds": front.num_fds(), "triton_connections": len(grpc)}

        warm = [threading.Thread(target=post, args=(url, body)) for _ in range(args.limit)]
        for w in warm:  # the limit's worth at once: the front's checking pool (one thread a running request) is made
            w.start()
        for w in warm:
            w.join()
        latencies(url, body, 3)
        out["before"] = state()
        out["quiet_s"] = statistics.median(latencies(url, body, 7))

        port = s.openai.port
        idle = [socket.create_connection(("127.0.0.1", port), timeout=args.header_s + 30) for _ in range(args.idle)]
        slow = []
        for _ in range(args.slow):
            c = socket.create_connection(("127.0.0.1", port), timeout=args.body_s + 30)
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      + f"Authorization: Bearer {KEY}\r\nContent-Length: 100000\r\n\r\n{{".encode())
            slow.append(c)
        stop = threading.Event()

        def trickle() -> None:  # a byte a second to each slow client's body
            while not stop.wait(1.0):
                for c in slow:
                    try:
                        c.send(b" ")
                    except OSError:
                        pass
        t = threading.Thread(target=trickle, daemon=True)
        t.start()
        time.sleep(1.0)
        out["during"] = state()
        out["crowded_s"] = statistics.median(latencies(url, body, 7))
        out["crowded_vs_quiet"] = out["crowded_s"] / out["quiet_s"]
        t0 = time.monotonic()
        idle_answers = [status_of(c) for c in idle]
        out["idle_answered_after_s"] = time.monotonic() - t0
        slow_answers = [status_of(c) for c in slow]
        stop.set()
        for c in idle + slow:
            c.close()
        count = lambda xs: {k: xs.count(k) for k in sorted(set(xs))}  # noqa: E731
        out["idle_answers"], out["slow_answers"] = count(idle_answers), count(slow_answers)

        # A burst of long requests past the limit: the excess is told to come back.
        long = {**body, "max_tokens": 200}
        results: list = []
        burst = [threading.Thread(target=lambda: results.append(post(url, long))) for _ in range(2 * args.limit)]
        for b in burst:
            b.start()
        time.sleep(0.5)
        running = state()  # the limit's worth of requests running at once
        for b in burst:
            b.join()
        out["burst"] = {"sent": len(burst), "answers": count([r[0] for r in results]),
                        "retry_after": sorted({r[2].get("Retry-After", "") for r in results if r[0] == 429}),
                        "during": running}
        time.sleep(3)
        out["after"] = state()
    finally:
        cli(["stop", str(path)])
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

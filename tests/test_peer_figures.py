"""The figures published against llama-server (its best mode, the ratios, its concurrency curve), computed from runs
on a stand-in llama-server: a real HTTP server on 127.0.0.1 speaking its chat API with its `timings` fields, started
from the command line pipeline/peers.py builds, whose speed per mode the test sets."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline import peer_curve, peers
from pipeline.readme import _peers

STAND_IN = """#!{python}
# llama-server as far as the peer code uses it: /health and /v1/chat/completions with `timings` (draft counts in
# draft mode, -md). Each answer takes SLEEP_PLAIN or SLEEP_DRAFT seconds; -np N slots answer N requests at once.
import json, os, sys, time, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
slots = threading.Semaphore(int(args[args.index("-np") + 1]))
draft = "-md" in args
pause = float(os.environ["SLEEP_DRAFT" if draft else "SLEEP_PLAIN"])
with open(os.environ["STAND_IN_LOG"], "a") as f:
    f.write(json.dumps(args) + "\\n")
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _send(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self._send({{"status": "ok"}})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["max_tokens"]
        with slots:
            time.sleep(pause)
        tm = {{"prompt_n": 5, "prompt_ms": 1.0, "predicted_n": n, "predicted_ms": 1e3 * pause,
              "predicted_per_second": n / pause}}
        if draft:
            tm.update(draft_n=2 * n, draft_n_accepted=n)
        self._send({{"choices": [{{"message": {{"role": "assistant", "content": "x" * n}}}}],
                    "usage": {{"completion_tokens": n}}, "timings": tm}})
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """peers' binary and GGUFs (target and draft) replaced by the stand-in and empty files; returns the spec and the
    command lines the stand-in was started with."""
    exe = tmp_path / "llama-server"
    exe.write_text(STAND_IN.format(python=sys.executable))
    exe.chmod(0o755)
    gguf = {p: tmp_path / f"{p}.gguf" for p in ("target", "draft")}
    for f in gguf.values():
        f.write_bytes(b"")
    log = tmp_path / "starts.jsonl"
    monkeypatch.setenv("STAND_IN_LOG", str(log))
    monkeypatch.setattr(peers, "binary", lambda *a, **k: exe)
    monkeypatch.setattr(peers, "gguf_of", lambda spec, part="target": gguf[part])
    spec = SimpleNamespace(threads=1, report_dir=tmp_path / "report")

    def starts() -> list[list[str]]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return spec, starts


def _peer(spec, plain_s: float, draft_s: float, monkeypatch) -> dict:
    monkeypatch.setenv("SLEEP_PLAIN", str(plain_s))
    monkeypatch.setenv("SLEEP_DRAFT", str(draft_s))
    return peers.llama_server_peer(spec, ["a", "b"], 8, log=lambda *a: None, n_maxes=(3,))["llama_cpp_server"]


def test_the_peers_best_mode_is_its_faster_one_whichever_that_is(stand_in, monkeypatch):
    spec, _ = stand_in
    fast_draft = _peer(spec, plain_s=0.25, draft_s=0.05, monkeypatch=monkeypatch)
    assert fast_draft["best"] == "draft n-max 3"
    assert fast_draft["tokens_per_s"] == fast_draft["draft"]["tokens_per_s"] > fast_draft["plain"]["tokens_per_s"]
    assert fast_draft["draft"]["acceptance"] == pytest.approx(0.5)
    fast_plain = _peer(spec, plain_s=0.05, draft_s=0.25, monkeypatch=monkeypatch)
    assert fast_plain["best"] == "plain"
    assert fast_plain["tokens_per_s"] == fast_plain["plain"]["tokens_per_s"] > fast_plain["draft"]["tokens_per_s"]


def test_the_published_ratio_is_ours_over_the_peers_best_mode(stand_in, monkeypatch):
    spec, _ = stand_in
    entry = _peer(spec, plain_s=0.25, draft_s=0.05, monkeypatch=monkeypatch)
    ours = 2.0 * entry["draft"]["tokens_per_s"]
    assert peers.ratio(ours, entry) == pytest.approx(2.0)
    assert peers.ratio(ours, {"tokens_per_s": None, "note": peers.NOT_BUILT}) is None
    report = {"methods": {"draft_target": {"tokens_per_s": ours}}, "peers": {"llama_cpp_server": entry}}
    (line,) = _peers(report)
    assert "(draft_target 2.00x it)" in line  # against the draft mode (the faster), not plain (5x slower)


def test_the_peer_at_concurrency_runs_a_server_with_n_slots_per_level_and_reports_its_latencies(stand_in,
                                                                                                 monkeypatch):
    spec, starts = stand_in
    monkeypatch.setenv("SLEEP_PLAIN", "0.1")
    monkeypatch.setenv("SLEEP_DRAFT", "1")
    curve = peer_curve.peer_curve(spec, ["p"], [1, 4], 8, log=lambda *a: None)
    assert [cmd[cmd.index("-np") + 1] for cmd in starts()] == ["1", "4"]
    assert [cmd[cmd.index("-c") + 1] for cmd in starts()] == [str(peers.SERVER_CTX), str(4 * peers.SERVER_CTX)]
    assert all("-md" not in cmd for cmd in starts())
    one, four = curve
    assert (one["concurrency"], four["concurrency"]) == (1, 4) and one["method"] == peer_curve.PEER_METHOD
    assert one["tokens_per_s"] > 0 and four["tokens_per_s"] > 0
    # inter-token latency from the server's own timings (100 ms for 8 tokens); time to first token is the wall time
    # less that decode time
    assert four["itl_ms_p50"] == pytest.approx(100 / 8) and four["itl_ms_p99"] >= four["itl_ms_p50"]
    assert 0 <= four["ttft_ms_p50"] <= four["ttft_ms_p99"]


def test_ratios_at_concurrency_pair_each_level_with_the_peer_at_the_same_level():
    curve = [{"concurrency": 1, "method": "baseline", "tokens_per_s": 30.0},
             {"concurrency": 4, "method": "baseline", "tokens_per_s": 80.0},
             {"concurrency": 1, "method": "llama-server", "tokens_per_s": 25.0},
             {"concurrency": 4, "method": "llama-server", "tokens_per_s": 32.0}]
    assert peer_curve.ratios_at_concurrency(curve, "baseline") == {"1": 1.2, "4": 2.5}
    assert peer_curve.ratios_at_concurrency(curve[:2], "baseline") == {}


def test_no_peer_curve_for_a_target_that_is_not_a_gguf_and_a_note_when_the_server_is_not_built(monkeypatch):
    spec = SimpleNamespace(threads=1, report_dir=Path("/nonexistent"))
    monkeypatch.setattr(peers, "gguf_of", lambda spec, part="target": None)
    assert peer_curve.peer_curve(spec, ["p"], [1], 8) == []
    monkeypatch.setattr(peers, "gguf_of", lambda spec, part="target": Path("/x.gguf"))
    monkeypatch.setattr(peers, "binary", lambda *a, **k: None)
    (e,) = peer_curve.peer_curve(spec, ["p"], [1], 8)
    assert e["tokens_per_s"] is None and e["note"] == peers.NOT_BUILT

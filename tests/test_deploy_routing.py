"""Routing that keeps a conversation on its replica, measured on loopback: replicas (`serve`s of one tiny model,
each with its own prompt cache, on their own ports) behind the HAProxy configuration `python -m pipeline deploy
--replica ...` writes, driven by 4 sessions of 6 turns, each with a long prefix of its own. The same turns go through
the session-affine proxy (two replicas) and through round-robin (two others, cold caches too), alternating request by
request; every greedy answer is compared with the same request made with the prompt cache off. Each replica's cache
holds its share of the conversations, not all of them (`_cache_budget`), as in a deployment with more conversations
than one cache holds."""

from __future__ import annotations

import http.client
import json
import os
import random
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pipeline import spec as specmod
from pipeline.triton import openai_api
from pipeline.triton import server as srvmod
from tests.conftest import make_model_dir, prompts, stop_later, write_spec

SESSIONS, TURNS, NEW_TOKENS = 4, 6, 8
QUESTIONS = ["Summarise the notes.", "Which step comes first?", "Name one risk.", "What would you test?",
             "Shorten that.", "Anything else?"]


def _haproxy() -> str:
    exe = shutil.which("haproxy") or (Path("/usr/sbin/haproxy").is_file() and "/usr/sbin/haproxy")
    if not exe:
        pytest.fail("haproxy is not installed: run scripts/deploy_tools.sh (apt-get install haproxy; README)")
    return exe


@pytest.fixture(scope="module")
def served_replicas(tmp_path_factory, tiny_tokenizer):
    """Four roots (hosts in miniature), one engine: each replica serves it on its own ports with its own cache. The
    first two go behind the session-affine proxy, the last two behind round-robin, both measured in the same run
    (their requests alternate, so both see the same load on a shared machine)."""
    from pipeline.cli import main
    from pipeline.engine import build_target

    roots = [tmp_path_factory.mktemp(f"replica{i}") for i in range(4)]
    # The measurement in docs/deploy.md sets a larger model (prefill, which the cache saves, then outweighs the
    # HTTP and gRPC hops): SPEC_ROUTING_MODEL=hidden,layers, e.g. 512,8.
    hidden, layers = (int(x) for x in os.environ.get("SPEC_ROUTING_MODEL", "256,4").split(","))
    model = make_model_dir(roots[0] / "models" / "target", layers=layers, hidden=hidden, heads=hidden // 64,
                           kv_heads=2, tokenizer=tiny_tokenizer)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 4096}))
    cache_bytes = _cache_budget(tiny_tokenizer, layers, kv_heads=cfg["num_key_value_heads"],
                                head_dim=cfg["hidden_size"] // cfg["num_attention_heads"])
    free = srvmod.free_ports(2 + 4 * len(roots))  # distinct: ports taken one at a time can repeat
    proxy_ports, free = free[:2], free[2:]
    paths = []
    for i, root in enumerate(roots):
        if i:
            (root / "models").mkdir()
            (root / "models" / "target").symlink_to(model)
        grpc, http, metrics, api = free[4 * i:4 * i + 4]
        paths.append(write_spec(
            root, name="routed", triton={"grpc_port": grpc, "http_port": http, "metrics_port": metrics,
                                         "models": ["ensemble"], "startup_timeout_s": 240},
            openai={"port": api}, prompt_cache={"bytes": cache_bytes, "block_tokens": 16},
            limits={"max_batch_size": 4, "max_input_len": 1536, "max_seq_len": 2048, "max_draft_len": 8},
            deploy={"proxy_port": proxy_ports[i // 2]}))
    specs = [specmod.load(p) for p in paths]
    build_target(specs[0], log=lambda *a, **k: None)
    for root in roots[1:]:
        (root / "engines").mkdir()
        (root / "engines" / "routed").symlink_to(specs[0].engine_dir)
    try:
        with ThreadPoolExecutor(2) as pool:  # two at a time: each start is mostly its stub importing torch
            assert list(pool.map(lambda p: main(["serve", str(p)]), paths)) == [0] * len(paths)
        yield specs, paths
    finally:
        with ThreadPoolExecutor(4) as pool:  # `serve` started an OpenAI front beside each server: stop those too
            list(pool.map(openai_api.stop, specs))
        stop_later(*specs)


def _cache_budget(tokenizer, layers: int, kv_heads: int, head_dim: int) -> int:
    """Each replica's prompt-cache budget. By default room for two and a half sessions (their longest document plus
    six turns of question, answer and chat markup, as bf16 K/V): what a deployment has, where more conversations
    reach a replica than its cache holds, so where a turn lands decides whether its history is still cached. The
    session-affine proxy sends each replica its share (the hash of the four keys puts three on one replica and one
    on the other, so the busier one evicts a little too); round-robin sends every replica all four.
    SPEC_ROUTING_CACHE=all gives every replica 256 MiB instead (nothing is ever evicted), the geometry
    docs/deploy.md measures beside it."""
    if os.environ.get("SPEC_ROUTING_CACHE", "share") == "all":
        return 1 << 28
    longest = max(len(tokenizer(doc)["input_ids"]) for doc in _documents())
    session_tokens = longest + TURNS * (NEW_TOKENS + 40)
    return int(2.5 * session_tokens) * 2 * layers * kv_heads * head_dim * 2  # K and V, bf16 (kernels.KV_DTYPE)


def _proxy(spec_path: Path, specs, out: Path, round_robin: bool) -> subprocess.Popen:
    """`python -m pipeline deploy SPEC --replica ...` writes the config; the real HAProxy runs it on loopback."""
    from pipeline.cli import main

    args = ["deploy", str(spec_path), "--out", str(out)]
    for s in specs:
        args += ["--replica", f"127.0.0.1:{s.openai.port}"]
    assert main(args + (["--round-robin"] if round_robin else [])) == 0
    proc = subprocess.Popen([_haproxy(), "-db", "-f", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while srvmod.port_free("127.0.0.1", specs[0].deploy.proxy_port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"haproxy did not listen: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.1)
    time.sleep(2.5)  # the first health checks mark both replicas up
    return proc


def _chat(port: int, messages: list[dict], session: int, by_header: bool | None, cache: bool = True) -> dict:
    """One streamed chat through the proxy: the answer, usage (cached_tokens), time to first token, the replica.
    The session key goes in the X-Session-Id header, in the body's `user` (by_header False), or nowhere (None)."""
    body = {"model": "routed", "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"Content-Type": "application/json"}
    if by_header:
        headers["X-Session-Id"] = f"conversation-{session}"
    elif by_header is False:
        body["user"] = f"user-{session}"  # the OpenAI body's own session key, for clients that send no header
    if not cache:
        body["cache_prompt"] = False
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
    r = conn.getresponse()
    assert r.status == 200, r.read()[:500]
    text, usage, ttft = [], None, None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for c in chunk.get("choices", []):
            piece = c.get("delta", {}).get("content")
            if piece:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text.append(piece)
    conn.close()
    return {"text": "".join(text), "ttft": ttft, "prompt_tokens": usage["prompt_tokens"],
            "cached": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
            "replica": r.getheader("X-Replica")}


def _documents() -> list[str]:
    """A long prefix per session (its own notes: no two sessions share a cached block)."""
    lines = prompts()
    docs = []
    for s in range(SESSIONS):
        rng = random.Random(s)
        docs.append(f"Notes of project {s}:\n" + "\n".join(rng.sample(lines, 24)))
    return docs


def _drive(ports: list[int]) -> list[dict[tuple[int, int], dict]]:
    """4 sessions x 6 turns through each proxy, a request to one then the same turn to the next: each round of turns
    visits the sessions in an order rotated by one, so plain rotation does not happen to keep a session on one
    replica. Returns, per proxy, the results by (session, turn)."""
    docs = _documents()
    history = [{s: [{"role": "system", "content": docs[s]}] for s in range(SESSIONS)} for _ in ports]
    out: list[dict] = [{} for _ in ports]
    for t in range(TURNS):
        for k in range(SESSIONS):
            s = (k + t) % SESSIONS
            for i, port in enumerate(ports):
                history[i][s].append({"role": "user", "content": QUESTIONS[t]})
                res = _chat(port, history[i][s], s, by_header=s % 2 == 0)
                res["messages"] = [dict(m) for m in history[i][s]]
                history[i][s].append({"role": "assistant", "content": res["text"]})
                out[i][(s, t)] = res
    return out


def _figures(run: dict) -> dict:
    later = [r for (s, t), r in run.items() if t > 0]
    return {"hit_rate": sum(r["cached"] for r in run.values()) / sum(r["prompt_tokens"] for r in run.values()),
            "hit_rate_after_first_turn": sum(r["cached"] for r in later) / sum(r["prompt_tokens"] for r in later),
            "mean_ttft_s": sum(r["ttft"] for r in run.values()) / len(run),
            "mean_ttft_after_first_turn_s": sum(r["ttft"] for r in later) / len(later),
            "prompt_tokens": sum(r["prompt_tokens"] for r in run.values())}


def test_sessions_stay_on_their_replica_and_find_their_prompt_cache(served_replicas, tmp_path):
    """Session affinity: every turn of a conversation reaches the replica that served its first turn, whether the
    key is the X-Session-Id header or the body's `user`; at least 90% of the prompt tokens a session had already
    sent come from the cache; round-robin, on two other replicas in the same run, finds fewer; every greedy answer
    equals round-robin's and the same request's with the cache off. Requests with no key are spread (fewest
    connections)."""
    specs, paths = served_replicas
    ports = [specs[0].deploy.proxy_port, specs[2].deploy.proxy_port]
    proxies = [_proxy(paths[0], specs[:2], tmp_path / "affine.cfg", round_robin=False),
               _proxy(paths[2], specs[2:], tmp_path / "rr.cfg", round_robin=True)]
    try:
        affine, rr = _drive(ports)
        reference = {key: _chat(ports[0], r["messages"], key[0], by_header=True, cache=False)
                     for key, r in affine.items()}
        keyless = [_chat(ports[0], [{"role": "user", "content": q}], -1, by_header=None) for q in QUESTIONS[:4]]
    finally:
        for p in proxies:
            p.terminate()
            p.wait(10)

    fa, fr = _figures(affine), _figures(rr)
    print(f"\nrouting on loopback, {SESSIONS} sessions x {TURNS} turns, {fa['prompt_tokens']} prompt tokens: "
          f"session-affine hit rate {fa['hit_rate']:.3f} (after the first turn {fa['hit_rate_after_first_turn']:.3f}),"
          f" mean TTFT {fa['mean_ttft_s'] * 1000:.1f} ms; round-robin hit rate {fr['hit_rate']:.3f} (after the first "
          f"turn {fr['hit_rate_after_first_turn']:.3f}), mean TTFT {fr['mean_ttft_s'] * 1000:.1f} ms; "
          f"TTFT ratio {fa['mean_ttft_s'] / fr['mean_ttft_s']:.2f} (after the first turn "
          f"{fa['mean_ttft_after_first_turn_s'] * 1000:.1f} vs {fr['mean_ttft_after_first_turn_s'] * 1000:.1f} ms: "
          f"{fa['mean_ttft_after_first_turn_s'] / fr['mean_ttft_after_first_turn_s']:.2f})")
    replicas = {s: {affine[(s, t)]["replica"] for t in range(TURNS)} for s in range(SESSIONS)}
    print(f"caches: {os.environ.get('SPEC_ROUTING_CACHE', 'share')}; session -> replica (affine): {replicas}")
    assert all(len(r) == 1 for r in replicas.values()), replicas
    assert {next(iter(r)) for r in replicas.values()} == {"replica1", "replica2"}, replicas  # both used
    assert {r["replica"] for r in rr.values()} == {"replica1", "replica2"}
    assert {r["replica"] for r in keyless} == {"replica1", "replica2"}  # no key: fewest connections, both serve
    assert fa["hit_rate_after_first_turn"] >= 0.9, fa
    assert fa["hit_rate"] > fr["hit_rate"], (fa, fr)
    if os.environ.get("SPEC_ROUTING_CACHE", "share") != "all":
        # caches of a replica's share: round-robin's later turns find little of their history (0.41-0.43 measured;
        # 0.76 where every cache holds every conversation)
        assert fr["hit_rate_after_first_turn"] < 0.6, fr
    assert all(reference[k]["cached"] == 0 for k in reference)
    for key, r in affine.items():
        assert r["text"] == reference[key]["text"] == rr[key]["text"], key

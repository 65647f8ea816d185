"""The deployment's doors (pipeline/door.py, docs/openai.md "Exposure"): a bind beyond loopback needs the API
key; with a key every port that can run the model asks for it; the OpenAI front bounds what clients can hold and
answers their mistakes 4xx in OpenAI's shape. Driven on the real tritonserver and real sockets."""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request

import psutil
import pytest

from pipeline import door
from pipeline import spec as specmod
from pipeline.cli import main
from pipeline.triton import openai_api
from pipeline.triton import server as srvmod
from tests.conftest import write_spec

KEY = "k3y-for-tests"
PROMPT = "Explain how rain forms over the ocean."


# ------------------------------------------------------------------------------------------------ no server needed


def test_a_bind_beyond_loopback_without_a_key_is_refused_at_check(tiny_root, capsys):
    for section, host in (("triton", "0.0.0.0"), ("openai", "192.0.2.7"), ("triton", "::")):
        path = write_spec(tiny_root, name="exposed", **{section: {"host": host}})
        s = specmod.load(path)
        why = door.exposure_error(s, env={})
        assert why and f"{section}.host" in why and door.API_KEY_ENV in why, why
        assert door.exposure_error(s, env={door.API_KEY_ENV: KEY}) is None
        os.environ.pop(door.API_KEY_ENV, None)
        assert main(["check", str(path)]) == 2
        assert f"{section}.host" in capsys.readouterr().err
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        s = specmod.load(write_spec(tiny_root, name="closed", triton={"host": host}, openai={"host": host}))
        assert door.exposure_error(s, env={}) is None, host


@pytest.mark.server  # it asks to start tritonserver (and is refused)
def test_serve_refuses_to_bind_beyond_loopback_without_a_key(tiny_root, monkeypatch):
    monkeypatch.delenv(door.API_KEY_ENV, raising=False)
    s = specmod.load(write_spec(tiny_root, name="exposed2", openai={"host": "0.0.0.0"}))
    with pytest.raises(srvmod.ServerError, match="openai.host"):
        srvmod.start(s)
    with pytest.raises(srvmod.ServerError, match="openai.host"):
        openai_api.start(s)


def test_triton_flags_restrict_everything_but_health_and_never_log_the_key():
    flags = door.triton_flags(KEY)
    assert len(flags) == 2 and all(f.endswith(f":{door.KEY_HEADER}={KEY}") for f in flags)
    assert "health" not in flags[0].split(":")[0].split("=")[1].split(",")
    assert "inference" in flags[0] and "model-repository" in flags[1]
    assert door.triton_flags(None) == []
    assert KEY not in " ".join(door.redact(["x", *flags], KEY))
    with pytest.raises(ValueError, match="PIPELINE_API_KEY"):
        door.triton_flags("a:b")


@pytest.mark.parametrize("raw, code", [
    (b"[" * 5000 + b"]" * 5000, "invalid_json"),                     # nested past the parser
    (b'{"a": ' + b"[" * 40 + b"]" * 40 + b"}", "invalid_json"),      # nested past MAX_DEPTH
    (b'{"seed": ' + b"9" * 5000 + b"}", "invalid_json"),             # an integer of 5,000 digits
    (b'{"prompt": "\\ud800"}', "invalid_value"),                    # a lone surrogate
    (b'{"messages": [{"role": "user", "content": "a\\udfff"}]}', "invalid_value"),
    (b"\xff\xfe", "invalid_json"),
])
def test_malformed_bodies_are_the_clients_error(raw, code):
    with pytest.raises(openai_api.ApiError) as e:
        openai_api.parse_body(raw)
    assert e.value.status == 400 and e.value.code == code
    assert openai_api.parse_body(b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')  # a real pair


# ------------------------------------------------------------------------------------------ a keyed_served deployment


@pytest.fixture(scope="module")
def keyed_served(tiny_root, tiny_engine):
    """A deployment served with PIPELINE_API_KEY set (Triton and the front both see it), on loopback."""
    from pipeline.engine import build_target

    old = os.environ.get(door.API_KEY_ENV)
    os.environ[door.API_KEY_ENV] = KEY
    grpc, http, metrics, api = srvmod.free_ports(4)
    ports = {"grpc_port": grpc, "http_port": http, "metrics_port": metrics}
    path = write_spec(tiny_root, name="door", triton={**ports, "models": ["ensemble"], "startup_timeout_s": 240},
                      openai={"port": api, "max_concurrent": 2, "header_timeout_s": 1.5,
                              "body_timeout_s": 1.5, "max_connections": 64},
                      limits={"max_batch_size": 2, "max_input_len": 128, "max_seq_len": 512, "max_draft_len": 8})
    s = specmod.load(path)
    build_target(s, log=lambda *a: None)
    try:
        assert main(["serve", str(path)]) == 0
        yield s
    finally:
        main(["stop", str(path)])
        if old is None:
            os.environ.pop(door.API_KEY_ENV, None)
        else:
            os.environ[door.API_KEY_ENV] = old


def _post(url: str, body: dict | bytes, headers: dict | None = None, timeout: float = 60) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except json.JSONDecodeError:
            return e.code, {"raw": raw.decode(errors="replace")}


def _grpc_infer(s, headers: dict | None):
    """One streamed request to the (decoupled) ensemble with these gRPC headers: its first result, or the error."""
    import queue

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from pipeline.client import make_inputs

    q: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(srvmod.grpc_url(s)) as c:
        c.start_stream(callback=lambda result, error: q.put((result, error)), headers=headers)
        try:
            try:
                c.async_stream_infer("ensemble", make_inputs(PROMPT, 2, stream=True),
                                     enable_empty_final_response=True)
            except InferenceServerException:
                pass  # the stream was refused before the request went out: the callback has the reason
            result, error = q.get(timeout=60)
        finally:
            c.stop_stream(cancel_requests=True)
    if error is not None:
        raise error if isinstance(error, InferenceServerException) else InferenceServerException(str(error))
    return result


def test_with_a_key_no_port_answers_an_inference_request_without_it(keyed_served):
    from tritonclient.utils import InferenceServerException

    s = keyed_served
    # Triton's gRPC: refused without the header, answered with it.
    with pytest.raises(InferenceServerException, match="(?i)restricted|unavailable|permission|header"):
        _grpc_infer(s, None)
    out = _grpc_infer(s, door.grpc_headers({door.API_KEY_ENV: KEY}))
    assert out.as_numpy("text_output") is not None
    with pytest.raises(InferenceServerException):
        _grpc_infer(s, {door.GRPC_KEY_HEADER: "wrong"})
    # Triton's HTTP: generate, infer, metadata and the repository all refused without it; health answers.
    http = srvmod.http_url(s)
    gen = {"text_input": PROMPT, "max_tokens": 2}
    for path, body in (("/v2/models/ensemble/generate", gen), ("/v2/repository/index", {})):
        assert _post(http + path, body)[0] in (401, 403), path
    assert _post(http + "/v2/models/ensemble/generate", gen, {door.KEY_HEADER: KEY})[0] == 200
    for path in ("/v2/models/ensemble", "/v2/models/ensemble/config"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(http + path, timeout=10)
        assert e.value.code in (401, 403), path
    assert urllib.request.urlopen(http + "/v2/health/ready", timeout=10).status == 200
    # The metrics port serves counters, nothing that runs the model.
    metrics = srvmod.metrics_url(s).removesuffix("/metrics")
    assert _post(metrics + "/v2/models/ensemble/generate", gen)[0] >= 400
    # The front: a key or nothing; /health says only ready.
    base = openai_api.base_url(s)
    req = {"model": s.name, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    st, out = _post(base + "/completions", req)
    assert st == 401 and out["error"]["code"] == "invalid_api_key"
    st, out = _post(base + "/completions", req, {"Authorization": f"Bearer {KEY}"})
    assert st == 200 and out["usage"]["completion_tokens"] >= 1
    with urllib.request.urlopen(base.removesuffix("/v1") + "/health", timeout=10) as r:
        assert json.loads(r.read()) == {"status": "ok"}
    assert KEY not in srvmod.log_file(s).read_text()


def test_each_client_mistake_gets_a_4xx_in_openai_shape(keyed_served):
    s = keyed_served
    url = openai_api.base_url(s) + "/completions"
    auth = {"Authorization": f"Bearer {KEY}"}
    ok = {"model": s.name, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    cases = [
        (b"[" * 3000 + b"]" * 3000, {}, 400, "invalid_json"),
        (b'{"model": "door", "prompt": "x", "seed": ' + b"7" * 4400 + b"}", {}, 400, "invalid_json"),
        (b'{"model": "door", "prompt": "\\ud800", "max_tokens": 2}', {}, 400, "invalid_value"),
        (json.dumps({**ok, "top_k": 2**31}).encode(), {}, 400, "invalid_value"),
        (json.dumps({**ok, "seed": 2**64}).encode(), {}, 400, "invalid_value"),
        (json.dumps(ok).encode(), {"Content-Type": "text/plain"}, 415, "unsupported_media_type"),
        (json.dumps(ok).encode(), {"Host": "evil.example:8003"}, 421, "misdirected_request"),
    ]
    for body, extra, status, code in cases:
        got, out = _post(url, body, {**auth, **extra})
        assert got == status and out["error"]["code"] == code, (body[:60], got, out)
        assert set(out["error"]) == {"message", "type", "param", "code"}
    # A chunked body is counted as it arrives: past 16 MiB it is refused before it is read whole.
    sock = socket.create_connection(("127.0.0.1", s.openai.port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {KEY}\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
    piece = b"x" * (1 << 20)
    try:
        for _ in range(20):
            sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
    except OSError:
        pass  # the front answered and closed while we were still sending
    assert sock.recv(4096).startswith(b"HTTP/1.1 413")
    sock.close()
    # None of it hurt the deployment.
    assert _post(url, ok, auth)[0] == 200


def _front(s) -> psutil.Process:
    return psutil.Process(openai_api.running_pid(s))


def _crowd(s, base: str, auth: dict, req: dict) -> float:
    """16 idle sockets and 8 slow-body clients against the front, a normal request served beside them (its time
    returned), then two long streams holding both places and a third request refused; every one checked."""
    idle = [socket.create_connection(("127.0.0.1", s.openai.port), timeout=10) for _ in range(16)]
    slow = []
    for _ in range(8):
        c = socket.create_connection(("127.0.0.1", s.openai.port), timeout=10)
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: 500\r\n\r\n{{".encode())
        slow.append(c)
    t0 = time.monotonic()
    assert _post(base + "/completions", req, auth)[0] == 200  # served beside them
    served_in = time.monotonic() - t0
    for c in idle:
        assert c.recv(4096).startswith(b"HTTP/1.1 408"), "an idle connection is answered 408 and closed"
        assert c.recv(4096) == b""
    for c in slow:
        assert c.recv(4096).startswith(b"HTTP/1.1 408")
    for c in idle + slow:
        c.close()

    # Two long streams hold both places; a third request is told to come back.
    long = {**req, "max_tokens": 400, "stream": True, "prompt": "What is photosynthesis?"}
    held = []
    for _ in range(2):
        c = socket.create_connection(("127.0.0.1", s.openai.port), timeout=60)
        body = json.dumps(long).encode()
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        assert c.recv(4096).startswith(b"HTTP/1.1 200")
        held.append(c)
    req3 = urllib.request.Request(base + "/completions", data=json.dumps(req).encode(), method="POST",
                                  headers={"Content-Type": "application/json", **auth})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req3, timeout=30)
    assert e.value.code == 429 and e.value.headers["Retry-After"] == "1"
    assert json.loads(e.value.read())["error"]["code"] == "rate_limit_exceeded"
    for c in held:
        c.close()  # cancels their streams; their places come back
    deadline = time.monotonic() + 30
    while _post(base + "/completions", req, auth)[0] != 200:
        assert time.monotonic() < deadline, "the places held by closed streams never came back"
        time.sleep(0.2)
    return served_in


def test_idle_and_slow_clients_are_dropped_and_the_excess_refused_while_others_are_served(keyed_served):
    """Small limits (2 requests, 1.5 s to send headers and then the body): idle sockets and slow-body clients come and
    go, a normal client is served meanwhile, a request past the limit gets 429 with Retry-After. A second crowd leaves
    the front's threads and file descriptors where the first left them: nothing is kept per connection (the first
    makes what the front keeps for good: its checking pool, gRPC's own threads)."""
    s = keyed_served
    base = openai_api.base_url(s)
    auth = {"Authorization": f"Bearer {KEY}"}
    req = {"model": s.name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    t0 = time.monotonic()
    assert _post(base + "/completions", req, auth)[0] == 200
    quiet = time.monotonic() - t0
    _crowd(s, base, auth, req)
    proc = _front(s)
    fds0, threads0 = proc.num_fds(), proc.num_threads()
    served_in = _crowd(s, base, auth, req)
    assert served_in < max(10 * quiet, 5.0), (served_in, quiet)
    # Each crowd is 27 connections and 3 streams: anything kept per connection or request would show in tens. A
    # thread or two may still be ending (a cancelled stream's gRPC goodbye) or be the pool's last worker.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (proc.num_fds() > fds0 + 2 or proc.num_threads() > threads0 + 2):
        time.sleep(0.2)
    assert proc.num_fds() <= fds0 + 2 and proc.num_threads() <= threads0 + 2, (proc.num_fds(), fds0,
                                                                               proc.num_threads(), threads0)


def test_a_foreign_host_is_refused_but_loopback_names_are_served(keyed_served):
    s = keyed_served
    url = openai_api.base_url(s) + "/models"
    for host, status in (("localhost", 200), (f"127.0.0.1:{s.openai.port}", 200), ("[::1]:1", 200),
                         ("attacker.example", 421), ("127.0.0.1.attacker.example", 421)):
        req = urllib.request.Request(url, headers={"Host": host, "Authorization": f"Bearer {KEY}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                got = r.status
        except urllib.error.HTTPError as e:
            got = e.code
        assert got == status, host


def test_the_endpoint_binds_where_openai_host_says_and_triton_stays_on_loopback(keyed_served):
    s = keyed_served
    listening = {c.laddr.ip for c in _front(s).net_connections("inet") if c.status == psutil.CONN_LISTEN}
    assert listening == {s.openai.host}

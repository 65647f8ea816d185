"""The OpenAI-compatible endpoint `serve` starts, driven by real clients: the official `openai` package, raw HTTP
sockets and the project's own OpenAI client, over the tiny models on the real tritonserver (one per module)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from pipeline import door
from pipeline import spec as specmod
from pipeline.client import chat_text, generate
from pipeline.triton import openai_api
from pipeline.triton import server as srvmod
from tests.conftest import write_spec

PROMPT = "Explain how rain forms over the ocean."
LONG_PROMPT = "What is photosynthesis?"  # the tiny model streams it a token at a time (others: one piece, bytes)


@pytest.fixture(scope="module")
def served_deployment(tiny_root, tiny_engine):
    """`python -m pipeline serve` on a tiny target that is its own draft, with Medusa heads: every method."""
    from pipeline.cli import main
    from pipeline.engine import build_target
    from pipeline.train.draft import build_draft
    from pipeline.train.medusa import build_medusa

    grpc, http, metrics, api = srvmod.free_ports(4)
    ports = {"grpc_port": grpc, "http_port": http, "metrics_port": metrics}
    path = write_spec(tiny_root, name="oai", draft={"source": "models/target"},
                      medusa={"source": "train", "num_heads": 2, "choices": [[0], [1], [0, 0]],
                              "train": {"steps": 10, "minutes": 0.5, "sequences": 8, "seq_len": 24, "batch_size": 4}},
                      triton={**ports, "startup_timeout_s": 240}, openai={"port": api},
                      prompt_cache={"bytes": 1 << 26, "block_tokens": 16},
                      # room for a stream long enough to be abandoned mid-way
                      limits={"max_batch_size": 8, "max_input_len": 128, "max_seq_len": 512, "max_draft_len": 8},
                      validate={"max_prompts": 2, "max_new_tokens": 8, "concurrency": [1, 3]})
    s = specmod.load(path)
    quiet = lambda *a, **k: None  # noqa: E731
    build_target(s, log=quiet)
    build_draft(s, log=quiet)
    build_medusa(s, log=quiet)
    assert main(["serve", str(path)]) == 0
    try:
        yield s
    finally:
        main(["stop", str(path)])


@pytest.fixture(scope="module")
def client(served_deployment):
    from openai import OpenAI

    return OpenAI(base_url=openai_api.base_url(served_deployment), api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(served_deployment):
    from pipeline.runtime.engine_io import load_tokenizer

    return load_tokenizer(served_deployment.engine_dir / "target")


def _grpc(s, text: str, n: int, method: str | None = None) -> dict:
    return generate(srvmod.grpc_url(s), "ensemble", text, n, method=method)


def _raw(s, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    root = openai_api.base_url(s).removesuffix("/v1")
    req = urllib.request.Request(root + path, data=body, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _metric(s, name: str) -> float:
    text = urllib.request.urlopen(srvmod.metrics_url(s), timeout=10).read().decode()
    return sum(float(ln.rpartition(" ")[2]) for ln in text.splitlines() if ln.startswith(name + "{"))


def test_the_methods_read_from_the_engine_files_are_those_the_loaded_engines_serve(served_deployment, client):
    """served_methods reads the engine directory without loading a model (the front and `load` start light); it must
    name what the served model's loaded bundle serves, and the endpoint lists exactly those."""
    from pipeline.runtime.decode import load_bundle
    from pipeline.triton.repo import served_methods

    s = served_deployment
    assert served_methods(s) == load_bundle(s.engine_dir).methods()
    card = client.models.list().data[0].model_extra
    assert [m for m in card["methods"] if m != "medusa_typical"] == served_methods(s)


def test_serve_starts_the_endpoint_on_the_spec_host_and_lists_the_deployment(served_deployment, client):
    s = served_deployment
    assert openai_api.running_pid(s) is not None
    assert openai_api.health(openai_api.base_url(s)) == 200
    models = client.models.list()
    assert [m.id for m in models.data] == ["oai"]
    card = models.data[0].model_extra
    assert {"baseline", "draft_target", "prompt_lookup", "medusa"} <= set(card["methods"])
    assert card["default_method"] == "draft_target"
    import psutil

    listening = {c.laddr for c in psutil.Process(openai_api.running_pid(s)).net_connections("inet")
                 if c.status == psutil.CONN_LISTEN}
    assert {(a.ip, a.port) for a in listening} == {("127.0.0.1", s.openai.port)}


def test_greedy_chat_through_openai_equals_the_grpc_path_for_every_method(served_deployment, client, tok):
    """The endpoint applies the model's chat template once: its greedy answer is the gRPC path's answer to the
    client-side templated prompt, for every method, with usage and the speculative figures of the request."""
    s = served_deployment
    for method in ("baseline", "prompt_lookup", "draft_target", "medusa", "suffix", "hybrid"):
        want = _grpc(s, chat_text(tok, PROMPT), 12, method)
        r = client.chat.completions.create(model="oai", messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=12, temperature=0, extra_body={"method": method})
        assert r.choices[0].message.content == want["text"], method
        assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
        n = want["num_output_tokens"]
        assert r.usage.completion_tokens == n and r.usage.prompt_tokens == want["num_input_tokens"]
        assert r.usage.total_tokens == r.usage.prompt_tokens + n
        assert r.choices[0].finish_reason == ("length" if n == 12 else "stop")
        fig = r.model_extra["speculative"]
        assert fig["method"] == method
        assert fig["draft_tokens"] == want["total_draft_tokens"]
        assert fig["accepted_draft_tokens"] == want["total_accepted_draft_tokens"]
        assert fig["acceptance_rate"] == pytest.approx(want["acceptance_rate"])
        if method == "draft_target":  # the target is its own draft: every drafted token is accepted
            assert fig["draft_tokens"] > 0 and fig["acceptance_rate"] == 1.0
        if method == "baseline":
            assert fig["draft_tokens"] == 0


def test_prediction_keeps_the_greedy_answer_and_usage_counts_its_tokens(served_deployment, client, tok):
    """Predicted Outputs on chat and completions (and the gRPC input): the right prediction, an unrelated one and an
    empty one give the baseline's greedy answer; usage says how many of the prediction's tokens the answer holds."""
    import openai

    s = served_deployment
    msgs = [{"role": "user", "content": PROMPT}]
    base = client.chat.completions.create(model="oai", messages=msgs, max_tokens=24, temperature=0,
                                          extra_body={"method": "baseline"})
    text = base.choices[0].message.content
    assert base.usage.completion_tokens_details is None or not base.usage.completion_tokens_details.model_extra
    unrelated = "def unrelated(x):\n    return [x] * 3  # nothing like the answer\n"
    for method in ("suffix", "hybrid"):
        for pred, accepted in ((text, len(tok(text, add_special_tokens=False)["input_ids"])), (unrelated, None)):
            r = client.chat.completions.create(model="oai", messages=msgs, max_tokens=24, temperature=0,
                                               prediction={"type": "content", "content": pred},
                                               extra_body={"method": method})
            assert r.choices[0].message.content == text, (method, pred)
            d = r.usage.completion_tokens_details
            n_pred = len(tok(pred, add_special_tokens=False)["input_ids"])
            assert d.accepted_prediction_tokens + d.rejected_prediction_tokens == n_pred
            if accepted is not None:
                assert d.accepted_prediction_tokens == accepted and d.rejected_prediction_tokens == 0
                assert r.model_extra["speculative"]["accepted_draft_tokens"] > 0
            else:
                assert d.rejected_prediction_tokens > 0
    r = client.chat.completions.create(model="oai", messages=msgs, max_tokens=24, temperature=0,
                                       prediction={"type": "content", "content": [{"type": "text", "text": text}]})
    assert r.choices[0].message.content == text  # the default method, content as text parts
    want = _grpc(s, "Once upon a time", 16, "baseline")["text"]
    c = client.completions.create(model="oai", prompt="Once upon a time", max_tokens=16, temperature=0,
                                  extra_body={"method": "suffix", "prediction": {"type": "content", "content": want}})
    assert c.choices[0].text == want and c.usage.completion_tokens_details.rejected_prediction_tokens == 0
    g = generate(srvmod.grpc_url(s), "ensemble", "Once upon a time", 16, method="hybrid", prediction=unrelated)
    assert g["text"] == want
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="oai", messages=msgs, max_tokens=4,
                                       prediction={"type": "file", "content": text})
    assert e.value.body["param"] == "prediction"


def test_streamed_chat_and_completions_equal_their_unary_answers_with_usage_last(served_deployment, client):
    r = client.chat.completions.create(model="oai", messages=[{"role": "user", "content": PROMPT}], max_tokens=14,
                                       temperature=0)
    chunks = list(client.chat.completions.create(model="oai", messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=14, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1, "it streams piece by piece"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == r.choices[0].finish_reason
    assert finals[0].model_extra["speculative"]["method"] == "draft_target", "the deployment's default"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # Text completions: the prompt as it is, no template; streamed equals unary equals gRPC.
    want = _grpc(served_deployment, PROMPT, 10, "baseline")["text"]
    t = client.completions.create(model="oai", prompt=PROMPT, max_tokens=10, temperature=0,
                                  extra_body={"method": "baseline"})
    assert t.choices[0].text == want and t.object == "text_completion"
    streamed = client.completions.create(model="oai", prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                         extra_body={"method": "baseline"})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want


def _first_new(text: str, size: int) -> str | None:
    """A `size`-character piece of the first half of `text` that first occurs past its start."""
    return next((text[i:i + size] for i in range(2, len(text) // 2) if text.find(text[i:i + size]) >= 2
                 and "\ufffd" not in text[i:i + size]), None)


def test_stop_sequences_cut_the_text_before_them(served_deployment, client):
    # Sampled with a seed (the same answer every time; the tiny model's greedy answers repeat one character).
    kw = dict(model="oai", max_tokens=24, temperature=1.0, seed=5, extra_body={"method": "baseline"})
    full = client.completions.create(prompt=PROMPT, **kw).choices[0].text
    stops = [_first_new(full, 2), "\u00a7never\u00a7"]
    assert stops[0], full
    want = full[:full.find(stops[0])]
    r = client.completions.create(prompt=PROMPT, stop=stops, **kw)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert 0 < r.usage.completion_tokens < 24
    streamed = list(client.completions.create(prompt=PROMPT, stop=stops[0], stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want
    assert [c.choices[0].finish_reason for c in streamed if c.choices and c.choices[0].finish_reason] == ["stop"]
    msgs = [{"role": "user", "content": PROMPT}]
    text = client.chat.completions.create(messages=msgs, **kw).choices[0].message.content
    stop = _first_new(text, 2)
    assert stop, text
    cut = client.chat.completions.create(messages=msgs, stop=[stop], **kw)
    assert cut.choices[0].message.content == text[:text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats_and_temperature_changes_the_answer(served_deployment, client):
    kw = dict(model="oai", prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.9, seed=11,
              extra_body={"method": "baseline"})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    greedy = client.completions.create(**{**kw, "temperature": 0}).choices[0].text
    others = {client.completions.create(**{**kw, "seed": s}).choices[0].text for s in range(4)}
    assert others - {greedy}, "sampling at T=1 gives other answers than greedy"


def test_ignore_eos_decodes_to_max_tokens_past_the_end_tokens(served_deployment, client, tok):
    """`ignore_eos: true` (vLLM's and llama.cpp's name): the answer runs to max_tokens past the model's end tokens,
    and is the gRPC path's answer with end_id -1; without it the same request ends early, at an end token. (The tiny
    model's greedy answers never reach its end token, so the requests sample, with seeds until one does.)"""
    s, n = served_deployment, 64
    msgs = [{"role": "user", "content": PROMPT}]
    kw = dict(model="oai", messages=msgs, max_tokens=n, temperature=1.0)
    ended = None
    for seed in range(32):
        r = client.chat.completions.create(**kw, seed=seed, extra_body={"method": "baseline"})
        if r.choices[0].finish_reason == "stop":
            ended = (seed, r)
            break
    assert ended is not None, "no seed's answer reached an end token within max_tokens"
    seed, plain = ended
    assert plain.usage.completion_tokens < n
    want = generate(srvmod.grpc_url(s), "ensemble", chat_text(tok, PROMPT), n, method="baseline", end_id=-1,
                    temperature=1.0, seed=seed)
    for stream in (False, True):
        r = client.chat.completions.create(**kw, seed=seed, stream=stream,
                                           extra_body={"method": "baseline", "ignore_eos": True},
                                           **({"stream_options": {"include_usage": True}} if stream else {}))
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            used = chunks[-1].usage.completion_tokens
        else:
            text, finish, used = r.choices[0].message.content, [r.choices[0].finish_reason], r.usage.completion_tokens
        assert used == want["num_output_tokens"] == n and finish == ["length"], stream
        assert text == want["text"] and text.startswith(plain.choices[0].message.content), stream


def test_errors_are_openai_shaped_with_the_right_status(served_deployment, client):
    import openai

    msgs = [{"role": "user", "content": PROMPT}]
    cases = [
        (openai.NotFoundError, dict(model="nope", messages=msgs), "model", "model_not_found"),
        (openai.BadRequestError, dict(model="oai", messages=msgs, n=2), "n", "unsupported_parameter"),
        (openai.BadRequestError, dict(model="oai", messages=msgs, max_tokens=0), "max_tokens", "invalid_value"),
        (openai.BadRequestError, dict(model="oai", messages=msgs, max_tokens=10_000), "max_tokens",
         "context_length_exceeded"),
        (openai.BadRequestError, dict(model="oai", messages=[{"role": "user", "content": "rain " * 400}]),
         "messages", "context_length_exceeded"),
        (openai.BadRequestError, dict(model="oai", messages=msgs, temperature=3), "temperature", "invalid_value"),
        (openai.BadRequestError, dict(model="oai", messages=msgs, logprobs=True), "logprobs",
         "unsupported_parameter"),
        (openai.BadRequestError, dict(model="oai", messages=msgs, extra_body={"method": "beam"}), "method",
         "invalid_value"),
        (openai.BadRequestError, dict(model="oai", messages=[]), "messages", "invalid_type"),
        (openai.BadRequestError, dict(model="oai", messages=msgs, extra_body={"ignore_eos": "yes"}), "ignore_eos",
         "invalid_type"),
    ]
    for exc, kw, param, code in cases:
        with pytest.raises(exc) as e:
            client.chat.completions.create(**kw)
        err = e.value.body
        assert err["param"] == param and err["code"] == code and err["type"] == "invalid_request_error", kw
        assert err["message"]
    # Raw HTTP: bad JSON, a body that is no object, an unknown route, a wrong verb.
    s = served_deployment
    for method, path, body, status, code in [("POST", "/v1/chat/completions", b"{not json", 400, "invalid_json"),
                                             ("POST", "/v1/completions", b"[1, 2]", 400, "invalid_type"),
                                             ("GET", "/v1/nothing", None, 404, "not_found"),
                                             ("GET", "/v1/chat/completions", None, 405, "method_not_allowed")]:
        got, out = _raw(s, method, path, body)
        assert got == status and out["error"]["code"] == code, (path, out)
        assert set(out["error"]) == {"message", "type", "param", "code"}
    # None of these hurt the deployment: the next request is served as before.
    ok = client.chat.completions.create(model="oai", messages=msgs, max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_a_bad_request_during_a_stream_does_not_disturb_it(served_deployment, client):
    want = client.chat.completions.create(model="oai", messages=[{"role": "user", "content": LONG_PROMPT}],
                                          max_tokens=60, temperature=0, extra_body={"method": "baseline"})
    got: dict = {}

    def stream() -> None:
        chunks = client.chat.completions.create(model="oai", messages=[{"role": "user", "content": LONG_PROMPT}],
                                                max_tokens=60, temperature=0, stream=True,
                                                extra_body={"method": "baseline"})
        got["text"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    t = threading.Thread(target=stream)
    t.start()
    for body in (b"{", b'{"model": "oai", "messages": "x"}', json.dumps({"model": "oai", "prompt": "x",
                                                                         "max_tokens": -1}).encode()):
        assert _raw(served_deployment, "POST", "/v1/completions", body)[0] == 400
    t.join(timeout=120)
    assert got["text"] == want.choices[0].message.content


def test_a_client_that_disconnects_mid_stream_cancels_its_triton_request(served_deployment):
    """A raw HTTP client reads the first event of a long stream and closes its socket: the decode stops (the
    server counts it cancelled, far short of its budget), and the next request is served."""
    s = served_deployment
    budget = 440
    full = _grpc(s, LONG_PROMPT, budget, "baseline")
    assert full["num_output_tokens"] == budget, "precondition: this greedy answer runs to its budget"
    before, tokens_before = _metric(s, "spec_decode_requests_cancelled_total"), _metric(
        s, "spec_decode_cancelled_tokens_total")
    body = json.dumps({"model": "oai", "prompt": LONG_PROMPT, "max_tokens": budget, "temperature": 0,
                       "stream": True, "method": "baseline"}).encode()
    sock = socket.create_connection(("127.0.0.1", s.openai.port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    seen = b""
    while b"data: {" not in seen:
        seen += sock.recv(4096)
    assert seen.startswith(b"HTTP/1.1 200")
    sock.close()
    deadline = time.monotonic() + 60
    while _metric(s, "spec_decode_requests_cancelled_total") == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(s, "spec_decode_requests_cancelled_total") == before + 1
    assert _metric(s, "spec_decode_cancelled_tokens_total") - tokens_before < budget, "it stopped before its end"
    assert _grpc(s, LONG_PROMPT, 5, "baseline")["num_output_tokens"] == 5


def _open_stream(s, budget: int = 400) -> socket.socket:
    """A raw HTTP client that starts a long greedy stream and has read its first event (the request is running)."""
    body = json.dumps({"model": "oai", "prompt": LONG_PROMPT, "max_tokens": budget, "temperature": 0,
                       "stream": True, "method": "baseline"}).encode()
    sock = socket.create_connection(("127.0.0.1", s.openai.port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def _first_event(sock: socket.socket) -> None:
    seen = b""
    while b"data: {" not in seen:
        part = sock.recv(4096)
        assert part, seen
        seen += part
    assert seen.startswith(b"HTTP/1.1 200"), seen[:200]


def _front_state(s) -> tuple[int, int, int]:
    """The front process's threads, open file descriptors and TCP connections to Triton's gRPC port."""
    import psutil

    p = psutil.Process(openai_api.running_pid(s))
    to_triton = [c for c in p.net_connections("inet") if c.raddr and c.raddr.port == s.triton.grpc_port
                 and c.status == psutil.CONN_ESTABLISHED]
    return p.num_threads(), p.num_fds(), len(to_triton)


def test_concurrent_streams_share_one_grpc_channel_and_take_no_thread_each(served_deployment):
    """N streamed requests running at once reach Triton over the front's one gRPC connection, and the front's
    threads do not grow with them (a thread and a channel per request would add 2N threads and N connections); its
    file descriptors grow by the N HTTP sockets only, and threads and descriptors come back when they end. Two
    rounds first let the checking pool (one thread per running request at most) make what it keeps."""
    s = served_deployment
    n = 8  # the deployment's batch: every stream runs (none waits in the queue for its first piece)

    def crowd() -> tuple[int, int, int]:
        socks = [_open_stream(s) for _ in range(n)]
        for c in socks:
            _first_event(c)
        during = _front_state(s)
        for c in socks:
            c.close()  # cancels their Triton requests
        return during

    for _ in range(2):
        crowd()
    time.sleep(1.0)
    threads0, fds0, conns0 = _front_state(s)
    assert conns0 == 1, "the front holds its one channel between requests"
    threads, fds, conns = crowd()
    assert conns == 1, f"{n} running streams, {conns} connections to Triton"
    assert threads <= threads0 + 3, (threads, threads0)
    assert fds <= fds0 + n + 3, (fds, fds0)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (_front_state(s)[0] > threads0 + 3 or _front_state(s)[1] > fds0 + 1):
        time.sleep(0.2)
    threads1, fds1, conns1 = _front_state(s)
    # the bounded checking pool may keep the thread or two it added (a full run read 14 -> 16), never one per request
    assert threads1 <= threads0 + 3 and fds1 <= fds0 + 1 and conns1 == 1, (threads1, threads0, fds1, fds0)
    assert _grpc(s, LONG_PROMPT, 5, "baseline")["num_output_tokens"] == 5


def test_a_cancelled_request_cancels_its_grpc_call_and_the_shared_channel_serves_on(served_deployment):
    """The front's channel (pipeline/triton/grpc_channel.py) in this process: its greedy answer and figures are the
    sync client's; cancelling a running request's task cancels its gRPC call (the server counts the request
    cancelled, far short of its budget); a `cancel()` that says yes does the same; the channel then serves the next
    request."""
    import asyncio

    from pipeline.triton.grpc_channel import TritonChannel

    s = served_deployment
    budget = 440
    want = _grpc(s, PROMPT, 12, "draft_target")

    async def scenario() -> dict:
        ch = TritonChannel(srvmod.grpc_url(s))
        out: dict = {}
        try:
            out["same"] = await ch.generate("ensemble", PROMPT, 12, method="draft_target")
            assert await ch.ready("ensemble") and not await ch.ready("no_such_model")
            before = _metric(s, "spec_decode_requests_cancelled_total")
            tokens_before = _metric(s, "spec_decode_cancelled_tokens_total")
            started = asyncio.Event()
            task = asyncio.create_task(ch.generate("ensemble", LONG_PROMPT, budget, method="baseline", stream=True,
                                                   on_piece=lambda piece: started.set()))
            await asyncio.wait_for(started.wait(), 60)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + 60
            while _metric(s, "spec_decode_requests_cancelled_total") == before and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            out["cancelled"] = _metric(s, "spec_decode_requests_cancelled_total") - before
            out["cancelled_tokens"] = _metric(s, "spec_decode_cancelled_tokens_total") - tokens_before
            pieces: list[str] = []
            r = await ch.generate("ensemble", LONG_PROMPT, budget, method="baseline", stream=True,
                                  on_piece=pieces.append, cancel=lambda: len(pieces) >= 2)
            out["by_cancel"] = r
            out["next"] = await ch.generate("ensemble", LONG_PROMPT, 5, method="baseline")
        finally:
            await ch.close()
        return out

    out = asyncio.run(scenario())
    got = out["same"]
    assert got["text"] == want["text"] and got["complete"]
    for key in ("num_output_tokens", "num_input_tokens", "total_draft_tokens", "total_accepted_draft_tokens"):
        assert got[key] == want[key], key
    assert out["cancelled"] == 1 and out["cancelled_tokens"] < budget, out
    assert not out["by_cancel"]["complete"] and len(out["by_cancel"]["pieces"]) < budget
    assert out["next"]["num_output_tokens"] == 5 and out["next"]["complete"]


def test_api_key_from_the_environment_is_required_when_set(served_deployment, monkeypatch):
    """A second endpoint on the same deployment started with PIPELINE_API_KEY refuses requests without it."""
    import dataclasses

    import openai

    s = served_deployment
    other = dataclasses.replace(s, openai=dataclasses.replace(s.openai, port=srvmod.free_port()), name=s.name)
    monkeypatch.setenv(door.API_KEY_ENV, "s3cret")
    rdir = s.report_dir / "keyed"
    monkeypatch.setattr(openai_api, "pid_file", lambda spec: rdir / "openai.pid")
    monkeypatch.setattr(openai_api, "config_file", lambda spec: rdir / "openai.json")
    monkeypatch.setattr(openai_api, "log_file", lambda spec: rdir / "openai.log")
    rdir.mkdir(parents=True, exist_ok=True)
    openai_api.start(other, log=lambda *a: None)
    try:
        url = openai_api.base_url(other)
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        assert e.value.body["code"] == "invalid_api_key"
        r = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0).completions.create(
            model="oai", prompt=PROMPT, max_tokens=2, temperature=0)
        assert r.usage.completion_tokens >= 1
        assert "s3cret" not in (rdir / "openai.json").read_text()
    finally:
        openai_api.stop(other)


def test_project_client_reads_text_usage_and_figures_like_the_grpc_client(served_deployment, tok):
    from pipeline import openai_client

    s = served_deployment
    url = openai_api.base_url(s)
    want = _grpc(s, chat_text(tok, PROMPT), 10, "prompt_lookup")
    for stream in (True, False):
        r = openai_client.generate(url, "oai", PROMPT, 10, method="prompt_lookup", stream=stream)
        assert r["complete"] and r["text"] == want["text"]
        for key in ("num_output_tokens", "num_input_tokens", "total_draft_tokens", "total_accepted_draft_tokens"):
            assert r[key] == want[key], (stream, key)
        assert r["speculative"]["method"] == "prompt_lookup" and 0 < r["ttft_s"] <= r["latency_s"]
    with pytest.raises(openai_client.ApiRequestError) as e:
        openai_client.generate(url, "nope", PROMPT, 4)
    assert e.value.status == 404 and e.value.error["code"] == "model_not_found"


def test_load_through_the_endpoint_counts_no_error_and_no_wrong_greedy_answer(served_deployment):
    """`load --api openai`, soak-like and short: streamed and unary HTTP clients, every method, sampled and greedy,
    clients that cancel after the first piece or drop their connection; the server counts every one as cancelled."""
    from pipeline.cli import main
    from pipeline.load import run_load

    s = served_deployment
    r = run_load(s, 6, 5.0, 8, ("baseline", "prompt_lookup", "draft_target", "medusa"), model="oai", num_prompts=3,
                 temperatures=(0.0, 0.7), cancel_every=4, disconnect_every=5, unary_every=2, api="openai",
                 log=lambda *a: None)
    assert r["api"] == "openai" and r["url"] == openai_api.base_url(s)
    assert r["errors"] == r["incomplete"] == r["greedy_mismatches"] == 0, r["problems"]
    assert r["greedy_requests"] > 0 and r["streamed"] > 0 and r["unary"] > 0 and r["cancelled"] > 0
    # abandoned requests ask for ignore_eos (load.ABANDONED's end_id -1), so none ends at an end token: the server
    # counts every one as cancelled, save one that decoded its whole budget before its client's cancel came
    # (docs/serving.md, "Soak")
    assert r["server_cancelled"] + r["finished_before_cancel"] == r["cancelled"]
    assert json.loads((s.report_dir / "load_openai.json").read_text())["requests"] == r["requests"]
    rc = main(["load", str(Path(s.root) / "build" / "oai.yaml"), "--api", "openai", "--concurrency", "2",
               "--duration", "2", "--max-tokens", "4", "--prompts", "2"])
    r = json.loads((s.report_dir / "load_openai.json").read_text())
    assert rc == 0 and r["concurrency"] == 2 and r["greedy_requests"] > 0 and r["greedy_mismatches"] == 0


def test_validate_through_the_endpoint_reports_every_method_exact(served_deployment):
    from pipeline.validate_api import run_validate_api

    s = served_deployment
    r = run_validate_api(s, log=lambda *a: None)
    assert set(r["methods"]) == {"baseline", "draft_target", "prompt_lookup", "medusa", "suffix", "hybrid"}
    for m, e in r["methods"].items():
        assert e["greedy_identical"] == e["greedy_total"] == 2 and e["complete"] == 2, m
        assert e["tokens_per_s"] > 0
    assert r["methods"]["draft_target"]["acceptance_rate"] == 1.0, "the target drafts for itself"
    assert r["methods"]["baseline"]["acceptance_rate"] is None
    assert r["grpc_identical"] == {"identical": 2, "total": 2} and r["repeat_identical"]
    assert [c["greedy_mismatches"] for c in r["batch_curve"]] == [0, 0]
    assert json.loads((s.report_dir / "validate_openai.json").read_text())["methods"].keys() == r["methods"].keys()


def test_stop_scanner_holds_back_what_may_begin_a_stop_sequence():
    sc = openai_api.StopScanner(["END", "\n\n"])
    assert sc.feed("abc E") == "abc "
    assert sc.feed("N") == ""
    assert sc.feed("x\n") == "ENx"
    assert sc.feed("\nmore") == "" and sc.hit
    assert sc.text == "abc ENx"
    none = openai_api.StopScanner([])
    assert none.feed("a") == "a" and none.flush() == ""


def test_an_unreachable_triton_is_not_ready_and_its_requests_are_answered_503():
    """The front's channel to a port nobody listens on: /health's probe says not ready, and a request fails as a
    RequestError that the front answers 503 service_unavailable (not a 500, and nothing hangs)."""
    import asyncio

    from pipeline.client import RequestError
    from pipeline.triton.grpc_channel import TritonChannel

    async def scenario() -> tuple[bool, Exception]:
        ch = TritonChannel(f"127.0.0.1:{srvmod.free_port()}")
        try:
            ready = await ch.ready("ensemble")
            with pytest.raises(RequestError) as e:
                await asyncio.wait_for(ch.generate("ensemble", PROMPT, 4, stream=True, timeout=30), 30)
            return ready, e.value
        finally:
            await ch.close()

    ready, err = asyncio.run(scenario())
    assert ready is False
    api = openai_api.triton_error(err)
    assert api.status == 503 and api.code == "service_unavailable", str(err)


def test_openai_port_is_checked_in_the_spec(tiny_root):
    with pytest.raises(specmod.SpecError, match="openai.port: got 70000"):
        specmod.load(write_spec(tiny_root, name="badport", openai={"port": 70000}))
    with pytest.raises(specmod.SpecError, match="openai.port: got 8001; is also triton.grpc_port"):
        specmod.load(write_spec(tiny_root, name="clash", openai={"port": 8001}))
    with pytest.raises(specmod.SpecError, match="openai.portt: unknown key"):
        specmod.load(write_spec(tiny_root, name="typo", openai={"portt": 1}))
    assert specmod.load(write_spec(tiny_root, name="off", openai={"port": 8001, "enabled": False}))


def test_a_resent_prompt_reports_cached_tokens_and_answers_the_same(served_deployment, client):
    """The prompt cache through the endpoint: a repeated chat reuses its prompt's whole blocks (usage's
    prompt_tokens_details.cached_tokens), a conversation's next turn reuses the first turn, the answers are those of
    a request with cache_prompt: false (which reuses nothing), and Prometheus counts the reused blocks."""
    s = served_deployment
    first = [{"role": "user", "content": "Summarise the cache test: " + PROMPT * 2}]
    ask = lambda msgs, **extra: client.chat.completions.create(  # noqa: E731
        model="oai", messages=msgs, max_tokens=10, temperature=0, extra_body={"method": "draft_target", **extra})
    off = ask(first, cache_prompt=False)
    a, b = ask(first), ask(first)
    n = a.usage.prompt_tokens
    assert off.usage.prompt_tokens_details.cached_tokens == 0
    assert b.usage.prompt_tokens_details.cached_tokens == n - 1 > 0  # all but the prompt's last token
    assert a.choices[0].message.content == b.choices[0].message.content == off.choices[0].message.content
    turn2 = first + [{"role": "assistant", "content": a.choices[0].message.content},
                     {"role": "user", "content": "And in one word?"}]
    t2, t2_off = ask(turn2), ask(turn2, cache_prompt=False)
    assert t2.usage.prompt_tokens_details.cached_tokens >= n
    assert t2.choices[0].message.content == t2_off.choices[0].message.content
    g = generate(srvmod.grpc_url(s), "ensemble", "Tell me about caches. " * 4, 4, return_kv_cache_reuse_stats=True)
    again = generate(srvmod.grpc_url(s), "ensemble", "Tell me about caches. " * 4, 4)
    assert g["kv_cache_alloc_total_blocks"] == -(-(g["num_input_tokens"] + g["num_output_tokens"]) // 16)
    assert again["kv_cache_reused_blocks"] == (again["num_input_tokens"] - 1) // 16 > 0
    assert again["num_cached_tokens"] == again["num_input_tokens"] - 1 and g["num_cached_tokens"] == 0
    assert again["kv_cache_alloc_new_blocks"] == again["kv_cache_alloc_total_blocks"] - again["kv_cache_reused_blocks"]
    assert again["text"] == g["text"]
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{s.triton.metrics_port}/metrics", timeout=10).read().decode()
    reused = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("spec_decode_kv_cache_reused_blocks_total{") and 'model="ensemble"' in line]
    assert sum(reused) > 0
    assert any(line.startswith("spec_decode_kv_cache_bytes{") and float(line.rsplit(" ", 1)[1]) > 0
               for line in metrics.splitlines())

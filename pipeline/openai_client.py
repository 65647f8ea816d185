"""A plain client for any OpenAI-compatible server: ours (`serve`'s endpoint), `trtllm-serve`, `llama-server`.

The standard library's http.client (and the project's RequestError classes, so a harness catches both
paths alike): the harnesses measure every server the same way and depend on nothing the server under
test brings. `complete(base_url, model, ...)` sends one chat (`messages`) or
text (`prompt`) completion, streamed or not, and returns the text, finish_reason, usage, the
speculative figures when the server reports them (ours: the `speculative` extension field;
llama-server: `timings.draft_n` / `draft_n_accepted`) and the timing (latency, time to first
token). `generate(...)` is the same request in the shape of `pipeline.client.generate`, so `load`
and `validate` swap one for the other (`--api openai`). A `cancel()` that returns True closes the
connection mid-stream: to the server that is a client that went away.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable

from pipeline.client import RequestError, RequestTimeout
from pipeline.door import local_host

PERF_KEYS = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")


class ApiRequestError(RequestError):
    """The server answered with an error: `status` (HTTP; 0: no answer) and `error` (its `{"message", "type",
    "param", "code"}`)."""

    def __init__(self, status: int, error: dict):
        self.status, self.error = status, error
        super().__init__(f"HTTP {status}: {error.get('message', error)}" if status else str(error.get("message")))


class ApiTimeout(ApiRequestError, RequestTimeout):
    """No (complete) answer within the client's timeout."""



def base_url(spec) -> str:
    """The OpenAI base URL of a deployment's own endpoint, for a client on this machine (ends in /v1)."""
    host = local_host(spec.openai.host)
    return f"http://{'[' + host + ']' if ':' in host else host}:{spec.openai.port}/v1"

def api_key() -> str:
    """The key to send: PIPELINE_API_KEY (our endpoint's), else OPENAI_API_KEY, else a placeholder."""
    return os.environ.get("PIPELINE_API_KEY") or os.environ.get("OPENAI_API_KEY") or "none"


def _figures(obj: dict, out: dict) -> None:
    """Speculative figures from a response or chunk into `out` (ours, or llama-server's timings)."""
    spec = obj.get("speculative")
    if isinstance(spec, dict):
        out["speculative"] = spec
        for key, name in (("acceptance_rate", "acceptance_rate"), ("accepted_draft_tokens",
                                                                   "total_accepted_draft_tokens"),
                          ("draft_tokens", "total_draft_tokens")):
            if spec.get(key) is not None:
                out[name] = spec[key]
    t = obj.get("timings")
    if isinstance(t, dict):
        out["timings"] = t  # llama-server's own prompt and decode figures (its last chunk's)
    if isinstance(t, dict) and t.get("draft_n") is not None:
        n, a = int(t["draft_n"]), int(t.get("draft_n_accepted", 0))
        out.update(total_draft_tokens=n, total_accepted_draft_tokens=a, acceptance_rate=a / n if n else 0.0)
    if isinstance(obj.get("usage"), dict):
        out["usage"] = obj["usage"]


def complete(base_url: str, model: str, messages: list[dict] | None = None, prompt: str | None = None,
             max_tokens: int | None = None, stream: bool = True, temperature: float | None = None,
             top_p: float | None = None, seed: int | None = None, stop: str | list[str] | None = None,
             method: str | None = None, extra: dict | None = None, key: str | None = None, timeout: float = 300.0,
             on_piece: Callable[[str], None] | None = None, cancel: Callable[[], bool] | None = None) -> dict:
    """One completion; returns text, finish_reason, usage, speculative (or None), latency_s, ttft_s, complete.

    `messages` goes to /chat/completions, `prompt` to /completions. `method` is our endpoint's extension (sent only
    when given); `extra` adds any other body fields. Raises ApiRequestError when the server refuses or fails."""
    if (messages is None) == (prompt is None):
        raise ValueError("send messages (chat) or prompt (text completion), one of them")
    body: dict = {"model": model, "stream": stream}
    body["messages" if messages is not None else "prompt"] = messages if messages is not None else prompt
    for k, v in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p), ("seed", seed),
                 ("stop", stop), ("method", method)):
        if v is not None:
            body[k] = v
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra or {})
    u = urllib.parse.urlsplit(base_url.rstrip("/"))
    path = f"{u.path}/{'chat/completions' if messages is not None else 'completions'}"
    conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(u.hostname, u.port, timeout=timeout)
    out: dict = {"text": "", "finish_reason": None, "usage": None, "speculative": None, "complete": False,
                 "pieces": 0}
    pieces: list[str] = []
    t0 = time.perf_counter()
    first: list[float] = []
    stopped = threading.Event()
    watcher = None
    if cancel is not None:
        def watch() -> None:  # a stream that sends nothing for a while is still cancelled within 200 ms
            while not stopped.wait(0.2):
                if cancel():
                    _drop(conn)
                    return

        watcher = threading.Thread(target=watch, daemon=True)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {key or api_key()}",
            "Accept": "text/event-stream" if stream else "application/json"})
        if watcher:
            watcher.start()
        resp = conn.getresponse()
        if resp.status != 200:
            raw = resp.read()
            try:
                err = json.loads(raw).get("error") or {}
            except (json.JSONDecodeError, AttributeError):
                err = {"message": raw.decode(errors="replace")[:500]}
            raise ApiRequestError(resp.status, err if isinstance(err, dict) else {"message": str(err)})
        if not stream:
            obj = json.loads(resp.read())
            choice = (obj.get("choices") or [{}])[0]
            text = (choice.get("message") or {}).get("content") if "message" in choice else choice.get("text")
            pieces.append(text or "")
            first.append(time.perf_counter() - t0)
            out["finish_reason"] = choice.get("finish_reason")
            _figures(obj, out)
            out["complete"] = True
        else:
            while True:
                if cancel is not None and cancel():
                    break
                try:
                    line = resp.readline()
                except (OSError, http.client.HTTPException):
                    break  # dropped by cancel(), or by the server
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    out["complete"] = out["finish_reason"] is not None
                    break
                obj = json.loads(data)
                if "error" in obj:
                    raise ApiRequestError(200, obj["error"])
                for choice in obj.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
                    if piece:
                        if len(first) < 2:  # the first two pieces' times: the second comes after any work the
                            first.append(time.perf_counter() - t0)  # server put off past the first token
                        pieces.append(piece)
                        if on_piece:
                            on_piece(piece)
                    if choice.get("finish_reason"):
                        out["finish_reason"] = choice["finish_reason"]
                _figures(obj, out)
    except TimeoutError as e:
        raise ApiTimeout(0, {"message": f"no answer from {base_url} within {timeout:.0f}s ({e})"}) from None
    except (OSError, http.client.HTTPException) as e:
        raise ApiRequestError(0, {"message": f"{base_url}: {type(e).__name__}: {e}"}) from None
    finally:
        stopped.set()
        conn.close()
    latency = time.perf_counter() - t0
    out.update(text="".join(pieces), pieces=len(pieces), latency_s=latency, ttft_s=first[0] if first else latency,
               second_piece_s=first[1] if len(first) > 1 else None)
    usage = out["usage"] or {}
    if usage.get("completion_tokens") is not None:
        out["num_output_tokens"] = int(usage["completion_tokens"])
        out["num_input_tokens"] = int(usage.get("prompt_tokens") or 0)
        out["tokens_per_s"] = out["num_output_tokens"] / latency if latency > 0 else 0.0
    return out


def _drop(conn: http.client.HTTPConnection) -> None:
    """Close the connection under a blocked read: the server sees its client go."""
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def generate(base_url: str, model: str, prompt: str, max_tokens: int, method: str | None = None,
             stream: bool = True, timeout: float = 300.0, on_piece: Callable[[str], None] | None = None,
             cancel: Callable[[], bool] | None = None, chat: bool = True, temperature: float = 0.0,
             top_p: float | None = None, seed: int | None = None, key: str | None = None,
             end_id: int | None = None, **_ignored) -> dict:
    """`pipeline.client.generate`'s shape over the OpenAI API: `prompt` is the user message (chat: the server
    applies the template) or the raw text (`chat=False`). Greedy unless `temperature` says otherwise (the gRPC
    path's default; OpenAI's own is 1). `end_id` -1 (no end token) is sent as `ignore_eos: true`, vLLM's and
    llama.cpp's name; other end ids have no OpenAI field and are ignored. Options only the gRPC contract has
    (`unary`, `disconnect`, ...) are accepted and ignored: over HTTP a cancelled stream and a dropped client are the
    same closed connection."""
    kw = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    if end_id == -1:
        kw["extra"] = {"ignore_eos": True}
    r = complete(base_url, model, max_tokens=max_tokens, stream=stream, temperature=temperature, top_p=top_p,
                 seed=seed, method=method or None, key=key, timeout=timeout, on_piece=on_piece, cancel=cancel, **kw)
    r["method"] = method
    return r

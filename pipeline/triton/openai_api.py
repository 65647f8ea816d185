"""The OpenAI-compatible HTTP endpoint in front of a running deployment (docs/openai.md).

`serve` starts it beside tritonserver, bound to triton.host on openai.port, as its own process
(Starlette on uvicorn); `stop` stops it. Every request becomes one Triton request, a gRPC stream
on the front's one channel (pipeline/triton/grpc_channel.py: a coroutine, no thread per request),
built and read by the project's client code (pipeline.client), so the served model's contract is
the only one: a client that goes away cancels its stream, and the model stops decoding it at its
next step. The front applies the model's chat template (once) to chat messages, checks every parameter
against the engine's limits before Triton sees it, answers errors as OpenAI does
(`{"error": {message, type, param, code}}` with the matching status), cuts the text before a stop
sequence, and adds the request's speculative figures as the `speculative` extension field. With
PIPELINE_API_KEY set in its environment, every /v1 request needs `Authorization: Bearer <key>`.

It is the deployment's door to other machines (pipeline/door.py), so it bounds what a client can hold: requests
running at once (429 with Retry-After past `openai.max_concurrent`), connections (uvicorn's limit), the time to send
headers and then the body (408), the body's size (counted as it arrives), and every client mistake (malformed JSON,
nesting, huge integers, lone surrogates, a wrong Content-Type, a foreign Host) is answered 4xx in OpenAI's shape; a
500 says nothing of the exception (the log has it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import difflib
import hmac
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from pipeline import door
from pipeline.client import RequestTimeout
from pipeline.openai_client import base_url  # noqa: F401 (the CLI and tests read it here)
from pipeline.spec import Spec
from pipeline.triton import fim
from pipeline.triton.grpc_channel import TritonChannel
from pipeline.triton.repo import client_model, default_methods, served_methods
from pipeline.triton.server import ServerError, grpc_url, log_tail, port_free

MAX_BODY_BYTES = 16 * 2**20
MAX_STOP = 16
STOP_GRACE_S = 1.0  # after a stop sequence shows, the model's own stop (and its figures) may still come this long
PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent
# Known OpenAI parameters the deployment cannot honour: (the neutral values that are served, what to do instead).
UNSUPPORTED = {
    "logprobs": ((None, False, 0), "log probabilities are not returned; omit it"),
    "top_logprobs": ((None, 0), "log probabilities are not returned; omit it"),
    "logit_bias": ((None, {}), "logit bias is not supported; omit it"),
    "presence_penalty": ((None, 0, 0.0), "penalties are not supported; send 0 or omit it"),
    "frequency_penalty": ((None, 0, 0.0), "penalties are not supported; send 0 or omit it"),
    "repetition_penalty": ((None, 1, 1.0), "penalties are not supported; send 1 or omit it"),
    "tools": ((None, []), "tool calling is not supported; omit it"),
    "tool_choice": ((None, "none", "auto"), "tool calling is not supported; omit it"),
    "functions": ((None, []), "function calling is not supported; omit it"),
    "function_call": ((None, "none"), "function calling is not supported; omit it"),
    "best_of": ((None, 1), "one completion per request; send 1 or omit it"),
    "echo": ((None, False), "the prompt is not echoed; omit it"),
    "audio": ((None,), "audio output is not supported; omit it"),
    "modalities": ((None, ["text"]), "text is the only modality; omit it"),
}


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP status, message, type, param, code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


CLIENT_GONE = ApiError(499, "the client closed the connection before the answer was ready", None,
                       "client_closed_request")


@dataclass
class FrontConfig:
    """What the endpoint needs to know about the deployment (written to reports/<name>/openai.json; no secrets)."""

    name: str
    host: str
    port: int
    grpc_url: str
    triton_model: str
    tokenizer_dir: str
    max_input_len: int
    max_seq_len: int
    max_draft_len: int = 0
    methods: list[str] = field(default_factory=list)  # empty: unknown (the model checks `method` itself)
    default_method: str | None = None
    decoupled: bool = True
    request_timeout_s: float = 600.0
    max_concurrent: int = 16  # requests running at once; past it 429
    max_connections: int = 2048  # uvicorn's limit_concurrency
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    allowed_hosts: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------- the deployment side


def pid_file(spec: Spec) -> Path:
    return spec.report_dir / "openai.pid"


def log_file(spec: Spec) -> Path:
    return spec.report_dir / "openai.log"


def config_file(spec: Spec) -> Path:
    return spec.report_dir / "openai.json"




def _tokenizer_dir(spec: Spec) -> Path:
    for d in (spec.engine_dir / "target", spec.path(spec.target.source)):
        if (d / "tokenizer_config.json").is_file():
            return d
    raise FileNotFoundError(f"no tokenizer in {spec.engine_dir / 'target'} or target.source; the OpenAI endpoint "
                            "needs the model's tokenizer (build the engine first: `make engine`)")


def front_config(spec: Spec) -> FrontConfig:
    """The endpoint's view of the deployment: limits and methods from the built engines, as the model sees them."""
    tdir = _tokenizer_dir(spec)
    cfg_path = spec.engine_dir / "target" / "config.json"
    bc = json.loads(cfg_path.read_text()).get("build_config", {}) if cfg_path.is_file() else {}
    methods: list[str] = []
    default = None
    if spec.backend == "torch" and cfg_path.is_file():
        methods = served_methods(spec)
        if "medusa" in methods:
            methods.append("medusa_typical")
        default = next((m for m in default_methods(spec) if m in methods), "baseline")
    model = client_model(spec) if spec.backend == "torch" else "ensemble"
    oa = spec.openai
    limit = oa.max_concurrent or 2 * spec.limits.max_batch_size
    return FrontConfig(name=spec.name, host=oa.host, port=oa.port, grpc_url=grpc_url(spec),
                       triton_model=model, tokenizer_dir=str(tdir.resolve()),
                       max_input_len=int(bc.get("max_input_len", spec.limits.max_input_len)),
                       max_seq_len=int(bc.get("max_seq_len", spec.limits.max_seq_len)),
                       max_draft_len=int(bc.get("max_draft_len", spec.limits.max_draft_len)),
                       methods=methods, default_method=default,
                       decoupled=spec.triton.decoupled if spec.backend == "torch" else spec.tensorrt_llm.decoupled,
                       max_concurrent=limit, max_connections=oa.max_connections or 2048,
                       header_timeout_s=oa.header_timeout_s, body_timeout_s=oa.body_timeout_s,
                       allowed_hosts=list(oa.allowed_hosts))


def _alive(pid: int, cfg: Path) -> bool:
    try:
        p = psutil.Process(pid)
        cmd = p.cmdline()
        return p.status() != psutil.STATUS_ZOMBIE and __name__ in cmd and str(cfg.resolve()) in cmd
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def running_pid(spec: Spec) -> int | None:
    f = pid_file(spec)
    try:
        pid = int(json.loads(f.read_text())["pid"])
    except (OSError, ValueError, KeyError, json.JSONDecodeError):
        return None
    return pid if _alive(pid, config_file(spec)) else None


def health(url: str, timeout: float = 2.0) -> int:
    """HTTP status of GET <root>/health (0 when nothing answers)."""
    root = url.removesuffix("/v1")
    try:
        with urllib.request.urlopen(f"{root}/health", timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):
        return 0


def start(spec: Spec, timeout: float = 120.0, log=print) -> int:
    """Start the endpoint for this spec's running deployment; return its pid once /health answers 200."""
    pid = running_pid(spec)
    if pid:
        raise ServerError(f"the OpenAI endpoint for {spec.name!r} is already running (pid {pid}, {base_url(spec)}); "
                          "stop it with `make stop`")
    refused = door.exposure_error(spec)
    if refused:
        raise ServerError(refused)
    if not port_free(spec.openai.host, spec.openai.port):
        raise ServerError(f"openai.port: port {spec.openai.port} on {spec.openai.host} is already in use; stop "
                          f"whatever holds it (`ss -ltnp | grep {spec.openai.port}`) or set openai.port in the spec")
    spec.report_dir.mkdir(parents=True, exist_ok=True)
    cfg = front_config(spec)
    config_file(spec).write_text(json.dumps(asdict(cfg), indent=2))
    logp = log_file(spec)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    cmd = [sys.executable, "-m", __name__, str(config_file(spec).resolve())]
    with open(logp, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=str(spec.report_dir), start_new_session=True)
    pid_file(spec).write_text(json.dumps({"pid": proc.pid, "url": base_url(spec), "started": time.time()}))
    t0 = time.monotonic()
    while health(base_url(spec)) != 200:
        if proc.poll() is not None:
            pid_file(spec).unlink(missing_ok=True)
            raise ServerError(f"the OpenAI endpoint exited with code {proc.returncode}. Last lines of {logp}:\n"
                              f"{log_tail(logp)}")
        if time.monotonic() - t0 > timeout:
            stop(spec)
            raise ServerError(f"the OpenAI endpoint did not answer /health with 200 within {timeout:.0f}s. Last "
                              f"lines of {logp}:\n{log_tail(logp)}")
        time.sleep(0.25)
    key = " (API key from PIPELINE_API_KEY required)" if door.api_key() else ""
    log(f"OpenAI endpoint ready in {time.monotonic() - t0:.1f}s: {base_url(spec)}, model {spec.name!r}{key} "
        f"(log {logp})")
    return proc.pid


def stop(spec: Spec, timeout: float = 10.0) -> bool:
    """Stop this spec's endpoint (SIGTERM, then SIGKILL); True when one was running."""
    pid = running_pid(spec)
    if pid is None:
        pid_file(spec).unlink(missing_ok=True)
        return False
    try:
        p = psutil.Process(pid)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout)
    except psutil.TimeoutExpired:
        p.kill()
        p.wait(5)
    except psutil.NoSuchProcess:
        pass
    pid_file(spec).unlink(missing_ok=True)
    return True


# --------------------------------------------------------------------------------------------- request checking


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def bad(message: str, param: str | None, code: str = "invalid_value", status: int = 400) -> ApiError:
    return ApiError(status, message, param, code)


@dataclass
class Job:
    """One checked OpenAI request, ready for Triton."""

    kind: str  # "chat" or "text"
    prompt: str
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    stop: list[str]
    method: str | None
    options: dict


class Front:
    """The request logic, Triton-free except for `run` (tests and the harness reuse `check`)."""

    def __init__(self, cfg: FrontConfig, tokenizer, api_key: str | None = None):
        self.cfg, self.tok, self.api_key = cfg, tokenizer, api_key or None
        self.created = int(time.time())
        self.fim = fim.fim_tokens(tokenizer)  # None: the model has no FIM tokens (suffix and /infill get a 400)

    # -- parameters
    def check(self, body, kind: str) -> Job:
        cfg = self.cfg
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object", None, "invalid_type")
        filled = kind == "infill"
        if filled:  # llama.cpp's /infill: its fields as a completion of the model's FIM prompt
            body, kind = self.infill_body(body), "text"
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad("model: missing; send the deployment's name: " + cfg.name, "model", "missing_required_parameter")
        if model != cfg.name:
            raise ApiError(404, f"The model {model!r} does not exist; this deployment serves {cfg.name!r} "
                                "(GET /v1/models lists it)", "model", "model_not_found")
        for key, (neutral, why) in UNSUPPORTED.items():
            v = body.get(key)
            if v is not None and not any(v == n and isinstance(v, bool) == isinstance(n, bool) for n in neutral):
                raise bad(f"{key}: got {json.dumps(v)[:80]}; {why}", key, "unsupported_parameter")
        rf = body.get("response_format")
        if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
            raise bad(f"response_format: got {json.dumps(rf)[:80]}; only {{\"type\": \"text\"}} is served (no JSON "
                      "mode or schemas); omit it", "response_format", "unsupported_parameter")
        n = body.get("n")
        if n is not None and n != 1:
            raise bad(f"n: got {json.dumps(n)}; one choice per request: send 1 (or omit it) and repeat the request "
                      "for more", "n", "unsupported_parameter")
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise bad(f"stream: got {json.dumps(stream)}; send true or false", "stream", "invalid_type")
        if stream and not cfg.decoupled:
            raise bad("stream: this deployment is served with triton.decoupled: false and answers in one piece; "
                      "send stream: false", "stream", "unsupported_parameter")
        so = body.get("stream_options")
        include_usage = False
        if so is not None:
            if not stream:
                raise bad("stream_options: only allowed with stream: true", "stream_options")
            if not isinstance(so, dict) or not isinstance(so.get("include_usage", False), bool):
                raise bad("stream_options: send {\"include_usage\": true|false}", "stream_options", "invalid_type")
            include_usage = bool(so.get("include_usage", False))
        if kind == "chat":
            prompt, param = self._chat_prompt(body.get("messages")), "messages"
        else:
            text = self._text_prompt(body.get("prompt"))
            prompt, param = self._fill_in(text, body.get("suffix")), "prompt"
            filled = filled or prompt != text
        ids = self._encode(prompt)
        if len(ids) > cfg.max_input_len:
            raise bad(f"This model's maximum prompt length is {cfg.max_input_len} tokens (limits.max_input_len); "
                      f"your {param} came to {len(ids)} tokens. Shorten it", param, "context_length_exceeded")
        room = cfg.max_seq_len - len(ids)
        mt = body.get("max_completion_tokens") if kind == "chat" else None
        mt_key = "max_completion_tokens"
        if mt is None:
            mt, mt_key = body.get("max_tokens"), "max_tokens"
        if mt is None:
            mt = room
        elif not _is_int(mt) or mt < 1:
            raise bad(f"{mt_key}: got {json.dumps(mt)}; send a positive integer", mt_key)
        elif mt > room:
            raise bad(f"{mt_key}: got {mt}; this model's maximum context length is {cfg.max_seq_len} tokens "
                      f"(limits.max_seq_len) and the {param} take {len(ids)}, so at most {room} can be generated",
                      mt_key, "context_length_exceeded")
        opts: dict = {}
        t = body.get("temperature")
        if t is not None:
            if not _is_num(t) or not 0 <= t <= 2:
                raise bad(f"temperature: got {json.dumps(t)}; send a number between 0 and 2", "temperature")
            opts["temperature"] = float(t)
        else:
            opts["temperature"] = 1.0  # OpenAI's default
        p = body.get("top_p")
        if p is not None:
            if not _is_num(p) or not 0 <= p <= 1:
                raise bad(f"top_p: got {json.dumps(p)}; send a number between 0 and 1", "top_p")
            opts["top_p"] = max(float(p), 1e-9)  # 0: the single most likely token (the model's own rule)
        k = body.get("top_k")
        if k is not None:
            if not _is_int(k) or not -1 <= k < 2**31:
                raise bad(f"top_k: got {json.dumps(k)[:40]}; send 0 or -1 (off) or a positive integer below 2**31",
                          "top_k")
            opts["top_k"] = max(k, 0)
        seed = body.get("seed")
        if seed is not None:
            if not _is_int(seed) or not 0 <= seed < 2**63:
                raise bad(f"seed: got {json.dumps(seed)}; send an integer between 0 and 2**63 - 1", "seed")
            opts["seed"] = seed
        nd = body.get("num_draft_tokens")
        if nd is not None:
            if not _is_int(nd) or not 0 <= nd <= max(cfg.max_draft_len, 0):
                raise bad(f"num_draft_tokens: got {json.dumps(nd)}; send 0 to {cfg.max_draft_len} (max_draft_len)",
                          "num_draft_tokens")
            opts["num_draft_tokens"] = nd
        cp = body.get("cache_prompt")  # llama.cpp's name: false neither reuses nor keeps prompt-cache entries
        if cp is not None and not isinstance(cp, bool):
            raise bad(f"cache_prompt: got {json.dumps(cp)[:80]}; send true or false", "cache_prompt", "invalid_type")
        if cp is False:
            opts["cache_prompt"] = False
        ie = body.get("ignore_eos")  # vLLM's and llama.cpp's: decode to max_tokens, past the model's end tokens
        if ie is not None and not isinstance(ie, bool):
            raise bad(f"ignore_eos: got {json.dumps(ie)[:80]}; send true or false", "ignore_eos", "invalid_type")
        if ie:
            opts["end_id"] = -1  # no end token (the gRPC contract's end_id -1)
        pred = prediction_text(body.get("prediction"))  # Predicted Outputs: the first draft source (suffix.py)
        if pred:
            self._not_too_long(len(pred), "prediction")
            opts["prediction"] = pred
        method = body.get("method")
        if method is not None:
            if not isinstance(method, str) or (cfg.methods and method not in cfg.methods):
                raise bad(f"method: got {json.dumps(method)}; this deployment serves "
                          f"{', '.join(cfg.methods) or 'its default method'}", "method")
        elif nd == 0:
            method = "baseline"
        else:
            method = cfg.default_method
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP:
            raise bad(f"stop: got {json.dumps(body.get('stop'))[:80]}; send a string or a list of up to {MAX_STOP} "
                      "strings", "stop", "invalid_type")
        stop = [s for s in stop if s]
        if filled:  # a middle ends where the model starts another file or pads, as llama.cpp's infill ends
            stop += [m for m in fim.stop_markers(self.fim) if m not in stop]
        return Job(kind, prompt, len(ids), mt, stream, include_usage, stop, method, opts)

    def _chat_prompt(self, messages) -> str:
        if not isinstance(messages, list) or not messages:
            raise bad("messages: send a non-empty list of {\"role\", \"content\"} objects", "messages",
                      "missing_required_parameter" if messages is None else "invalid_type")
        out, chars = [], 0
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad(f"{where}: send an object with a string role and content", where, "invalid_type")
            role = "system" if m["role"] == "developer" else m["role"]
            if role not in ("system", "user", "assistant"):
                raise bad(f"{where}.role: got {m['role']!r}; send system, developer, user or assistant (tool "
                          "messages need tool calling, which is not supported)", f"{where}.role")
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"),
                                                                                                  str):
                        raise bad(f"{where}.content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                  "are served", f"{where}.content", "unsupported_parameter")
                    parts.append(part["text"])
                content = "".join(parts)
            if content is None and role == "assistant":
                content = ""
            if not isinstance(content, str):
                raise bad(f"{where}.content: send a string or a list of text parts", f"{where}.content",
                          "invalid_type")
            out.append({"role": role, "content": content})
            chars += len(content)
            self._not_too_long(chars, "messages")  # before templating: a huge prompt costs no template run
        if getattr(self.tok, "chat_template", None):
            try:
                return self.tok.apply_chat_template(out, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # noqa: BLE001 - the template's own refusal (say, roles out of order)
                raise bad(f"messages: the model's chat template refused them: {e}", "messages") from None
        return "\n".join(m["content"] for m in out)

    def _fim_or_refuse(self, param: str):
        if self.fim is None:
            raise bad(f"{param}: this model cannot fill in the middle (its tokenizer has no {fim.PREFIX}, "
                      f"{fim.SUFFIX}, {fim.MIDDLE} tokens); omit {param} and send the prompt alone, or serve a FIM "
                      "model such as Qwen2.5-Coder", param, "unsupported_parameter")
        return self.fim

    def _no_markers(self, text: str, param: str) -> None:
        """The markers spelled out in the user's text would be read as the tokens and break the layout."""
        m = fim.contains_marker(text, self.fim) if self.fim else None
        if m:
            raise bad(f"{param}: contains {m}, one of the model's fill-in-the-middle markers; remove it", param)

    def _fill_in(self, prompt: str, suffix) -> str:
        """OpenAI's `suffix` on /v1/completions: the prompt is the text before the insertion, suffix the text
        after it, the answer what goes between (the model's FIM layout, docs/openai.md#fill-in-the-middle)."""
        if suffix is None or (suffix == "" and self.fim is None):
            return prompt
        if not isinstance(suffix, str):
            raise bad(f"suffix: got {json.dumps(suffix)[:80]}; send a string (the text after the insertion)",
                      "suffix", "invalid_type")
        f = self._fim_or_refuse("suffix")
        self._no_markers(prompt, "prompt")
        self._no_markers(suffix, "suffix")
        return fim.fim_prompt(f, prompt, suffix)

    def infill_body(self, body: dict) -> dict:
        """llama.cpp's /infill request (input_prefix, input_suffix, input_extra, prompt, n_predict, ...) as the
        /v1/completions body of its FIM prompt. Fields it has that change no answer here (id_slot, n_indent,
        t_max_prompt_ms, t_max_predict_ms, samplers' order) are accepted and ignored."""
        f = self._fim_or_refuse("input_prefix")
        texts = {}
        for key in ("input_prefix", "input_suffix", "prompt"):
            v = body.get(key, "")
            if v is None:
                v = ""
            if not isinstance(v, str):
                raise bad(f"{key}: got {json.dumps(v)[:80]}; send a string", key, "invalid_type")
            self._no_markers(v, key)
            texts[key] = v
        extra_in = body.get("input_extra") or []
        if not isinstance(extra_in, list):
            raise bad("input_extra: send a list of {\"filename\": ..., \"text\": ...} objects", "input_extra",
                      "invalid_type")
        extra = []
        for i, chunk in enumerate(extra_in):
            where = f"input_extra[{i}]"
            if not isinstance(chunk, dict) or not isinstance(chunk.get("text", ""), str) \
                    or not isinstance(chunk.get("filename", "tmp"), str):
                raise bad(f"{where}: send {{\"filename\": string, \"text\": string}}", where, "invalid_type")
            self._no_markers(chunk.get("text", ""), f"{where}.text")
            self._no_markers(chunk.get("filename", "tmp"), f"{where}.filename")
            extra.append((chunk.get("filename", "tmp"), chunk.get("text", "")))
        self._length_guard(sum(len(t) for t in texts.values()) + sum(len(t) for _, t in extra), "input_prefix")
        out: dict = {"model": self.cfg.name, "prompt": fim.fim_prompt(f, texts["input_prefix"] + texts["prompt"],
                                                                       texts["input_suffix"], extra)}
        n = body.get("n_predict")
        if n is not None and not (_is_int(n) and (n == -1 or n >= 1)):
            raise bad(f"n_predict: got {json.dumps(n)[:40]}; send -1 (as many as the context leaves) or a positive "
                      "integer", "n_predict")
        if n is not None and n > 0:
            out["max_tokens"] = n
        samplers = body.get("samplers")
        # llama.cpp's default temperature is 0.8; a sampler chain without "temperature" samples at 1
        # (llama.vscode sends ["top_k", "top_p", "infill"]).
        plain = isinstance(samplers, list) and "temperature" not in samplers
        out["temperature"] = body.get("temperature", 1.0 if plain else 0.8)
        seed = body.get("seed")
        if seed is not None and not (_is_int(seed) and seed < 0):  # -1: a random seed, as omitting it
            out["seed"] = seed
        for key in ("top_k", "top_p", "stop", "stream", "cache_prompt", "ignore_eos"):
            if body.get(key) is not None:
                out[key] = body[key]
        return out

    def _length_guard(self, chars: int, param: str) -> None:
        if chars > 64 * self.cfg.max_input_len + 1024:
            raise bad(f"{param}: {chars} characters, far above the {self.cfg.max_input_len} tokens of "
                      "limits.max_input_len; shorten it", param, "context_length_exceeded")

    @staticmethod
    def _text_prompt(prompt) -> str:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list):
            raise bad("prompt: send one string (one prompt per request; token-id prompts are not served)", "prompt",
                      "unsupported_parameter")
        if not isinstance(prompt, str) or not prompt:
            raise bad("prompt: send a non-empty string", "prompt",
                      "missing_required_parameter" if prompt is None else "invalid_value")
        return prompt

    def _not_too_long(self, chars: int, param: str | None) -> None:
        """Refuse text far longer than any prompt the limits allow, before any template or tokenizer sees it."""
        if chars > 64 * self.cfg.max_input_len + 1024:
            raise bad(f"the prompt is {chars} characters, far above the {self.cfg.max_input_len} tokens of "
                      "limits.max_input_len; shorten it", param, "context_length_exceeded")

    def _encode(self, prompt: str) -> list[int]:
        """Token ids as the served model counts them (pipeline.triton.parse: special tokens unless it has a BOS)."""
        self._not_too_long(len(prompt), None)
        bos = getattr(self.tok, "bos_token", None)
        return list(self.tok(prompt, add_special_tokens=not (bos and prompt.startswith(bos)))["input_ids"])

    def count(self, text: str) -> int:
        return len(self.tok(text, add_special_tokens=False)["input_ids"]) if text else 0

    def authorized(self, header: str | None) -> bool:
        if not self.api_key:
            return True
        scheme, _, token = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())


class StopScanner:
    """Cuts a growing text before the first stop sequence, holding back a tail that may begin one."""

    def __init__(self, stops: list[str]):
        self.stops, self.text, self.sent, self.hit, self.matched = stops, "", 0, False, ""

    def feed(self, piece: str) -> str:
        """The text that is safe to send now."""
        if self.hit:
            return ""
        self.text += piece
        hits = [(i, s) for i, s in ((self.text.find(s, self.sent), s) for s in self.stops) if i >= 0]
        if hits:
            cut, self.matched = min(hits)
            out, self.text, self.sent, self.hit = self.text[self.sent:cut], self.text[:cut], cut, True
            return out
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text) - self.sent), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        safe = len(self.text) - hold
        out, self.sent = self.text[self.sent:safe], safe
        return out

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


class Run:
    """One Triton request as a task on the event loop, over the front's shared channel; its events on `queue`."""

    running: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks

    def __init__(self, front: Front, job: Job, channel: TritonChannel, rid: str):
        self.front, self.job, self.channel, self.rid = front, job, channel, rid
        self.queue: asyncio.Queue = asyncio.Queue()
        self.gone = False  # the HTTP client left
        self.scan = StopScanner(job.stop)
        self.raw: list[str] = []
        self.hit_at = 0.0
        self.pieces_after_hit = 0
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._work(), name=f"openai-{self.rid}")
        Run.running.add(self.task)
        self.task.add_done_callback(Run.running.discard)

    def leave(self) -> None:
        """The HTTP client left (or its answer is over): cancel the task, which cancels its gRPC call at once."""
        self.gone = True
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def _put(self, item) -> None:
        self.queue.put_nowait(item)

    def _piece(self, piece: str) -> None:
        if self.scan.hit:
            self.pieces_after_hit += 1
            return
        self.raw.append(piece)
        out = self.scan.feed(piece)
        if self.scan.hit:
            self.hit_at = time.monotonic()
        if out:
            self._put(("piece", out))

    def _cancel(self) -> bool:
        """Cancel when the client left, or when a stop sequence showed and the model did not stop by itself (another
        piece came, or STOP_GRACE_S passed): a stop it matched itself ends with its final response and figures."""
        return self.gone or (self.scan.hit and (self.pieces_after_hit > 0
                                                or time.monotonic() - self.hit_at > STOP_GRACE_S))

    async def _work(self) -> None:
        cfg, job = self.front.cfg, self.job
        try:
            r = await self.channel.generate(cfg.triton_model, job.prompt, job.max_tokens, method=job.method,
                                            stream=cfg.decoupled, unary=not cfg.decoupled,
                                            timeout=cfg.request_timeout_s,
                                            on_piece=self._piece if cfg.decoupled else None,
                                            cancel=self._cancel if cfg.decoupled else None,
                                            request_id=self.rid, stop_words=job.stop or None,
                                            exclude_input_in_output=True, return_perf_metrics=True, **job.options)
            if not cfg.decoupled:
                self._piece(r["text"])
            self._put(("done", r))
        except Exception as e:  # noqa: BLE001 - RequestError, an unreachable server, a broken stream: answered
            self._put(("error", e))

    def finish(self, r: dict) -> tuple[str, dict, dict]:
        """(the held-back tail, usage, speculative figures) once the request has ended."""
        tail = "" if self.scan.hit else self.scan.flush()
        complete = bool(r.get("complete")) and r.get("num_output_tokens") is not None
        out_tokens = int(r["num_output_tokens"]) if complete else self.front.count("".join(self.raw))
        if self.scan.hit:  # as OpenAI counts: the completion up to and including its stop sequence
            out_tokens = min(out_tokens, self.front.count(self.scan.text + self.scan.matched))
        prompt_tokens = int(r.get("num_input_tokens") or self.job.prompt_tokens)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": out_tokens,
                 "total_tokens": prompt_tokens + out_tokens}
        if complete and r.get("num_cached_tokens") is not None:  # the prompt cache's part of the prompt
            usage["prompt_tokens_details"] = {"cached_tokens": int(r["num_cached_tokens"])}
        if "prediction" in self.job.options:
            usage["completion_tokens_details"] = prediction_usage(
                self.front.tok, self.job.options["prediction"], "".join(self.raw))
        spec = {"method": self.job.method, "acceptance_rate": r.get("acceptance_rate") if complete else None,
                "accepted_draft_tokens": r.get("total_accepted_draft_tokens") if complete else None,
                "draft_tokens": r.get("total_draft_tokens") if complete else None}
        return tail, usage, spec

    def finish_reason(self, r: dict, usage: dict) -> str:
        if self.scan.hit:
            return "stop"
        return "length" if usage["completion_tokens"] >= self.job.max_tokens else "stop"


def prediction_text(pred) -> str | None:
    """OpenAI's `prediction`: {"type": "content", "content": text or a list of {"type": "text", "text": ...}}."""
    if pred is None:
        return None
    content = pred.get("content") if isinstance(pred, dict) and pred.get("type") == "content" else None
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad(f"prediction: got {json.dumps(pred)[:80]}; send {{\"type\": \"content\", \"content\": \"the text "
                  "the answer likely repeats\"}}", "prediction", "invalid_type")
    return content


def prediction_usage(tok, prediction: str, completion: str) -> dict:
    """usage.completion_tokens_details as OpenAI defines it: the prediction's tokens that appear in the completion
    (in order: the longest matching blocks) are accepted, the rest rejected. Counted from the texts, so the figures
    do not depend on how speculation went."""
    p = tok(prediction, add_special_tokens=False)["input_ids"] if prediction else []
    c = tok(completion, add_special_tokens=False)["input_ids"] if completion else []
    same = sum(b.size for b in difflib.SequenceMatcher(None, p, c, autojunk=False).get_matching_blocks())
    return {"reasoning_tokens": 0, "accepted_prediction_tokens": same, "rejected_prediction_tokens": len(p) - same}


def triton_error(e: Exception) -> ApiError:
    """A Triton-side failure as an OpenAI error: the model's refusals (`input: got ...`) are the client's (400)."""
    msg = str(e)
    if isinstance(e, RequestTimeout):
        return ApiError(504, f"the deployment did not finish in time: {msg}", None, "timeout", "server_error")
    if re.match(r"^[a-z_]+: ", msg):
        return ApiError(400, msg, msg.split(":", 1)[0], "invalid_value")
    if "unavailable" in msg.lower() or "connect" in msg.lower():
        return ApiError(503, f"the deployment is not reachable: {msg}", None, "service_unavailable", "server_error")
    ref = uuid.uuid4().hex[:12]  # the model's own words stay in the log: a 500 echoes no exception text
    print(f"deployment error {ref}: {msg}", flush=True)
    return ApiError(500, f"the deployment failed the request (reference {ref} in the endpoint's log)", None,
                    "server_error", "server_error")


MAX_DEPTH = 32  # JSON nesting a request can need is 4-5 levels (messages[i].content[j].text)


def parse_body(raw: bytes):
    """The request's JSON, or a 400 that says what is wrong: not JSON, nested too deep, an integer too long to read,
    a string holding a lone surrogate (not text: it cannot be encoded, so no tokenizer could take it)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, f"the JSON body is nested too deeply; at most {MAX_DEPTH} levels are read", None,
                       "invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, and an integer past Python's digit limit
        raise ApiError(400, f"We could not parse the JSON body of your request ({str(e)[:120]}); send a JSON object",
                       None, "invalid_json") from None
    stack = [(body, "", 0)]
    while stack:
        v, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ApiError(400, f"the JSON body is nested too deeply; at most {MAX_DEPTH} levels are read", None,
                           "invalid_json")
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, f"{where or 'body'}: the string holds a lone surrogate (an escape such as "
                                    "\\ud800 that is not half of a pair), which is not text; send valid Unicode",
                               where.split("[")[0].split(".")[0] or None, "invalid_value") from None
        elif isinstance(v, dict):
            for k, x in v.items():
                stack.append((k, where, depth + 1))
                stack.append((x, f"{where}.{k}" if where else str(k), depth + 1))
        elif isinstance(v, list):
            stack.extend((x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v))
    return body


# --------------------------------------------------------------------------------------------------- the ASGI app


def make_app(front: Front):
    """The Starlette application over `front`."""
    # lazy: starlette (~0.25 s) only in the endpoint's process
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    cfg = front.cfg
    ready = {"at": 0.0, "ok": False}

    running = {"n": 0}  # requests between their checked body and their answer's end (openai.max_concurrent)
    triton: dict = {}  # "channel": the one gRPC channel to Triton, made on the event loop at startup (lifespan)

    def error(e: ApiError) -> JSONResponse:
        headers = {"Retry-After": "1"} if e.status == 429 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    async def read_body(request: Request) -> bytes:
        """The body, counted as it arrives (a chunked body has no length to check first), within body_timeout_s."""
        parts, n = [], 0

        async def read() -> None:
            nonlocal n
            async for part in request.stream():
                n += len(part)
                if n > MAX_BODY_BYTES:
                    raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes", None, "request_too_large")
                parts.append(part)
        try:
            await asyncio.wait_for(read(), cfg.body_timeout_s)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {cfg.body_timeout_s:g} s "
                                "(openai.body_timeout_s); send it at once", None, "request_timeout") from None
        return b"".join(parts)

    def host_ok(request: Request) -> bool:
        """A loopback bind answers only loopback names (a web page cannot reach it under a name it controls)."""
        host = request.headers.get("host", "")
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        name = name.strip("[]").lower()
        if name in cfg.allowed_hosts:
            return True
        if door.is_loopback(cfg.host):
            return door.is_loopback(name)
        return not cfg.allowed_hosts

    def auth(request: Request) -> None:
        if not host_ok(request):
            raise ApiError(421, f"Host: got {request.headers.get('host', '')!r}; this endpoint answers requests "
                                "sent to its own address (openai.allowed_hosts lists the names it accepts)", None,
                           "misdirected_request")
        if not front.authorized(request.headers.get("authorization")):
            raise ApiError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>` with the key this "
                                f"endpoint was started with ({door.API_KEY_ENV})", None, "invalid_api_key")

    def model_card() -> dict:
        return {"id": cfg.name, "object": "model", "created": front.created, "owned_by": "pipeline",
                "methods": cfg.methods, "default_method": cfg.default_method, "max_model_len": cfg.max_seq_len}

    async def models(request: Request):
        try:
            auth(request)
        except ApiError as e:
            return error(e)
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def one_model(request: Request):
        try:
            auth(request)
            if request.path_params["model"] != cfg.name:
                raise ApiError(404, f"The model {request.path_params['model']!r} does not exist; this deployment "
                                    f"serves {cfg.name!r}", "model", "model_not_found")
        except ApiError as e:
            return error(e)
        return JSONResponse(model_card())

    async def health_route(request: Request):
        if time.monotonic() - ready["at"] > 1.0:
            ready["ok"], ready["at"] = await triton["channel"].ready(cfg.triton_model), time.monotonic()
        if ready["ok"]:  # ready or not, nothing else: /health answers without the key
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    async def body_of(request: Request):
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise ApiError(415, f"Content-Type: got {ctype or 'none'!r}; send the body as application/json", None,
                           "unsupported_media_type")
        size = request.headers.get("content-length")
        if size and size.isdigit() and int(size) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is {size} bytes; at most {MAX_BODY_BYTES} are read", None,
                           "request_too_large")
        raw = await read_body(request)
        return parse_body(raw)

    def chunk(kind: str, rid: str, created: int, delta: str | None, finish: str | None, first: bool = False) -> dict:
        if kind == "chat":
            d: dict = {"role": "assistant", "content": ""} if first else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": created, "model": cfg.name, "system_fingerprint": None,
                "choices": [choice]}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    async def next_event(run: Run, request: Request, poll: bool):
        """The next event of the run; while none comes, notice a client that left (non-streamed requests)."""
        getter = asyncio.ensure_future(run.queue.get())  # one getter throughout: a timed-out wait loses nothing
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=0.2)
                if done:
                    return getter.result()
                if poll and await request.is_disconnected():
                    run.leave()  # cancels the Triton request
                    return "gone", None
        finally:
            if not getter.done():
                getter.cancel()

    async def complete(request: Request, kind: str):
        try:
            auth(request)
            body = await body_of(request)
            if running["n"] >= cfg.max_concurrent:
                raise ApiError(429, f"this deployment is running {cfg.max_concurrent} requests, its limit "
                                    "(openai.max_concurrent); retry after a second", None, "rate_limit_exceeded",
                               "requests")
            running["n"] += 1  # held until the answer (or its stream) ends
        except ApiError as e:
            return error(e)
        held = True
        try:
            response = await answer(request, kind, body)
            if isinstance(response, StreamingResponse):
                held = False  # the stream gives the place back when it ends
            return response
        finally:
            if held:
                running["n"] -= 1

    async def answer(request: Request, kind: str, body):
        try:
            job = await asyncio.to_thread(front.check, body, kind)  # templating and tokenizing off the event loop
        except ApiError as e:
            return error(e)
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        rid, created = f"{prefix}-{uuid.uuid4().hex[:24]}", int(time.time())
        run = Run(front, job, triton["channel"], rid)
        run.start()
        if not job.stream:
            text: list[str] = []
            try:
                while True:
                    what, value = await next_event(run, request, poll=True)
                    if what == "piece":
                        text.append(value)
                    elif what == "error":
                        return error(triton_error(value))
                    elif what == "gone":
                        return error(CLIENT_GONE)  # nobody reads it: the client has left
                    else:
                        break
            except BaseException:
                run.leave()  # the client left (or the server stops): cancel the Triton request
                raise
            tail, usage, spec = run.finish(value)
            content = "".join(text) + tail
            finish = run.finish_reason(value, usage)
            if kind == "infill":
                return JSONResponse(infill_result(run, value, content, usage, spec, body))
            if kind == "chat":
                choice = {"index": 0, "message": {"role": "assistant", "content": content, "refusal": None},
                          "logprobs": None, "finish_reason": finish}
                obj = "chat.completion"
            else:
                choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish}
                obj = "text_completion"
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": cfg.name,
                                 "system_fingerprint": None, "choices": [choice], "usage": usage,
                                 "speculative": spec})

        # Streamed: the first event decides between an HTTP error and a 200 stream (a refusal is never mid-stream).
        try:
            first = await next_event(run, request, poll=True)
        except BaseException:
            run.leave()
            raise
        if first[0] == "error":
            return error(triton_error(first[1]))
        if first[0] == "gone":
            return error(CLIENT_GONE)

        if kind == "infill":
            return StreamingResponse(infill_events(run, first, body), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        async def events():
            what, value = first
            try:
                if kind == "chat":
                    yield sse({**chunk(kind, rid, created, None, None, first=True),
                               **({"usage": None} if job.include_usage else {})})
                while True:
                    if what == "piece":
                        c = chunk(kind, rid, created, value, None)
                        yield sse({**c, "usage": None} if job.include_usage else c)
                    elif what == "error":
                        yield sse(triton_error(value).body())
                        break
                    else:
                        tail, usage, spec = run.finish(value)
                        if tail:
                            c = chunk(kind, rid, created, tail, None)
                            yield sse({**c, "usage": None} if job.include_usage else c)
                        last = {**chunk(kind, rid, created, None, run.finish_reason(value, usage)),
                                "speculative": spec}
                        yield sse({**last, "usage": None} if job.include_usage else last)
                        if job.include_usage:
                            yield sse({"id": rid, "object": last["object"], "created": created, "model": cfg.name,
                                       "system_fingerprint": None, "choices": [], "usage": usage,
                                       "speculative": spec})
                        break
                    what, value = await run.queue.get()
                yield "data: [DONE]\n\n"
            finally:
                run.leave()  # a client that left mid-stream: its Triton request is cancelled at once
                running["n"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def infill_result(run: Run, r: dict, content: str, usage: dict, spec: dict, body: dict) -> dict:
        """llama.cpp's /completion result for an /infill answer (its `response_fields` pick and flatten fields)."""
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        ttft, latency = float(r.get("ttft_s") or 0.0), float(r.get("latency_s") or 0.0)
        n = usage["completion_tokens"]
        out = {"index": 0, "content": content, "tokens": [], "id_slot": 0, "stop": True, "model": cfg.name,
               "tokens_predicted": n, "tokens_evaluated": usage["prompt_tokens"], "tokens_cached": cached,
               "truncated": False, "has_new_line": "\n" in content,
               "stop_type": "word" if run.scan.hit else ("limit" if run.finish_reason(r, usage) == "length"
                                                          else "eos"),
               "stopping_word": run.scan.matched if run.scan.hit else "",
               "timings": {"cache_n": cached, "prompt_n": usage["prompt_tokens"] - cached,
                           "prompt_ms": ttft * 1e3, "predicted_n": n, "predicted_ms": (latency - ttft) * 1e3,
                           "predicted_per_second": n / (latency - ttft) if latency > ttft else None},
               "speculative": spec}
        fields = body.get("response_fields")
        if isinstance(fields, list) and all(isinstance(f, str) for f in fields):
            picked = {}
            for f in fields:  # "timings/prompt_n": a nested field, flattened under its path (llama.cpp's rule)
                v, ok = out, True
                for part in f.split("/"):
                    ok = isinstance(v, dict) and part in v
                    v = v[part] if ok else None
                    if not ok:
                        break
                if ok:
                    picked[f] = v
            out = picked
        return out

    async def infill_events(run: Run, first, body: dict):
        """llama.cpp's stream: `data: {"content": piece, "stop": false}` per piece, then the result with stop true."""
        what, value = first
        try:
            while True:
                if what == "piece":
                    yield sse({"index": 0, "content": value, "stop": False, "id_slot": 0})
                elif what == "error":
                    yield sse(triton_error(value).body())
                    break
                else:
                    tail, usage, spec = run.finish(value)
                    yield sse(infill_result(run, value, tail, usage, spec, body))
                    break
                what, value = await run.queue.get()
        finally:
            run.leave()
            running["n"] -= 1

    async def infill(request: Request):
        return await complete(request, "infill")

    async def chat(request: Request):
        return await complete(request, "chat")

    async def completions(request: Request):
        return await complete(request, "text")

    async def http_error(request: Request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", None,
                                     code).body(), status_code=exc.status_code)

    async def crash(request: Request, exc: Exception):
        ref = uuid.uuid4().hex[:12]  # the log has the exception under this reference; the client gets none of it
        print(f"internal error {ref} on {request.method} {request.url.path}: {type(exc).__name__}: {exc}", flush=True)
        return JSONResponse(ApiError(500, f"internal error (reference {ref} in the endpoint's log)", None,
                                     "server_error", "server_error").body(), status_code=500)

    routes = [Route("/health", health_route), Route("/v1/models", models), Route("/v1/models/{model:path}", one_model),
              Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/infill", infill, methods=["POST"])]
    @contextlib.asynccontextmanager
    async def lifespan(app):
        # Templating and tokenizing run on this pool: at most one thread per running request (openai.max_concurrent).
        pool = concurrent.futures.ThreadPoolExecutor(cfg.max_concurrent, thread_name_prefix="openai-check")
        asyncio.get_running_loop().set_default_executor(pool)
        # Every Triton request is a call on this one channel, run on the event loop: no thread per request.
        triton["channel"] = TritonChannel(cfg.grpc_url)
        try:
            yield
        finally:
            await triton["channel"].close()
            pool.shutdown(wait=False, cancel_futures=True)

    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: crash},
                     lifespan=lifespan)


def serve(config_path: str) -> None:
    """Run the endpoint in this process until SIGTERM (what `start` launches)."""
    import uvicorn  # lazy: uvicorn (~0.25 s) only in the endpoint's process

    from pipeline.runtime.engine_io import load_tokenizer  # lazy: loads torch (~1.5 s); only the endpoint needs it

    cfg = FrontConfig(**json.loads(Path(config_path).read_text()))
    front = Front(cfg, load_tokenizer(Path(cfg.tokenizer_dir)), door.api_key())
    print(f"OpenAI endpoint for {cfg.name!r} on {cfg.host}:{cfg.port} -> Triton {cfg.grpc_url} model "
          f"{cfg.triton_model}; methods {cfg.methods or '(the model says)'}, default {cfg.default_method}; "
          f"API key {'required' if front.api_key else 'not required'}", flush=True)
    uvicorn.run(make_app(front), host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=5, http=guarded_protocol(cfg.header_timeout_s),
                limit_concurrency=cfg.max_connections, timeout_keep_alive=5)


def guarded_protocol(header_timeout_s: float):
    """uvicorn's HTTP/1.1 protocol with a deadline on a connection's first request line and headers (uvicorn times
    only the idle gap between requests): a client that connects and sends nothing, or its headers a byte at a time,
    gets 408 and is closed, so idle sockets cannot pile up."""
    from uvicorn.protocols.http.h11_impl import H11Protocol  # lazy: uvicorn only in the endpoint's process

    body = json.dumps(ApiError(408, f"the request's headers did not arrive within {header_timeout_s:g} s "
                                    "(openai.header_timeout_s)", None, "request_timeout").body()).encode()
    reply = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
             b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    class Guarded(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._deadline = self.loop.call_later(header_timeout_s, self._too_slow)

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and self._deadline is not None:  # a request's headers are in
                self._deadline.cancel()
                self._deadline = None

        def connection_lost(self, exc) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            super().connection_lost(exc)

        def _too_slow(self) -> None:
            self._deadline = None
            if self.cycle is None and not self.transport.is_closing():
                self.transport.write(reply)
                self.transport.close()

    return Guarded


if __name__ == "__main__":
    serve(sys.argv[1])

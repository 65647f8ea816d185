"""Ours and llama.cpp's llama-server side by side through the OpenAI endpoint, request by request.

validate's `context` section (issue 48: long and repeated prompts) and `edit` section (issue 49: edits of whole
files) send the same chat requests to our endpoint and to llama-server processes on the target's GGUF, one system
after the other within each step, so that all of them see the same minutes of this noisy machine. What both
sections share lives here: a `System` (an endpoint plus the body fields that make it one system: our `method`,
`cache_prompt`, `prediction`), the llama-server modes, and the pure functions that turn timings into the reports'
figures. A system whose server refuses a field it sends (HTTP 400 naming the field: a feature not built yet, or not
built there) is recorded as unsupported with the server's own message, one whose request fails as failed with the
error, and the run goes on without it.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import openai_client, peers
from pipeline.openai_client import ApiRequestError

# llama-server's modes: its defaults (prompt cache on, one slot), its model-free drafter, and the draft GGUF.
LLAMA_MODES = ("plain", "ngram-mod", "draft-simple")
# --spec-draft-n-max for draft-simple: the larger of the two validate tries on chat prompts (its default is 3).
LLAMA_DRAFT_N_MAX = peers.DRAFT_N_MAX[-1]


@dataclass
class System:
    """One system under test: an OpenAI endpoint and the body fields that make it this system. `unsupported`:
    why it does not run (its server refused a field, or it could not be started), None while it does."""

    label: str
    url: str
    model: str
    method: str | None = None
    extra: dict = field(default_factory=dict)
    ours: bool = True
    unsupported: str | None = None

    def ask(self, messages: list[dict], max_tokens: int, extra: dict | None = None,
            timeout: float = 1800.0) -> dict | None:
        """One greedy streamed chat completion: its figures (`figures`), or None when the system is unsupported or
        its server just refused a field this system sends or failed the request (then it is out from here on, with
        the reason, and the other systems go on)."""
        if self.unsupported:
            return None
        body = {**self.extra, **(extra or {})}
        if not self.ours:
            body.setdefault("top_k", 1)  # llama.cpp's greedy, as peers.LlamaServer.chat sends it
        try:
            r = openai_client.complete(self.url, self.model, messages=messages, max_tokens=max_tokens,
                                       temperature=0.0, method=self.method, extra=body, timeout=timeout)
        except ApiRequestError as e:  # a missing feature, or a failure: either way this system stops, said why
            self.unsupported = (refused_field(e, [*body, *(["method"] if self.method else [])])
                                or f"failed: {type(e).__name__}: {str(e)[:300]}")
            return None
        return figures(r)


def refused_field(e: ApiRequestError, sent: list[str]) -> str | None:
    """The reason to record when `e` is a 400 refusing one of the body fields `sent` (a feature the server lacks),
    else None (any other error is a failure, not a missing feature)."""
    param = (e.error or {}).get("param")
    if e.status != 400 or param not in sent:
        return None
    return f"unsupported: the server refused `{param}` (HTTP 400: {(e.error or {}).get('message', '')[:300]})"


def figures(r: dict) -> dict:
    """One response's figures, the same for every server: token counts from `usage` (llama-server's `timings`
    where usage lacks them), the prompt tokens served from a cache (ours: usage.prompt_tokens_details.cached_tokens;
    llama-server: timings.cache_n), time to first token and to the second streamed piece (work a server puts off
    past the first token, such as a draft model's prefill, lands before it), decode tokens/s after the first token,
    prefill tokens/s of the prompt tokens actually computed, and OpenAI's accepted/rejected prediction tokens."""
    usage, tm = r.get("usage") or {}, r.get("timings") or {}
    prompt = usage.get("prompt_tokens")
    if prompt is None and tm.get("prompt_n") is not None:
        prompt = int(tm["prompt_n"]) + int(tm.get("cache_n") or 0)
    out_tokens = usage.get("completion_tokens", tm.get("predicted_n"))
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None and tm.get("cache_n") is not None:
        cached = int(tm["cache_n"])
    details = usage.get("completion_tokens_details") or {}
    ttft, latency = r["ttft_s"], r["latency_s"]
    n = int(out_tokens) if out_tokens is not None else None
    computed = (prompt - (cached or 0)) if prompt is not None else None
    return {"text": r["text"], "finish_reason": r.get("finish_reason"), "prompt_tokens": prompt,
            "cached_tokens": cached, "completion_tokens": n, "ttft_s": ttft, "latency_s": latency,
            "second_piece_s": r.get("second_piece_s"),
            "decode_tokens_per_s": decode_rate([(n or 0, latency - ttft)]),
            "prefill_tokens_per_s": computed / ttft if computed and ttft > 0 else None,
            "accepted_prediction_tokens": details.get("accepted_prediction_tokens"),
            "rejected_prediction_tokens": details.get("rejected_prediction_tokens"),
            "acceptance_rate": r.get("acceptance_rate"),
            "server_prompt_ms": tm.get("prompt_ms"), "server_decode_tokens_per_s": tm.get("predicted_per_second")}


# ---- pure figures ------------------------------------------------------------------------------------------------

def decode_rate(parts: list[tuple[int, float]]) -> float | None:
    """Decode tokens/s over (completion tokens, seconds after the first token) pairs: the tokens after each
    request's first (the first one is the prefill's) over the time after it; None when there is none."""
    tokens = sum(max(0, n - 1) for n, _ in parts)
    secs = sum(s for n, s in parts if n > 1)
    return tokens / secs if tokens and secs > 0 else None


def fmt(x: float | None, spec: str = ".2f", unit: str = "") -> str:
    """A figure for the reports' markdown ("n/a" where it was not measured)."""
    return "n/a" if x is None else f"{x:{spec}}{unit}"


def write_report(spec, name: str, report: dict) -> None:
    """reports/<name>/<name>.json (context.json, edit.json)."""
    spec.report_dir.mkdir(parents=True, exist_ok=True)
    (spec.report_dir / f"{name}.json").write_text(json.dumps(report, indent=2))


def median(xs: list[float | None]) -> float | None:
    """The median of the values that exist (None when none does)."""
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    return a / b if a is not None and b else None


def identity(texts: list[str | None], reference: list[str | None]) -> dict:
    """How many answers equal the reference's, pair by pair (pairs where either is missing are not counted), and
    at which indices they differ."""
    pairs = [(i, a, b) for i, (a, b) in enumerate(zip(texts, reference)) if a is not None and b is not None]
    differ = [i for i, a, b in pairs if a != b]
    return {"identical": len(pairs) - len(differ), "total": len(pairs), "differ": differ}


# ---- llama-server --------------------------------------------------------------------------------------------------

def llama_command(exe: Path, gguf: Path, port: int, threads: int, ctx: int, mode: str,
                  draft: Path | None = None) -> list[str]:
    """llama-server's command line for `mode`: peers.server_command's (127.0.0.1, one slot, the GGUF's chat template)
    with context `ctx` and otherwise its defaults (the prompt cache on), plus `--spec-type ngram-mod`, or the draft
    GGUF with `--spec-type draft-simple` (both in the pinned llama.cpp: common/arg.cpp, common/speculative.cpp)."""
    if mode == "draft-simple":
        if draft is None:
            raise ValueError("mode draft-simple needs the draft's GGUF")
        return peers.server_command(exe, gguf, port, threads, ctx, peers.Mode(draft, LLAMA_DRAFT_N_MAX))
    cmd = peers.server_command(exe, gguf, port, threads, ctx)
    if mode == "ngram-mod":
        cmd += ["--spec-type", "ngram-mod"]
    elif mode != "plain":
        raise ValueError(f"llama-server mode {mode!r}: one of {', '.join(LLAMA_MODES)}")
    return cmd


@contextlib.contextmanager
def llama_systems(spec, modes: tuple[str, ...], ctx: int, section: str, log=print) -> Iterator[list[System]]:
    """A running llama-server per mode on the target's GGUF (each its own process, started one after the other and
    all stopped at the end), as Systems labelled `llama-server <mode>`. A mode that cannot run is a System with
    `unsupported` saying why (no GGUF target, the binary not built, no draft GGUF, a failed start)."""
    gguf, exe, draft = peers.gguf_of(spec), peers.binary(), peers.gguf_of(spec, "draft")
    with contextlib.ExitStack() as stack:
        out = []
        for mode in modes:
            s = System(f"llama-server {mode}", "", "llama-server", ours=False)
            out.append(s)
            if gguf is None:
                s.unsupported = "the target is not a GGUF: llama-server has nothing of it to run"
            elif exe is None:
                s.unsupported = peers.NOT_BUILT
            elif mode == "draft-simple" and draft is None:
                s.unsupported = "the spec's draft is not a GGUF"
            if s.unsupported:
                continue
            port = peers.free_port()
            cmd = llama_command(exe, gguf, port, peers.server_threads(spec), ctx, mode, draft)
            path = spec.report_dir / "llama-server" / f"llama-server-{mode}-{section}.log"
            try:
                srv = stack.enter_context(peers.LlamaServer(cmd, port, path))
            except (OSError, RuntimeError, TimeoutError) as e:
                s.unsupported = f"llama-server {mode} did not start: {type(e).__name__}: {str(e)[:300]}"
                log(f"  {s.unsupported}")
                continue
            s.url = srv.url + "/v1"
        yield out

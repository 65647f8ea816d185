"""`python -m pipeline load SPEC`: N concurrent gRPC clients for S seconds against the local server.

Every greedy answer must equal the reference answer for its prompt (taken first, one request at a
time), every response must be complete, and the server's memory (tritonserver plus its stubs) is
measured before and after. `--soak` mixes what clients do: every served model in turn, every method the
engines serve,
greedy and sampled temperatures, streamed and unary requests, clients that cancel their stream
after the first piece and clients that drop their connection (the provoked ones are counted as
`cancelled` / `disconnected`, not as errors, and the server's own cancelled counter must move by
as many). `--curve 1,8,32,128` measures tokens/s at each concurrency (plain resubmitting clients)
into reports/<name>/load_curve.json. Bounded in clients and time, and loopback only: this is a soak
test for the deployment on this machine, not a tool for loading other hosts.
"""

from __future__ import annotations

import ipaddress
import json
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from pipeline import openai_client
from pipeline import spec as specmod
from pipeline.client import RequestError, RequestTimeout, chat_text, generate
from pipeline.door import local_host
from pipeline.openai_client import base_url as own_url
from pipeline.triton.repo import client_model, served_methods
from pipeline.triton.server import metrics_url, running_pid, server_rss_mb

MAX_CONCURRENCY = 256
MAX_DURATION_S = 3600.0
SOAK = {"concurrency": 32, "duration": 120.0, "temperatures": (0.0, 0.7, 1.0), "cancel_every": 10,
        "disconnect_every": 15}


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    ys = sorted(xs)
    i = min(len(ys) - 1, max(0, round(q / 100 * (len(ys) - 1))))
    return ys[i]


def _loopback_url(spec: specmod.Spec) -> str:

    host = local_host(spec.triton.host)
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"triton.host: {spec.triton.host!r}; the load test only targets this machine's loopback "
                         "(serve on 127.0.0.1 or 0.0.0.0)")
    return f"{host}:{spec.triton.grpc_port}"


def _loopback_base_url(url: str) -> str:
    """An OpenAI base URL on this machine (`load --api openai`), or a ValueError."""

    host = urllib.parse.urlsplit(url).hostname or ""
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"--base-url: {url!r}; the load test only targets this machine's loopback "
                         "(http://127.0.0.1:PORT/v1)")
    return url


def server_counters(spec: specmod.Spec, *names: str) -> dict[str, float]:
    """Each served-model counter in `names` summed over its labels, from one read of the metrics endpoint (all 0
    when it cannot be read)."""

    try:
        text = urllib.request.urlopen(metrics_url(spec), timeout=10).read().decode()
    except OSError:
        return dict.fromkeys(names, 0.0)
    out = dict.fromkeys(names, 0.0)
    for ln in text.splitlines():
        name, brace, _ = ln.partition("{")
        if brace and name in out:
            out[name] += float(ln.rpartition(" ")[2])
    return out


# An abandoned request never ends by itself (end_id -1: no end token; and `long_budget` tokens): its client is gone
# before its final response. tritonserver 2.51 (the newest nvidia-pytriton's) can crash when a client drops its
# connection in the moment its stream's final response is sent (docs/serving.md, "Known upstream issue"); a soak
# provokes that on every model that answers an abandoned request in a few tokens, and measures Triton, not the models.
ABANDONED = {"end_id": -1}
CANCELLED = "spec_decode_requests_cancelled_total"
OUTPUT = "spec_decode_output_tokens_total"  # tokens of the requests the served models finished
# Every request a served model takes ends in exactly one of these (a load request is one row).
ENDED = ("spec_decode_requests_total", "spec_decode_request_errors_total", CANCELLED)


def _server_ended(spec: specmod.Spec) -> tuple[float, float]:
    """(requests the served models cancelled, requests they are done with: finished, failed or cancelled)."""
    c = server_counters(spec, *ENDED)
    return c[CANCELLED], sum(c.values())


def _check(concurrency: int, duration: float, max_tokens: int) -> None:
    if not 1 <= concurrency <= MAX_CONCURRENCY:
        raise ValueError(f"--concurrency: got {concurrency}; must be between 1 and {MAX_CONCURRENCY}")
    if not 0 < duration <= MAX_DURATION_S:
        raise ValueError(f"--duration: got {duration}; must be between 0 and {MAX_DURATION_S:.0f} seconds")
    if max_tokens < 1:
        raise ValueError(f"--max-tokens: got {max_tokens}; must be 1 or more")


def _prompts(spec: specmod.Spec, num_prompts: int, chat: bool) -> list[str]:
    from pipeline.sources import spec_prompts  # lazy: loads torch (~1.5 s); the CLI imports this module at start

    prompts = spec_prompts(spec, num_prompts)
    if chat:
        from pipeline.runtime.engine_io import load_tokenizer  # lazy: torch, as above

        tok_dir = spec.engine_dir / "target"
        if (tok_dir / "tokenizer_config.json").is_file():
            tok = load_tokenizer(tok_dir)
            prompts = [chat_text(tok, p) for p in prompts]
    return prompts


_STAT_KEYS = ("requests", "errors", "incomplete", "greedy_mismatches", "tokens", "greedy", "cancelled", "disconnected",
              "streamed", "unary", "sampled")


class _Request(NamedTuple):
    """What one client request does (see _Mix.request)."""

    method: str
    temperature: float
    opts: dict
    cancel: bool
    drop: bool
    unary: bool


@dataclass(frozen=True)
class _Mix:
    """The run's mix of requests: which method, temperature and kind (streamed, unary, cancelled, dropped) request i
    is, a pure function of i so every run with the same settings sends the same requests."""

    methods: tuple[str, ...]
    temperatures: tuple[float, ...]
    sample_every: int
    cancel_every: int
    disconnect_every: int
    unary_every: int
    decoupled: bool

    def request(self, i: int) -> _Request:
        method = self.methods[i % len(self.methods)]
        if self.temperatures:
            temp = self.temperatures[(i // len(self.methods)) % len(self.temperatures)]
            opts = {"temperature": temp, "seed": i} if temp > 0 else {}
        else:
            sampled = self.sample_every > 0 and i % self.sample_every == self.sample_every - 1
            temp = 0.8 if sampled else 0.0
            opts = {"temperature": 0.8, "top_p": 0.95, "seed": i} if sampled else {}
        nth = lambda every: every > 0 and i % every == every - 1  # request i is every `every`-th
        drop = self.decoupled and nth(self.disconnect_every)
        cancel = self.decoupled and not drop and nth(self.cancel_every)
        unary = not (cancel or drop) and (not self.decoupled or nth(self.unary_every))
        return _Request(method, temp, opts, cancel, drop, unary)


@dataclass
class _Tally:
    """What the clients saw; the client threads add to it under `lock`."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    stats: dict = field(default_factory=lambda: dict.fromkeys(_STAT_KEYS, 0))
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    done_at: list[tuple[float, int]] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)

    def failed(self, method: str, e: Exception, timed_out: bool) -> None:
        """A request that raised: a timeout (no response, or too late) is incomplete, anything else an error."""
        with self.lock:
            self.stats["requests"] += 1
            self.stats["incomplete" if timed_out else "errors"] += 1
            if len(self.samples) < 5:
                self.samples.append(f"{method}: {e}")

    def answered(self, r: dict, req: _Request, p: int, expected: str, cut_at: float | None) -> None:
        """A request that returned: counted by kind, its tokens and times kept, a greedy answer checked against
        `expected` (`cut_at`: a window run's deadline; an answer unfinished past it was cancelled there and counts
        as neither complete nor incomplete)."""
        stats = self.stats
        with self.lock:
            stats["requests"] += 1
            if req.cancel or req.drop:
                stats["disconnected" if req.drop else "cancelled"] += 1
                return
            stats["unary" if req.unary else "streamed"] += 1
            if cut_at is not None and not r["complete"] and time.monotonic() > cut_at:
                stats["cut"] = stats.get("cut", 0) + 1  # cancelled at the deadline
                return
            if not r["complete"] or r.get("num_output_tokens") is None:
                stats["incomplete"] += 1
                return
            stats["tokens"] += r["num_output_tokens"]
            self.done_at.append((time.monotonic(), r["num_output_tokens"]))
            self.latencies.append(r["latency_s"] * 1000)
            self.ttfts.append(r["ttft_s"] * 1000)
            if req.temperature > 0:
                stats["sampled"] += 1
                return
            stats["greedy"] += 1
            if r["text"] != expected:
                stats["greedy_mismatches"] += 1
                if len(self.samples) < 5:
                    self.samples.append(f"{req.method} prompt {p}: got {r['text'][:60]!r}, expected {expected[:60]!r}")


@dataclass
class _Clients:
    """Everything a client needs to send request i and tally its answer, fixed for the run."""

    generate: Callable[..., dict]
    url: str
    model: str
    models: tuple[str, ...]
    prompts: list[str]
    reference: list[str]
    max_tokens: int
    long_budget: int  # what an abandoned request asks for: far more than it will get, so it is still decoding
    mix: _Mix
    window: bool
    deadline: float
    request_timeout: float
    tally: _Tally = field(default_factory=_Tally)

    def send(self, i: int) -> None:

        p = i % len(self.prompts)
        req = self.mix.request(i)
        abandon = req.cancel or req.drop
        pieces: list = []
        stop_at = (lambda: bool(pieces)) if abandon else None
        if self.window and not req.unary:
            stop_at = (lambda f=stop_at: time.monotonic() > self.deadline or bool(f and f()))
        try:
            r = self.generate(self.url, self.models[i % len(self.models)] if self.models else self.model,
                              self.prompts[p], self.max_tokens if not abandon else self.long_budget,
                              method=req.method, stream=not req.unary, unary=req.unary and not self.mix.decoupled,
                              timeout=self.request_timeout, on_piece=pieces.append,
                              cancel=stop_at, disconnect=req.drop, **req.opts, **(ABANDONED if abandon else {}))
        except RequestError as e:  # a RequestTimeout (no response, or too late) is incomplete, not a hang
            self.tally.failed(req.method, e, isinstance(e, RequestTimeout))
            return
        self.tally.answered(r, req, p, self.reference[p], self.deadline if self.window else None)

    def worker(self, w: int, concurrency: int) -> None:
        """Client w: requests w, w + concurrency, ... until the deadline (each waits for its answer)."""
        i = w
        while time.monotonic() < self.deadline:
            self.send(i)
            i += concurrency


def _endpoint(spec: specmod.Spec, api: str, base_url: str | None, chat: bool) -> tuple[str, Callable, bool]:
    """(url, generate, decoupled) for the API the clients use; only this machine's loopback is accepted."""
    if api == "openai":

        url = _loopback_base_url(base_url or own_url(spec))
        return url, lambda *a, **k: openai_client.generate(*a, chat=chat, **k), True

    return _loopback_url(spec), generate, spec.triton.decoupled


def _run_clients(clients: _Clients, concurrency: int, duration: float, pid: int | None
                 ) -> tuple[float, threading.Timer, dict]:
    """Run `concurrency` client threads to the deadline, each wait bounded; (start time, RSS probe, its reading).

    The probe reads the server's RSS once the warm-up quarter has passed (caches and arenas grown); a client still
    waiting request_timeout + 15 s after the deadline is left behind and its request counted incomplete."""

    t0 = time.monotonic()
    warmed: dict = {}
    probe = threading.Timer(duration / 4, lambda: warmed.setdefault("rss", server_rss_mb(pid) if pid else 0.0))
    probe.daemon = True
    probe.start()
    threads = [threading.Thread(target=clients.worker, args=(w, concurrency), daemon=True)
               for w in range(concurrency)]
    for t in threads:
        t.start()
    give_up = clients.deadline + clients.request_timeout + 15.0
    for t in threads:
        t.join(timeout=max(0.0, give_up - time.monotonic()))
    stuck = sum(t.is_alive() for t in threads)
    if stuck:  # each has one request in flight that never ended: incomplete (the daemon threads are left behind)
        tally = clients.tally
        with tally.lock:
            tally.stats["requests"] += stuck
            tally.stats["incomplete"] += stuck
            tally.samples.append(f"{stuck} clients still waiting {clients.request_timeout + 15:.0f}s after the "
                                 "deadline")
    return t0, probe, warmed


def _await_server_cancels(spec: specmod.Spec, tally: _Tally, cancelled_before: float, ended_before: float) -> None:
    """Give the server up to 10 s to count the cancellations the clients provoked (it notices the last ones late).

    The wait ends early once it has counted them all, or once it has ended every request the clients sent (finished,
    failed or cancelled): an abandoned request the model finished before its cancel arrived is never counted as
    cancelled, and waiting longer would not change the count (a server without these counters gets the 10 s)."""
    provoked = tally.stats["cancelled"] + tally.stats["disconnected"] + tally.stats.get("cut", 0)
    if not provoked:
        return
    sent = tally.stats["requests"]
    settle = time.monotonic() + 10
    while time.monotonic() < settle:
        cancelled, ended = _server_ended(spec)
        if cancelled - cancelled_before >= provoked:
            return
        if ended - ended_before >= sent:
            time.sleep(0.2)  # a finished request's token count is posted just after the count that ended it
            return
        time.sleep(0.2)


def finished_before_cancel(missed: float, unseen_tokens: float, long_budget: int) -> int:
    """How many of the `missed` abandoned requests (abandoned by their clients, finished by the server) the server had
    decoded to their whole budget before their client's cancel reached it. The soak's tiny model decodes a budget in
    100-250 ms with a lookup method, and on a loaded 2-core machine a client sees its first piece 25-80 ms after it
    was sent, then cancels (docs/serving.md, "Soak"). Told apart from a request that ended at some other point as its
    client went by the tokens the server finished that no client saw (`unseen_tokens`): a whole `long_budget` for
    each of these, a few for the others."""
    return int(min(missed, max(0.0, unseen_tokens // long_budget)))


def _summary(spec: specmod.Spec, clients: _Clients, t0: float, wall: float, duration: float, concurrency: int,
             before: dict, rss_mb: dict, api: str) -> dict:
    """The report: counts, tokens/s (the steady window's with `window`), latencies, memory and the run's settings."""
    tally, mix, deadline = clients.tally, clients.mix, clients.deadline
    stats = tally.stats
    after = server_counters(spec, CANCELLED, OUTPUT)
    cancelled = stats["cancelled"] + stats["disconnected"]
    server_cancelled = after[CANCELLED] - before[CANCELLED]
    whole = finished_before_cancel(max(0.0, cancelled - server_cancelled),
                                   after[OUTPUT] - before[OUTPUT] - stats["tokens"], clients.long_budget)
    warm = t0 + duration / 4
    steady = sum(n for t, n in tally.done_at if warm <= t <= deadline) / (deadline - warm)
    model, models = clients.model, clients.models
    return {
        "requests": stats["requests"], "errors": stats["errors"], "incomplete": stats["incomplete"],
        "greedy_requests": stats["greedy"], "greedy_mismatches": stats["greedy_mismatches"],
        "sampled_requests": stats["sampled"], "streamed": stats["streamed"], "unary": stats["unary"],
        "cancelled": cancelled, "cancelled_by_client": stats["cancelled"], "disconnected": stats["disconnected"],
        "server_cancelled": server_cancelled, "finished_before_cancel": whole,
        "output_tokens": stats["tokens"],
        "tokens_per_s": steady if clients.window else (stats["tokens"] / wall if wall > 0 else 0.0),
        "cut_at_deadline": stats.get("cut", 0),
        "latency_ms": {"p50": _percentile(tally.latencies, 50), "p95": _percentile(tally.latencies, 95)},
        "ttft_ms": {"p50": _percentile(tally.ttfts, 50), "p95": _percentile(tally.ttfts, 95)},
        "rss_mb": rss_mb,
        "concurrency": concurrency, "duration_s": wall, "max_tokens": clients.max_tokens,
        "methods": list(mix.methods), "temperatures": list(mix.temperatures), "model": model,
        "models": list(models or (model,)), "decoupled": mix.decoupled, "problems": tally.samples, "api": api,
        "url": clients.url, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "spec": spec.name,
    }


def _write_report(spec: specmod.Spec, out: dict, api: str, write: bool, log: Callable) -> None:
    """Write load.json (load_openai.json for --api openai) when asked, and say what the run saw in one line."""
    name = "load_openai.json" if api == "openai" else "load.json"
    if write:
        spec.report_dir.mkdir(parents=True, exist_ok=True)
        (Path(spec.report_dir) / name).write_text(json.dumps(out, indent=2))
    rss = out["rss_mb"]
    log(f"{out['requests']} requests, {out['errors']} errors, {out['incomplete']} incomplete, "
        f"{out['greedy_mismatches']} greedy mismatches, {out['cancelled']} cancelled by clients "
        f"({out['server_cancelled']:.0f} counted by the server); {out['tokens_per_s']:.1f} tokens/s; latency p50 "
        f"{out['latency_ms']['p50']:.0f} ms, p95 {out['latency_ms']['p95']:.0f} ms; server RSS "
        f"{rss['start']:.0f} MB at the start, {rss['before']:.0f} after the warm-up quarter -> {rss['after']:.0f} MB"
        + (f"; wrote {spec.report_dir / name}" if write else ""))


def run_load(spec: specmod.Spec, concurrency: int, duration: float, max_tokens: int = 32,
             methods: tuple[str, ...] = ("baseline",), model: str = "ensemble", num_prompts: int = 8,
             sample_every: int = 4, chat: bool = True, log=print, temperatures: tuple[float, ...] = (),
             cancel_every: int = 0, disconnect_every: int = 0, unary_every: int = 0, write: bool = True,
             reference: list[str] | None = None, window: bool = False, request_timeout: float = 120.0,
             models: tuple[str, ...] = (), api: str = "grpc", base_url: str | None = None) -> dict:
    """Drive the running server; return (and write to reports/<name>/load.json) the summary.

    Request i of the run uses methods[i % len(methods)]; with `temperatures` it cycles through them (0 is
    greedy and checked against the reference), else every `sample_every`-th request samples at 0.8. Every
    `unary_every`-th request is unary (one response: ModelInfer on a `triton.decoupled: false` server, a
    stream=false request on a decoupled one), the others stream; every `cancel_every`-th cancels its stream
    after the first piece and every `disconnect_every`-th drops its connection there instead. With `models`,
    request i goes to models[i % len(models)] (the soak sends to every served model); else to `model`.

    With `window`, streams still running at the deadline are cancelled there (not waited for) and
    `tokens_per_s` counts the requests completed between a warm-up (a quarter of the run) and the deadline:
    the steady state, without the ramp-up and the tail in which a draining queue leaves the batch part empty.

    `rss_mb`: the server's resident memory at the start, once the warm-up quarter has passed (`before`: the
    first requests of each kind grow caches and allocator arenas once) and at the end (`after`); growth from
    `before` to `after` is what a leak would show.

    Every wait is bounded: a request without its final response after `request_timeout` seconds counts as
    incomplete, and a client still waiting `request_timeout` + 15 s after the deadline is left behind (its request
    counted incomplete), so a lost response never hangs the tool.

    `api="openai"`: the same clients through an OpenAI-compatible endpoint (`base_url`, default this spec's own
    endpoint; `model` is then the served model name), streaming over HTTP with pipeline.openai_client; the prompts
    go as chat messages (the server applies the template) and the report is load_openai.json."""

    _check(concurrency, duration, max_tokens)
    pid = running_pid(spec)
    url, generate, decoupled = _endpoint(spec, api, base_url, chat)
    if api == "openai":
        models = ()
    if pid is None and not (api == "openai" and base_url):
        raise RuntimeError(f"no server is running for {spec.name!r}; start it with `make serve SPEC=...`")
    # A request its client abandons asks for far more than it will get, so it is still decoding when abandoned.
    long_budget = max(4 * max_tokens, min(spec.limits.max_seq_len - spec.limits.max_input_len, 1024))
    prompts = _prompts(spec, num_prompts, chat and api != "openai")
    if reference is None:
        log(f"reference answers for {len(prompts)} prompts (greedy, baseline, one at a time) ...")
        reference = [generate(url, model, p, max_tokens, method=None if api == "openai" and base_url else "baseline",
                              unary=not decoupled, timeout=request_timeout)["text"] for p in prompts]
    rss_start = server_rss_mb(pid) if pid else 0.0  # a peer behind --base-url: not measured
    before = server_counters(spec, *ENDED, OUTPUT)
    cancelled_before, ended_before = before[CANCELLED], sum(before[k] for k in ENDED)
    mix = _Mix(methods, temperatures, sample_every, cancel_every, disconnect_every, unary_every, decoupled)
    clients = _Clients(generate, url, model, models, prompts, reference, max_tokens, long_budget, mix, window,
                       time.monotonic() + duration, request_timeout)
    what = "mixed" if temperatures or cancel_every or disconnect_every or unary_every else "streaming"
    log(f"{concurrency} {what} clients for {duration:.0f}s ({', '.join(methods)}; max_tokens {max_tokens}) ...")
    t0, probe, warmed = _run_clients(clients, concurrency, duration, pid)
    wall = time.monotonic() - t0
    _await_server_cancels(spec, clients.tally, cancelled_before, ended_before)
    rss_after = server_rss_mb(pid) if pid else 0.0
    probe.cancel()
    rss_mb = {"start": rss_start, "before": warmed.get("rss", rss_start), "after": rss_after}
    out = _summary(spec, clients, t0, wall, duration, concurrency, before, rss_mb, api)
    _write_report(spec, out, api, write, log)
    return out


def run_curve(spec: specmod.Spec, levels: list[int], duration: float, max_tokens: int = 32,
              methods: tuple[str, ...] = ("baseline",), model: str = "ensemble", log=print,
              request_timeout: float = 120.0) -> dict:
    """tokens/s and latency at each concurrency level (greedy, streaming, resubmitting clients), one reference."""

    for c in levels:
        _check(c, duration, max_tokens)
    url = _loopback_url(spec)
    prompts = _prompts(spec, 8, True)
    reference = [generate(url, model, p, max_tokens, method="baseline", unary=not spec.triton.decoupled,
                          timeout=request_timeout)["text"] for p in prompts]
    points = []
    for c in levels:
        r = run_load(spec, c, duration, max_tokens, methods, model, sample_every=0, log=log, write=False,
                     reference=reference, window=True, request_timeout=request_timeout)
        points.append({k: r[k] for k in ("concurrency", "requests", "errors", "incomplete", "greedy_mismatches",
                                         "tokens_per_s", "latency_ms", "ttft_ms", "rss_mb")})
    falls = [f"{a['concurrency']} -> {b['concurrency']}: {a['tokens_per_s']:.1f} -> {b['tokens_per_s']:.1f}"
             for a, b in zip(points, points[1:]) if b["tokens_per_s"] < 0.95 * a["tokens_per_s"]]
    out = {"spec": spec.name, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "duration_s": duration,
           "max_tokens": max_tokens, "methods": list(methods), "model": model,
           "max_batch_size": spec.limits.max_batch_size, "points": points, "falls": falls}
    spec.report_dir.mkdir(parents=True, exist_ok=True)
    path = spec.report_dir / "load_curve.json"
    path.write_text(json.dumps(out, indent=2))
    log("concurrency  tokens/s  p50 ms  p95 ms  errors")
    for p in points:
        log(f"{p['concurrency']:>11}  {p['tokens_per_s']:8.1f}  {p['latency_ms']['p50']:6.0f}  "
            f"{p['latency_ms']['p95']:6.0f}  {p['errors']:>6}")
    verdict = f"falls by more than 5%: {'; '.join(falls)}" if falls else "never falls by more than 5%"
    log(f"wrote {path}; {verdict}")
    return out


def cmd_load(args) -> int:

    s = specmod.load(args.spec)
    every_model = not args.model  # the soak then sends to every served model
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip()) if args.methods else ()
    if args.api == "openai":
        if args.curve:
            raise ValueError("--curve measures over gRPC; drop --api openai (or run plain load with it)")
        # A peer's endpoint (--base-url) gets no `method` unless --methods names one: it serves its own.
        peer = bool(args.base_url)
        out = run_load(s, args.concurrency or 8, args.duration or 10.0, args.max_tokens,
                       methods or (("",) if peer else ("baseline",)), model=args.model or s.name,
                       num_prompts=args.prompts, request_timeout=args.request_timeout, api="openai",
                       base_url=args.base_url or None,
                       **(dict(temperatures=SOAK["temperatures"], cancel_every=SOAK["cancel_every"],
                               disconnect_every=SOAK["disconnect_every"], unary_every=2) if args.soak else {}))
        return 1 if out["errors"] + out["incomplete"] + out["greedy_mismatches"] else 0
    args.model = args.model or client_model(s)
    if args.curve:
        levels = [int(x) for x in args.curve.split(",") if x.strip()]
        out = run_curve(s, levels, args.duration or 20.0, args.max_tokens, methods or ("baseline",), args.model,
                        request_timeout=args.request_timeout)
        bad = sum(p["errors"] + p["incomplete"] + p["greedy_mismatches"] for p in out["points"])
        return 1 if bad else 0
    if args.soak:
        out = run_load(s, args.concurrency or SOAK["concurrency"], args.duration or SOAK["duration"], args.max_tokens,
                       methods or tuple(served_methods(s)), model=args.model, num_prompts=args.prompts,
                       temperatures=SOAK["temperatures"], cancel_every=SOAK["cancel_every"],
                       disconnect_every=SOAK["disconnect_every"], unary_every=2,
                       request_timeout=args.request_timeout,
                       models=tuple(s.triton.models) if every_model else ())
        whole = out["finished_before_cancel"]
        if whole:
            print(f"note: the server had decoded {whole} of the {out['cancelled']} abandoned requests to their whole "
                  "budget before their clients' cancels reached it (a client slow to see its first piece, a model "
                  "quick to finish; docs/serving.md, \"Soak\"), so they count as served")
        if out["server_cancelled"] + whole < out["cancelled"]:
            early = out["cancelled"] - out["server_cancelled"] - whole
            print(f"note: {early:.0f} of the {out['cancelled']} abandoned requests ended before their budget and "
                  "before the server saw their client go, so they count as served: the server did not honour "
                  "end_id -1 (ignore_eos over HTTP)")
        return 1 if out["errors"] + out["incomplete"] + out["greedy_mismatches"] else 0
    out = run_load(s, args.concurrency or 8, args.duration or 10.0, args.max_tokens, methods or ("baseline",),
                   model=args.model, num_prompts=args.prompts, request_timeout=args.request_timeout)
    bad = out["errors"] + out["incomplete"] + out["greedy_mismatches"]
    return 1 if bad else 0


def register(verb) -> None:
    sp = verb("load", cmd_load, "N concurrent gRPC clients for S seconds; writes reports/<name>/load.json "
                                "(--curve: load_curve.json)")
    sp.add_argument("--concurrency", type=int, default=0, help="clients (default 8; --soak: 32)")
    sp.add_argument("--duration", type=float, default=0.0,
                    help="seconds (default 10; --soak: 120; --curve: 20 a level)")
    sp.add_argument("--max-tokens", type=int, default=32)
    sp.add_argument("--methods", default="", help="comma-separated, e.g. baseline,prompt_lookup "
                                                  "(default baseline; --soak: every method the engines serve)")
    sp.add_argument("--model", default="", help="ensemble (default, when served) or tensorrt_llm_bls "
                                                "(--soak without it: every served model in turn)")
    sp.add_argument("--prompts", type=int, default=8, help="distinct prompts (each gets a greedy reference first)")
    sp.add_argument("--soak", action="store_true", help="mixed methods, temperatures 0/0.7/1.0, stream and unary, "
                                                        "cancels and disconnects (32 clients, 120 s unless given)")
    sp.add_argument("--request-timeout", type=float, default=120.0,
                    help="seconds a client waits for a request's final response before counting it incomplete")
    sp.add_argument("--curve", default="", help="comma-separated concurrency levels, e.g. 1,2,4,8,16,32,64,128")
    sp.add_argument("--api", choices=("grpc", "openai"), default="grpc",
                    help="openai: the same streaming clients through an OpenAI-compatible endpoint (this spec's own, "
                         "or --base-url); writes load_openai.json")
    sp.add_argument("--base-url", default="", help="with --api openai: the endpoint, e.g. http://127.0.0.1:8080/v1 "
                                                   "(llama-server, trtllm-serve); --model names its model")

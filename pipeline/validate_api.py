"""`python -m pipeline validate SPEC --api openai`: exactness and speed through an OpenAI-compatible endpoint.

The same prompts (the spec's validate set, sent as chat messages: the server applies its template) and
the same figures for any server that speaks the OpenAI API: this deployment's own endpoint (every
method it serves, through the `method` extension; its baseline also checked against the gRPC path),
or a peer such as `trtllm-serve` or `llama-server` behind `--base-url` (its own method; acceptance
when it reports it). Writes reports/<name>/validate_openai[_<label>].json and .md. A measuring harness,
not a server: it never starts one.
"""

from __future__ import annotations

import json
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from pipeline import openai_client
from pipeline.client import chat_text, generate
from pipeline.figures import pct
from pipeline.spec import Spec
from pipeline.triton import openai_api
from pipeline.triton.repo import client_model
from pipeline.triton.server import grpc_url, running_pid


def served(base_url: str, model: str) -> tuple[list[str | None], str | None]:
    """(methods to measure, default) from GET /v1/models: ours lists its methods; a peer's are [None]."""
    req = urllib.request.Request(base_url.rstrip("/") + "/models",
                                 headers={"Authorization": f"Bearer {openai_client.api_key()}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        cards = json.loads(r.read()).get("data") or []
    card = next((c for c in cards if c.get("id") == model), None)
    if card is None:
        raise ValueError(f"--model: {model!r} is not served at {base_url} (it lists "
                         f"{', '.join(str(c.get('id')) for c in cards) or 'nothing'})")
    methods = [m for m in card.get("methods") or [] if m != "medusa_typical"]
    return (methods or [None]), card.get("default_method")


def run_validate_api(spec: Spec, base_url: str | None = None, model: str | None = None, label: str = "",
                     log=print) -> dict:
    from pipeline.sources import spec_prompts  # lazy: loads torch (~1.5 s); the CLI imports this module at start

    own = not base_url
    url = base_url or openai_api.base_url(spec)
    model = model or spec.name
    if own and openai_api.health(url) != 200:
        raise RuntimeError(f"no OpenAI endpoint answers at {url}; start the deployment with `make serve SPEC=...` "
                           "(or give a peer's --base-url)")
    v = spec.validate
    methods, default = served(url, model)
    prompts = spec_prompts(spec, v.max_prompts + 1 if v.max_prompts else 0)
    warm, prompts = prompts[0], prompts[1:]
    new = v.max_new_tokens
    name = lambda m: m or "server default"  # noqa: E731
    log(f"validate {model} through {url}: methods {[name(m) for m in methods]}, {len(prompts)} prompts x {new} tokens")

    def ask(prompt: str, method: str | None, n: int = new) -> dict:
        return openai_client.generate(url, model, prompt, n, method=method, stream=True, timeout=600)

    for m in methods:
        ask(warm, m, 8)
    runs: dict[str, list[dict]] = {name(m): [] for m in methods}
    for i, p in enumerate(prompts):
        for m in methods:
            runs[name(m)].append(ask(p, m))
        log(f"  prompt {i + 1}/{len(prompts)}: " + ", ".join(
            f"{k} {r[-1].get('tokens_per_s', 0):.1f}" for k, r in runs.items()) + " tokens/s")
    base_key = "baseline" if "baseline" in runs else name(methods[0])
    report: dict = {"spec": spec.name, "api": "openai", "base_url": url, "model": model, "own_endpoint": own,
                    "default_method": default, "prompts": len(prompts), "new_tokens": new, "methods": {},
                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    base = runs[base_key]
    for k, rs in runs.items():
        toks = sum(r.get("num_output_tokens", 0) for r in rs)
        secs = sum(r["latency_s"] for r in rs)
        drafted = sum(r.get("total_draft_tokens") or 0 for r in rs)
        accepted = sum(r.get("total_accepted_draft_tokens") or 0 for r in rs)
        tps = toks / secs if secs else 0.0
        report["methods"][k] = {
            "tokens_per_s": tps, "greedy_identical": sum(r["text"] == b["text"] for r, b in zip(rs, base)),
            "greedy_total": len(rs), "acceptance_rate": accepted / drafted if drafted else None,
            "accepted_draft_tokens": accepted, "draft_tokens": drafted,
            "latency_ms": {"p50": pct([r["latency_s"] * 1000 for r in rs], 0.5),
                           "p95": pct([r["latency_s"] * 1000 for r in rs], 0.95)},
            "ttft_ms": {"p50": pct([r["ttft_s"] * 1000 for r in rs], 0.5)},
            "complete": sum(bool(r["complete"]) for r in rs)}
    b = report["methods"][base_key]["tokens_per_s"]
    for e in report["methods"].values():
        e["speedup"] = e["tokens_per_s"] / b if b else None
    again = ask(prompts[0], methods[0])
    report["repeat_identical"] = again["text"] == runs[name(methods[0])][0]["text"]
    if own:
        report["grpc_identical"] = grpc_identical(spec, prompts, base, new)
    # Concurrency: bursts of c streamed requests with the server's default method, every answer checked greedy.
    curve = []
    for c in v.concurrency:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(c) as ex:
            rs = list(ex.map(lambda i: ask(prompts[i % len(prompts)], None), range(c)))
        wall = time.perf_counter() - t0
        want = runs[name(default) if default in methods else name(methods[0])]
        curve.append({"concurrency": c, "tokens_per_s": sum(r.get("num_output_tokens", 0) for r in rs) / wall,
                      "latency_ms_p50": pct([r["latency_s"] * 1000 for r in rs], 0.5),
                      "greedy_mismatches": sum(r["text"] != want[i % len(prompts)]["text"] for i, r in enumerate(rs))})
        log(f"  concurrency {c}: {curve[-1]['tokens_per_s']:.1f} tokens/s, p50 {curve[-1]['latency_ms_p50']:.0f} ms")
    report["batch_curve"] = curve
    out = spec.report_dir / f"validate_openai{'_' + label if label else ''}"
    spec.report_dir.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    out.with_suffix(".md").write_text(markdown(report))
    log(f"wrote {out.with_suffix('.json')}")
    return report


def grpc_identical(spec: Spec, prompts: list[str], base: list[dict], new: int) -> dict | None:
    """Our endpoint's greedy baseline against the gRPC path's (client-side template), prompt by prompt."""
    from pipeline.runtime.engine_io import load_tokenizer  # lazy: loads torch (~1.5 s), as above

    if running_pid(spec) is None:
        return None
    tok = load_tokenizer(spec.engine_dir / "target")
    same = [generate(grpc_url(spec), client_model(spec), chat_text(tok, p), new, method="baseline")["text"] == r["text"]
            for p, r in zip(prompts, base)]
    return {"identical": sum(same), "total": len(same)}


def markdown(r: dict) -> str:
    lines = [f"# Validation through the OpenAI API: {r['model']} at {r['base_url']} ({r['prompts']} prompts x "
             f"{r['new_tokens']} tokens, {r['date']})", "",
             "| method | tokens/s | speedup | acceptance | greedy identical | p50 ms | p95 ms | TTFT p50 ms |",
             "|---|---|---|---|---|---|---|---|"]
    for m, e in r["methods"].items():
        acc = f"{e['acceptance_rate']:.2f}" if e["acceptance_rate"] is not None else "n/a"
        sp = f"{e['speedup']:.2f}x" if e["speedup"] else ""
        lines.append(f"| {m} | {e['tokens_per_s']:.1f} | {sp} | {acc} | {e['greedy_identical']}/{e['greedy_total']} | "
                     f"{e['latency_ms']['p50']:.0f} | {e['latency_ms']['p95']:.0f} | {e['ttft_ms']['p50']:.0f} |")
    lines += ["", f"Same greedy answer when asked again: {r['repeat_identical']}."]
    g = r.get("grpc_identical")
    if g:
        lines.append(f"Baseline through OpenAI equals the gRPC path on {g['identical']}/{g['total']} prompts.")
    lines += ["", "| concurrency | tokens/s | p50 ms | greedy mismatches |", "|---|---|---|---|"]
    for c in r["batch_curve"]:
        lines.append(f"| {c['concurrency']} | {c['tokens_per_s']:.1f} | {c['latency_ms_p50']:.0f} | "
                     f"{c['greedy_mismatches']} |")
    med = statistics.median([e["tokens_per_s"] for e in r["methods"].values()]) if r["methods"] else 0
    lines += ["", f"Median tokens/s over methods: {med:.1f}. Timings on a shared machine are noisy.", ""]
    return "\n".join(lines)

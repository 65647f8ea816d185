"""Validation through gRPC: exactness, acceptance, speed, the concurrency curve, peers, advice.

`python -m pipeline validate SPEC` starts the server if it is not up (and stops it again if it
started it), drives it over gRPC with the project's prompt set (chat template applied client-side),
and writes reports/<name>/validate.json, validate.md and PNG plots. Every figure in the report is
computed from measurements taken in this run.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import client, curve_targets, peer_curve, peers
from pipeline import spec as specmod
from pipeline.client import chat_text
from pipeline.common import chat_ids
from pipeline.figures import Run, curve_point, mean_accepted_len, pct, steal_ms, steal_since, summarize
from pipeline.sidebyside import System
from pipeline.sidebyside import write_report as write_section
from pipeline.spec import Spec, ValidateSpec
from pipeline.triton import openai_api, repo, server
from pipeline.validate_api import run_validate_api, served

SPEC_METHODS = ("draft_target", "prompt_lookup", "medusa")
PEER_TOKENS = 32  # transformers' tokens per prompt in validate (bench runs the full length)





def _request(url: str, text: str, max_tokens: int, method: str, temperature: float = 0.0, seed: int | None = None,
             stream: bool = True, **kw) -> dict:

    # disable_at_batch=0: validation measures each method itself, whatever the server's switch-off setting.
    # cache_prompt=False: each method on each prompt as on a fresh one: no prompt-cache K/V and no suffix-store
    # drafts left by the methods measured before it on the same prompt (the long-context and edit sections measure
    # the caches on purpose, through the OpenAI endpoint).
    kw.setdefault("cache_prompt", False)
    return client.generate(url, "tensorrt_llm_bls", text, max_tokens, method=method, stream=stream,
                           temperature=temperature, seed=seed, return_perf_metrics=True, disable_at_batch=0, **kw)



def divergence(bundle, prompt_ids: list[int], base: list[int], other: list[int], near_tie: float) -> dict | None:
    """Where two greedy outputs first differ, and the target's top-2 logit margin there."""
    n = next((i for i, (a, b) in enumerate(zip(base, other)) if a != b), None)
    if n is None:
        if len(base) == len(other):
            return None
        n = min(len(base), len(other))
    import torch  # lazy: torch (~1.5 s); the CLI imports this module at start

    from pipeline.runtime.generate import prefill  # lazy: torch, as above

    ctx = prompt_ids + base[:n]
    m = bundle.target
    cache = m.new_cache(1, (len(ctx) + 64) // 64 * 64)
    with torch.inference_mode():
        logits = m.logits(prefill(m, cache, [ctx]))[0]
    top = torch.topk(logits, 2)
    margin = float(top.values[0] - top.values[1])
    return {"position": n, "baseline_token": base[n] if n < len(base) else None,
            "method_token": other[n] if n < len(other) else None, "top2_margin": margin,
            "classification": "numeric near-tie" if margin <= near_tie else "real disagreement"}


def tokens_of(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def run_validate(spec: Spec, log=print, quick: bool = False) -> dict:
    """Start the server unless it is up, measure every method through it, and stop it again if it was started here
    (a server that was already running is left running)."""

    if "tensorrt_llm_bls" not in spec.triton.models:
        raise ValueError(f"triton.models: {spec.triton.models}; validate measures tensorrt_llm_bls, serve it too "
                         "(add it to triton.models)")
    started = None
    if server.running_pid(spec) is None or not server.is_ready(spec):
        log("starting the Triton server ...")
        started = server.start(spec, log=log)
    url = server.grpc_url(spec)
    try:
        return _validate_served(spec, url, log)
    finally:
        if started is not None:
            started.stop()


def _validate_served(spec: Spec, url: str, log) -> dict:
    """Every section of validate.json, measured through the server at `url`, in the order the report lists them;
    writes the report."""
    # lazy: torch and the runtime (~1.5 s); the CLI imports this module at start
    from pipeline.bench import environment
    from pipeline.runtime.decode import apply_spec, decode, load_bundle
    from pipeline.runtime.generate import Request
    from pipeline.sources import spec_prompts

    v = spec.validate
    bundle = apply_spec(load_bundle(spec.engine_dir, spec.device), spec)
    tok = bundle.tokenizer
    methods = bundle.methods()
    prompts = spec_prompts(spec, v.max_prompts + 1 if v.max_prompts else 0)
    warm, prompts = prompts[0], prompts[1:]
    texts = [chat_text(tok, p) for p in prompts]
    new = v.max_new_tokens
    log(f"validate {spec.name}: methods {methods}, {len(prompts)} prompts x {new} tokens over gRPC at {url}")
    phases: dict[str, float] = {}
    lap = _lap_clock(phases)
    spent = Budget(v.budget_s, main_job_deadline())
    for m in methods:
        _request(url, chat_text(tok, warm), 8, m)
    report: dict = {"spec": spec.name, "grpc_url": url, "new_tokens": new, "prompts": len(prompts),
                    "trimmed": trimmed(spec),
                    "acceptance_definition": "acceptance_rate = accepted draft tokens / proposed draft tokens; "
                    "mean_accepted_len = tokens emitted per target forward pass",
                    "methods": {}, "peers": {}}
    # 1-3. Exactness, acceptance and latency at concurrency 1, interleaved by prompt; llama.cpp's server decoding
    # plainly on the target's GGUF between them (where it is built), so both see the same minutes of this machine.
    with peers.PlainPeer(spec, new, log, warm=warm) as llama:
        runs, texts, prompts = _exactness_pass(url, texts, prompts, methods, new, v.prompt_budget_s, report, log,
                                               llama)
    lap("exactness")
    _method_sections(report, runs, bundle, texts, v.near_tie_margin)
    report["draft"] = _draft_section(spec, bundle, runs["baseline"])
    report["acceptance_per_position"] = acceptance_per_position(bundle, prompts[:4], new, decode, Request)
    report["draft_length"] = spec.speculation.draft_length
    report["plain_from"] = plain_from_rows(bundle, methods, spec.limits.max_batch_size)
    report["suspicious"] = suspicious(report)
    lap("acceptance_per_position")
    # 4. Peers in the same run: transformers generate and assisted generation, same prompts.
    report["peers"].update(_transformers_peers(spec, bundle, texts, new))
    lap("transformers")
    # llama.cpp's own server on the target's GGUF (plain and with the draft's GGUF), on every prompt ours ran.
    report["peers"].update(peers.safe_llama_server_peer(spec, prompts, new, log, warm=warm, plain=llama))
    report["over_llama_plain_by_prompt"] = over_peer_by_prompt(report)
    lap("llama_cpp_server")
    # Past here a section starts only where it would end within validate.budget_s and the main job's deadline,
    # each expected at SECTION_SHARE of the exactness pass's seconds on this machine; the report names what it left.
    exact_s = phases["exactness"]
    # 3b. Concurrency curve.
    report["curve_tokens"] = curve_new = curve_tokens(v)
    default = repo.default_method(spec)
    report["disable_at_batch"] = spec.speculation.disable_at_batch
    if "draft_target" in report["methods"]:
        report["methods"]["draft_target"]["lookup_min_ngram"] = spec.speculation.draft_lookup_min_ngram
    why = spent(SECTION_SHARE["curve"] * exact_s)
    if why:
        report.update(batch_curve=[], crossover={}, vs_llama_server_at_concurrency={}, temperatures=[],
                      curve_left_out=why)
        _trim(report, log, "the concurrency curve and the temperatures", why)
    else:
        report["batch_curve"] = batch_curve(url, texts, methods, v.concurrency, curve_new, log, default)
        report["crossover"] = crossover(report["batch_curve"], methods)
        # llama-server -np N at each level, the same GGUF, beside ours (pipeline/peer_curve.py).
        report["batch_curve"] += peer_curve.peer_curve(spec, texts, v.concurrency, curve_new, log)
        report["vs_llama_server_at_concurrency"] = {
            m: peer_curve.ratios_at_concurrency(report["batch_curve"], m) for m in methods}
        if default in methods and "baseline" in methods:
            report["curve_targets"] = curve_targets.summarize(
                report["batch_curve"], default, report["vs_llama_server_at_concurrency"].get(default),
                curve_targets.ceilings(spec.engine_dir / "draft" / "config.json", default, v.concurrency))
        # 3c. Temperatures: exact methods vs Medusa typical (lossy).
        report["temperatures"] = temperatures(url, texts[:3], methods, v.temperatures, min(new, 64))
    lap("batch_curve_and_temperatures")
    # 1b. Distribution test through the server with seeds (sampled exact methods vs baseline).
    why = spent(SECTION_SHARE["distribution"] * exact_s)
    if why:
        report.update(distribution={}, distribution_left_out=why)
        _trim(report, log, "the distribution test", why)
    else:
        report["distribution"] = distribution_test(url, chat_text(tok, warm), methods, v.distribution_samples, tok,
                                                   log)
        if default in methods and default != "baseline":  # the default method at a second temperature (issue 49)
            why = spent(SECTION_SHARE["distribution_low"] * exact_s)
            if why:
                _trim(report, log, f"the default method's distribution test at T={DIST_LOW_T}", why)
            else:
                low = distribution_test(url, chat_text(tok, warm), ["baseline", default], v.distribution_samples,
                                        tok, log, DIST_LOW_T)
                report["distribution"][f"{default} at T={DIST_LOW_T}"] = low[default]
    lap("distribution")
    # 5. Side by side with llama-server through the OpenAI endpoint: long contexts (issue 48), edits (issue 49).
    side_by_side(spec, tok, report, log, lap, spent, exact_s)
    report["advice"] = advice(report, methods)
    report["environment"] = environment(spec)
    report["phase_seconds"] = phases
    write_report(spec, report)
    log(f"wrote {spec.report_dir / 'validate.json'}; validate's sections took " + ", ".join(
        f"{k} {v:.0f} s" for k, v in phases.items()))
    return report


def side_by_side(spec: Spec, tok, report: dict, log, lap, spent: Callable[..., str] = lambda need_s=0.0: "",
                 exact_s: float = 0.0) -> None:
    """report's `context` and `edit` (reports/<name>/context.json, edit.json): through our OpenAI endpoint (started
    here unless it runs, and stopped again) against llama-server. A section that fails is a note naming why; one that
    `spent` (a Budget) would not let start, expected at SECTION_SHARE of the exactness pass's `exact_s`, is left out
    and named in the report's `trimmed`."""
    from pipeline import context_run, edit_run  # lazy: as the other sections' imports

    v = spec.validate
    if not v.context_sizes and not v.edit_set:
        return
    if not spec.openai.enabled:
        report["context"] = report["edit"] = {"error": "openai.enabled is false: these sections need the endpoint"}
        return
    need = {"context": SECTION_SHARE["context"] * exact_s, "edit": SECTION_SHARE["edit_case"] * exact_s}
    on = [k for k, x in (("context", v.context_sizes), ("edit", v.edit_set)) if x]
    why = spent(min(need[k] for k in on))  # not even the shorter one: the endpoint is not started at all
    if why:
        _left_out(report, why, *on)
        return
    url, started = openai_api.base_url(spec), False
    try:
        if openai_api.health(url) != 200:
            openai_api.start(spec, log=log)
            started = True
        methods, default = served(url, spec.name)
        for key, run in (("context", lambda: context_run.run_context(spec, System("ours", url, spec.name), tok, log)),
                         ("edit", lambda: edit_run.run_edit(spec, url, spec.name, methods, default, log,
                                                            spent=lambda: spent(need["edit"])))):
            if not (v.context_sizes if key == "context" else v.edit_set):
                continue
            why = spent(need[key])
            if why:
                _left_out(report, why, key)
                continue
            try:
                out = run()
            except (OSError, RuntimeError, ValueError, TimeoutError) as e:
                log(f"  {key} section failed: {type(e).__name__}: {str(e)[:500]}")
                report[key] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
                continue
            write_section(spec, key, out)
            report[key] = {k: x for k, x in out.items() if k != "runs"}
            lap(key)
    except (OSError, RuntimeError, ValueError, TimeoutError) as e:
        log(f"  side-by-side sections failed: {type(e).__name__}: {str(e)[:500]}")
        report.setdefault("context", {"error": f"{type(e).__name__}: {str(e)[:500]}"})
    finally:
        if started:
            openai_api.stop(spec)


DEADLINE_ENV = "PIPELINE_MAIN_JOB_DEADLINE"  # Unix seconds: `make all` sets its own start + MAIN_JOB_S (Makefile)
END_RESERVE_S = 30.0  # after the last section: the reports written, the server stopped, make's exit
# What a section takes against the same run's exactness pass (E, its phase seconds), so a section is started only
# where it ends before the main job's deadline on this machine. The flagship's main jobs (experiments/serving_log.md)
# took: curve and temperatures 1.02 E (2-core Xeon, 2026-12-06), 1.09-1.19 E (Zen 4), 1.11-1.23 E (Zen 3 without
# AVX-512); the distribution test with the prompt cache 0.47 E (Zen 4) and 0.28 E (Zen 3); context 0.78 E (Xeon) and
# 1.17-1.28 E (Zen 4); an edit case 0.38-0.45 E (Zen 4). Each share is the largest seen, with room.
SECTION_SHARE = {"curve": 1.25, "distribution": 0.5, "distribution_low": 0.3, "context": 1.35, "edit_case": 0.5}


def main_job_deadline() -> float | None:
    """The main job's deadline (Unix seconds) where `make all` set one in DEADLINE_ENV, else None."""
    raw = os.environ.get(DEADLINE_ENV, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{DEADLINE_ENV}={raw!r} is not a time in Unix seconds; unset it, or set it as the "
                         "Makefile does (`date +%s` plus the main job's seconds)") from None


@dataclass
class Budget:
    """When validate's sections stop starting: `budget_s` seconds after validate began (validate.budget_s; 0: no
    limit), and a section that would end past `deadline` (the main job's, Unix seconds; None: none) less
    END_RESERVE_S. Called with a section's expected seconds, it says why that section cannot start ('' if it can)."""

    budget_s: float
    deadline: float | None = None
    t0: float = field(default_factory=time.perf_counter)

    def __call__(self, need_s: float = 0.0) -> str:
        if self.budget_s > 0 and time.perf_counter() - self.t0 >= self.budget_s:
            return f"validate.budget_s ({self.budget_s:g} s) was spent"
        if self.deadline is not None:
            left = self.deadline - END_RESERVE_S - time.time()
            if need_s > left:
                return (f"it would end past the main job's deadline (about {need_s:.0f} s needed, {max(left, 0):.0f} s "
                        f"left by {DEADLINE_ENV} from `make all`)")
        return ""


def _trim(report: dict, log, what: str, why: str) -> None:
    """A section of validate's own not started (`why`, a Budget's answer): named in `trimmed` and the log."""
    report["trimmed"].append(f"{what} left out: {why}")
    log(f"  {what} left out: {why}")


def _left_out(report: dict, why: str, *keys: str) -> None:
    """Sections not started because the budget was spent (`why`, a Budget's answer): a note in each, named in
    `trimmed`."""
    for key in keys:
        report[key] = {"error": f"left out: {why}; `python -m pipeline validate SPEC --only side-by-side` "
                                "measures it alone"}
    report.setdefault("trimmed", []).append(f"the {' and '.join(keys)} section{'s' if len(keys) > 1 else ''} left "
                                            f"out: {why}")


def run_side_by_side(spec: Spec, log=print) -> dict:
    """`validate --only side-by-side`: the context and edit sections alone (minutes, not validate's quarter hour),
    the server started and stopped as run_validate does; returns what validate.json would hold of them."""
    from pipeline.runtime.engine_io import load_tokenizer  # lazy: loads torch (~1.5 s)

    started = None
    if server.running_pid(spec) is None or not server.is_ready(spec):
        log("starting the Triton server ...")
        started = server.start(spec, log=log)
    try:
        report: dict = {}
        phases: dict[str, float] = {}
        side_by_side(spec, load_tokenizer(spec.engine_dir / "target"), report, log, _lap_clock(phases))
        log("\n".join(side_by_side_markdown(report)))
        log("sections took " + ", ".join(f"{k} {v:.0f} s" for k, v in phases.items()))
        return report
    finally:
        if started is not None:
            started.stop()


def _lap_clock(phases: dict[str, float]):
    """lap(name): the seconds since the previous lap (or the clock's start) recorded as phases[name], so the report
    says where a make all's validate minutes went (the 30-minute budget of the main job)."""
    last = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        phases[name] = round(now - last[0], 1)
        last[0] = now

    return lap


def memory_probe() -> float | None:
    """This machine's memory read speed now, GB/s (bench's probe: 256 MB read three times, about 0.1 s); None where
    the 256 MB cannot be had (the figures then go unsplit, the run goes on)."""
    from pipeline.bench import measure_bandwidth_gbs  # lazy: torch and the kernels

    try:
        return round(measure_bandwidth_gbs(256, reps=3), 1)
    except (MemoryError, RuntimeError, OSError):
        return None


def _exactness_pass(url: str, texts: list[str], prompts: list[str], methods: list[str], new: int, budget_s: float,
                    report: dict, log, peer: peers.PlainPeer | None = None,
                    probe: Callable[[], float | None] = memory_probe
                    ) -> tuple[dict[str, list[dict]], list[str], list[str]]:
    """Every method on prompt i before prompt i + 1 (concurrency 1), then `peer` (llama-server, plain) on it, until
    the prompts or the budget run out: (responses per method, the texts and prompts that ran). A spent budget is
    recorded in the report. The methods run in the spec's order on even prompts and the reverse on odd ones
    (report["method_order"]): in one fixed order the last method always followed the same one, and a run's
    hybrid over draft_target read 0.96x where the two alternated on the same server read 1.01x (2026-12-05).
    `probe()` reads the memory's speed before and after each prompt's requests (report["memory_gbs_by_prompt"]):
    it moves by tens of percent within minutes here, and plain decoding (llama-server's) reads at that speed where
    a verification of several tokens is partly bound by the integer units, so the figures over the peer move with
    it (over_peer_by_prompt splits them by it)."""
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    t0 = time.perf_counter()
    for i, text in enumerate(texts):
        if over_budget(i, time.perf_counter() - t0, budget_s):
            report["trimmed"].append(f"{i} of {len(texts)} prompts ran: the exactness pass had spent "
                                     f"validate.prompt_budget_s ({budget_s:g} s)")
            log(f"  validate.prompt_budget_s ({budget_s:g} s) spent: {i} of {len(texts)} prompts")
            texts, prompts = texts[:i], prompts[:i]
            report["prompts"] = i
            break
        order = methods if i % 2 == 0 else methods[::-1]
        report.setdefault("method_order", []).append(list(order))
        before = probe()
        for m in order:
            runs[m].append(_request(url, text, new, m))
        theirs = peer.ask(prompts[i]) if peer is not None else None
        pair = [before, probe()]
        report.setdefault("memory_gbs_by_prompt", []).append(pair)
        mem = " / ".join(f"{g:g}" if g else "?" for g in pair)
        log(f"  prompt {i + 1}/{len(texts)} (memory {mem} GB/s): " + ", ".join(
            f"{m} {runs[m][-1]['tokens_per_s']:.1f}" for m in methods)
            + (f", llama-server plain {theirs['tokens_per_s']:.1f}" if theirs else "") + " tokens/s")
    if texts:
        report["first_prompt"] = first_prompt_again(url, texts[0], new, runs, log)
    return runs, texts, prompts


def first_prompt_again(url: str, text: str, new: int, runs: dict[str, list[dict]], log) -> dict:
    """The pass's first prompt once more per method, after every prompt: its first run over this one is what the
    first requests after ready still cost. Set against the median of the other prompts instead, a prompt whose
    drafts the target accepts less often looks cold: the flagship's first prompt has the lowest acceptance of its 8
    (0.72 against 0.73-0.87, in process, 2026-12-03)."""
    out = {}
    for m, rs in runs.items():
        again = _request(url, text, new, m)["tokens_per_s"]
        first = rs[0]["tokens_per_s"]
        out[m] = {"first_tokens_per_s": first, "again_tokens_per_s": again, "again_over_first": again / first,
                  "median_over_first": statistics.median(r["tokens_per_s"] for r in rs) / first}
    log("  first prompt again: " + ", ".join(f"{m} {e['again_tokens_per_s']:.1f} (first {e['first_tokens_per_s']:.1f}:"
                                            f" {e['again_over_first']:.2f}x)" for m, e in out.items()) + " tokens/s")
    return out


def _method_sections(report: dict, runs: dict[str, list[dict]], bundle, texts: list[str], near_tie: float) -> None:
    """report's `methods`: each against the baseline, with where its greedy answers diverge and why (near-tie or
    real disagreement, from the target's logits there), and its latency."""
    tok = bundle.tokenizer
    base = runs["baseline"]
    base_runs = _runs(base)
    for m, rs in runs.items():
        divs = []
        for i, (r, b) in enumerate(zip(rs, base)):
            if r["text"] != b["text"]:
                pid = tokens_of(tok, texts[i])
                d = divergence(bundle, pid, tokens_of(tok, b["text"]), tokens_of(tok, r["text"]), near_tie)
                divs.append({"prompt": i, **(d or {"classification": "detokenization only"})})
        lat = [r["latency_s"] * 1000 for r in rs]
        report["methods"][m] = {
            **summarize(_runs(rs), base_runs),
            "divergences": divs,
            "latency_ms": {"p50": pct(lat, 0.5), "p95": pct(lat, 0.95)},
            "ttft_ms": {"p50": pct([r["ttft_s"] * 1000 for r in rs], 0.5)},
        }


def _draft_section(spec: Spec, bundle, base: list[dict]) -> dict:
    """report's `draft`: how the draft was built and, with a reduced vocabulary, how much of the target's greedy
    output (held out: the evaluation prompts) the draft head can propose."""
    draft = draft_summary(spec)
    kept = getattr(bundle.draft, "vocab_ids", None)
    if kept is not None and draft:
        tok = bundle.tokenizer
        kept_set, toks = set(kept.tolist()), [t for r in base for t in tokens_of(tok, r["text"])]
        draft["vocab_coverage"] = sum(t in kept_set for t in toks) / max(1, len(toks))
    return draft


def _transformers_peers(spec: Spec, bundle, texts: list[str], new: int) -> dict:
    """transformers generate and assisted generation on our weights and the same prompts, in the engine's own dtype
    (the pair: bf16 both), so the comparison is like for like."""
    import torch  # lazy: torch (~1.5 s); the CLI imports this module at start

    from pipeline.bench import _hf_generate, hf_model  # lazy: torch and transformers, only when validate runs

    peer_dtype = torch.float32 if spec.dtype == "float32" else torch.bfloat16
    hf = hf_model(bundle.target, peer_dtype)
    tok = bundle.tokenizer
    # A quarter of the prompts (at least 2) and PEER_TOKENS of each: transformers' bf16 decode is 4-7x slower than
    # ours; both peers on 2 prompts x 128 tokens still took 4.7 of a 30-min make all (Zen 3, slow memory). bench runs
    # them on every prompt at full length.
    n, new = peer_budget(len(texts), new)
    ids = [tokens_of(tok, t) for t in texts[:n]]
    out: dict = {"hf_generate": {"tokens_per_s": statistics.median(
        [new / _hf_generate(hf, [i], new)[0] for i in ids]), "prompts": len(ids), "new_tokens": new,
        "dtype": str(peer_dtype).removeprefix("torch.")}}
    draft_dir = spec.engine_dir / "draft_hf"
    if draft_dir.is_dir():
        from transformers import AutoModelForCausalLM  # heavy: only when there is a draft to assist with

        d = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=peer_dtype).eval()
        k = bundle.spec.k_for("draft_target")
        out["hf_assisted"] = {"tokens_per_s": statistics.median(
            [new / _hf_generate(hf, [i], new, assistant=d, k=k)[0] for i in ids]), "prompts": len(ids),
            "new_tokens": new, "num_assistant_tokens": k, "dtype": str(peer_dtype).removeprefix("torch.")}
        del d
    else:
        out["hf_assisted"] = {"tokens_per_s": None, "note": "no draft built"}
    return out


def peer_budget(prompts: int, new: int) -> tuple[int, int]:
    """(prompts, new tokens) validate runs transformers on: the quarter of the prompts (at least 2) llama-server's
    n-max is picked on, and at most PEER_TOKENS tokens of each."""
    return peers.probe_prompts(prompts), min(new, PEER_TOKENS)


def draft_summary(spec: Spec) -> dict:
    """The draft engine as built: source, head size, dtype, quantization, the k chosen and its cost per step
    as a fraction of a target step (measured at build time by `num_draft_tokens: auto`)."""

    p = spec.engine_dir / "draft" / "config.json"
    if not p.is_file():
        return {}
    cfg = json.loads(p.read_text())
    sp, d = cfg.get("speculation", {}), cfg.get("draft", {})
    return {"source": cfg.get("source"), "layers": cfg["pretrained_config"]["num_hidden_layers"],
            "vocab": d.get("vocab") or cfg["pretrained_config"]["vocab_size"],
            "vocab_coverage_tune": (d.get("training") or {}).get("vocab_coverage"),
            "dtype": cfg["pretrained_config"]["dtype"],
            "quantization": (cfg["pretrained_config"].get("quantization") or {}).get("quant_algo"),
            "num_draft_tokens": sp.get("num_draft_tokens"), "chosen_by": sp.get("chosen_by"),
            "step_fraction_of_target": sp.get("draft_step_fraction")}


MIN_BUDGET_PROMPTS = 4


def over_budget(done: int, elapsed_s: float, budget_s: float) -> bool:
    """True when no further prompt should start: the budget is set and spent, and MIN_BUDGET_PROMPTS have run."""
    return budget_s > 0 and done >= MIN_BUDGET_PROMPTS and elapsed_s >= budget_s


def curve_tokens(v: ValidateSpec) -> int:
    """New tokens per request of the concurrency curve: `validate.curve_tokens`, else the run's max_new_tokens."""
    return min(v.curve_tokens or v.max_new_tokens, v.max_new_tokens)


def trimmed(spec: Spec) -> list[str]:
    """What this run leaves out against the full validation (the defaults and the whole prompt file)."""
    from pipeline.sources import read_prompts  # lazy: loads torch (~1.5 s); the CLI imports this module at start

    v, full = spec.validate, ValidateSpec()
    out = []
    total = len(read_prompts(spec.path(v.prompts)))
    if v.max_prompts and v.max_prompts < total - 1:
        out.append(f"{v.max_prompts} of {total - 1} prompts (validate.max_prompts)")
    for key, what in (("max_new_tokens", "new tokens per request"), ("distribution_samples", "distribution samples")):
        if getattr(v, key) < getattr(full, key):
            out.append(f"{getattr(v, key)} {what} (full run: {getattr(full, key)}; validate.{key})")
    if max(v.concurrency) < max(full.concurrency):
        out.append(f"concurrency curve to {max(v.concurrency)} (full run: to {max(full.concurrency)}; "
                   "validate.concurrency)")
    if curve_tokens(v) < v.max_new_tokens:
        out.append(f"concurrency-curve requests of {curve_tokens(v)} new tokens (full run: {v.max_new_tokens}; "
                   "validate.curve_tokens)")
    if len(v.temperatures) < len(full.temperatures):
        out.append(f"temperatures {v.temperatures} (full run: {full.temperatures}; validate.temperatures)")
    if v.context_sizes and max(v.context_sizes) < max(full.context_sizes):
        out.append(f"cold prompts of {v.context_sizes} tokens (full run: {full.context_sizes}; "
                   "validate.context_sizes)")
    if v.context_sizes and (v.context_turns, v.context_trace_tokens) < (full.context_turns, full.context_trace_tokens):
        out.append(f"a {v.context_turns}-turn agent trace to {v.context_trace_tokens} tokens (full run: "
                   f"{full.context_turns} turns to {full.context_trace_tokens}; validate.context_turns, "
                   "context_trace_tokens)")
    if v.context_sizes and v.context_turns and not v.context_trace_identity:
        out.append("the agent trace's last turn not sent again with the prompt cache off (full run: it is; "
                   "validate.context_trace_identity)")
    if v.edit_set and v.max_edit_cases:
        out.append(f"the first {v.max_edit_cases} edit cases (full run: all of {v.edit_set}; validate.max_edit_cases)")
    if v.edit_set and v.edit_new_tokens:
        out.append(f"edit answers cut at {v.edit_new_tokens} new tokens (full run: the whole file; "
                   "validate.edit_new_tokens)")
    return out


def _runs(rs: list[dict]) -> list[Run]:
    """Server responses as figure inputs: the forwards a request took are its output tokens minus its accepted
    drafts (every forward emits its accepted drafts plus one token of its own)."""
    out = []
    for r in rs:
        n, acc = r.get("num_output_tokens", 0), r.get("total_accepted_draft_tokens", 0)
        out.append(Run(r["tokens_per_s"], r["text"], n, n - acc, r.get("total_draft_tokens", 0), acc))
    return out


def _mean_accepted(rs: list[dict]) -> float:
    """Tokens per target forward over server responses."""
    runs = _runs(rs)
    return mean_accepted_len(sum(r.num_output_tokens for r in runs), sum(r.forwards for r in runs))


def acceptance_per_position(bundle, prompts: list[str], new: int, decode, Request) -> dict:
    """Per-draft-position acceptance, measured in-process on the same engines (the gRPC contract has no field)."""

    out = {}
    for m in bundle.methods():
        if m == "baseline":
            continue
        acc, prop = [], []
        for p in prompts:
            (r,) = decode(bundle, m, [Request(chat_ids(bundle.tokenizer, p), new, end_ids=bundle.end_ids)])
            for i, (a, q) in enumerate(zip(r.accepted_per_position, r.proposed_per_position)):
                if i >= len(acc):
                    acc.append(0)
                    prop.append(0)
                acc[i] += a
                prop[i] += q
        out[m] = [a / q if q else 0.0 for a, q in zip(acc, prop)]
    return out


def suspicious(report: dict) -> list[str]:
    """Flag acceptance figures pinned at 0, at one token, or at the maximum. A method the load policy keeps plain
    from one row (`report["plain_from"]`, named in its own line) proposes nothing by design: not flagged."""
    flags = []
    for m, e in report["methods"].items():
        if m == "baseline":
            continue
        if e["total_draft_tokens"] == 0:
            if (report.get("plain_from") or {}).get(m) != 1:
                flags.append(f"{m}: no draft tokens were proposed")
            continue
        if e["acceptance_rate"] == 0.0:
            flags.append(f"{m}: acceptance exactly 0 (drafter broken or mismatched tokenizer?)")
        if e["acceptance_rate"] == 1.0:
            flags.append(f"{m}: acceptance exactly 1 (draft identical to target or acceptance not checked?)")
        if abs(e["mean_accepted_len"] - 1.0) < 1e-9:
            flags.append(f"{m}: mean accepted length exactly 1 token")
    return flags


def _burst_raw(url: str, texts: list[str], method: str, c: int, new: int) -> dict:
    """c streamed clients, each sending its next request when the last is answered, until
    `peer_curve.curve_requests` requests (prompt i % len(texts)) are answered: what `figures.curve_point` turns into
    a curve point (tokens, wall seconds, per-request latency and time to first token, the gaps between a stream's
    pieces after its first, all streams pooled: a speculative piece holds the tokens of a round)."""
    n = peer_curve.curve_requests(c, len(texts))
    gaps: list[list[float]] = [[] for _ in range(n)]

    def one(i: int) -> dict:
        last = [0.0]

        def piece(_text: str) -> None:
            now = time.perf_counter()
            if last[0]:
                gaps[i].append(1e3 * (now - last[0]))
            last[0] = now

        return _request(url, texts[i % len(texts)], new, method, on_piece=piece)

    t, s0 = time.perf_counter(), steal_ms()
    with ThreadPoolExecutor(c) as ex:  # c workers over n requests: c in flight, the next sent as one is answered
        rs = list(ex.map(one, range(n)))
    wall, stolen = time.perf_counter() - t, steal_since(s0)
    return {"tokens": sum(r["num_output_tokens"] for r in rs), "wall_s": wall,
            "latency_ms": [r["latency_s"] * 1000 for r in rs], "ttft_ms": [1e3 * r["ttft_s"] for r in rs],
            "itl_ms": [g for gs in gaps for g in gs], "steal_ms": stolen}


def _burst(url: str, texts: list[str], method: str, c: int, new: int) -> dict:
    """One burst's curve point (`_burst_raw`, `figures.curve_point`)."""
    return curve_point([_burst_raw(url, texts, method, c, new)])


def curve_order(methods: list[str], default: str | None) -> list[str]:
    """The bursts of one curve level: the default method and baseline first, the other methods, then baseline and
    the default again, so that the two the issue's figures set side by side are read twice, each pair's mean at the
    same place in the level (the machine's memory speed moves within minutes: one burst each had read the default
    at 0.90x baseline at 2 clients where six paired repeats read 0.94-1.07, median 1.02). With no default besides
    baseline, every method once."""
    if default is None or default == "baseline" or default not in methods or "baseline" not in methods:
        return list(methods)
    return [default, "baseline", *[m for m in methods if m not in (default, "baseline")], "baseline", default]


def batch_curve(url: str, texts: list[str], methods: list[str], levels: list[int], new: int, log,
                default: str | None = None) -> list[dict]:
    """Each level's bursts in `curve_order`: one point a method, a method's bursts pooled (`figures.curve_point`)."""
    out = []
    for c in levels:
        raws: dict[str, list[dict]] = {}
        for m in curve_order(methods, default):
            raws.setdefault(m, []).append(_burst_raw(url, texts, m, c, new))
        for m in methods:
            out.append({"concurrency": c, "method": m, **curve_point(raws[m])})
        log(f"  concurrency {c}: " + ", ".join(_point_label(e) for e in out[-len(methods):]))
    return out


def _point_label(e: dict) -> str:
    """'hybrid 41.4', or with its bursts 'hybrid 40.7 (41.6, 39.9)': the curve's progress line."""
    each = e.get("bursts_tokens_per_s")
    return f"{e['method']} {e['tokens_per_s']:.1f}" + (f" ({', '.join(f'{x:.1f}' for x in each)})" if each else "")


def crossover(curve: list[dict], methods: list[str]) -> dict:
    """Per method, the lowest concurrency at which it is no faster than baseline (None: always faster)."""
    by = {(e["concurrency"], e["method"]): e["tokens_per_s"] for e in curve}
    levels = sorted({e["concurrency"] for e in curve})
    return {m: next((c for c in levels if by[(c, m)] <= by[(c, "baseline")]), None)
            for m in methods if m != "baseline"}


def temperatures(url: str, texts: list[str], methods: list[str], temps: list[float], new: int) -> list[dict]:
    out = []
    variants = [(m, m) for m in methods if m != "medusa"]
    if "medusa" in methods:
        variants += [("medusa", "medusa"), ("medusa_typical", "medusa_typical")]
    for t in temps:
        base = None
        for label, m in variants:
            if t == 0.0 and label == "medusa_typical":
                continue
            rs = [_request(url, x, new, m, temperature=t, seed=7 + i) for i, x in enumerate(texts)]
            tps = statistics.median([r["tokens_per_s"] for r in rs])
            base = tps if label == "baseline" else base
            out.append({"temperature": t, "method": label, "tokens_per_s": tps,
                        "speedup": tps / base if base else None, "mean_accepted_len": _mean_accepted(rs),
                        "lossy": label == "medusa_typical"})
    return out


DIST_TOKENS = 8  # leaves the first speculative round room for 6 drafts (the flagship's k)
# Every exact method is tested at T = 1; the default method also at DIST_LOW_T, where a sharper distribution has the
# draft model's proposals accepted more often and the residual drawn from a different shape.
DIST_LOW_T = 0.7


def distribution_test(url: str, text: str, methods: list[str], n: int, tok, log, temperature: float = 1.0) -> dict:
    """Two-sample chi-square on the first two sampled tokens (of DIST_TOKENS-token answers, so the round after the
    first token drafts): each exact method vs baseline, seeded. One request at a time: with several at once the
    server's load policy decodes them plainly (no draft at 8 rows), every method then answers with baseline's own
    samples and the test passes without testing the speculative rule (it had, at 8 at once: 100% of seeds equal).
    Every request sends the same prompt with the prompt cache on, as clients do by default: each then pays no prefill
    (the cache's K/V has the bits a prefill gives), and the section takes less than half its time (on the flagship
    0.16 s a request against 0.40, 2-core Zen 4), which leaves validate.budget_s room for the edit section."""
    out = {}

    def sample(method: str) -> tuple[list[tuple], int]:
        """The first two tokens of each seed's answer, and the draft tokens the answers were verified against."""
        got, drafted = [], 0
        for seed in range(1000, 1000 + n):
            # DIST_TOKENS, not 2: a round drafts no more than the answer's room, so with 2 the round after the
            # first token would be a plain step and the test would pass without testing the speculative rule
            r = _request(url, text, DIST_TOKENS, method, temperature=temperature, seed=seed, stream=False,
                         cache_prompt=True)
            got.append(tuple(tokens_of(tok, r["text"])[:2]))
            drafted += int(r.get("total_draft_tokens") or 0)
        return got, drafted

    base, _ = sample("baseline")
    for m in methods:
        if m == "baseline":
            continue
        other, drafted = sample(m)
        stat, dof, p = chi2_two_sample(base, other)
        same = sum(a == b for a, b in zip(base, other)) / n
        out[m] = {"samples": n, "temperature": temperature, "chi2": stat, "dof": dof, "p_value": p,
                  "consistent": p > 0.001, "same_seed_identical": same, "draft_tokens": drafted}
        log(f"  distribution {m} vs baseline at T={temperature:g}: chi2 {stat:.1f} (dof {dof}), p = {p:.3g}, "
            f"{same:.0%} of seeds give baseline's exact samples, {drafted} draft tokens verified")
    return out


def chi2_two_sample(a: list, b: list, min_count: int = 5) -> tuple[float, int, float]:
    """Chi-square homogeneity test; rare categories are pooled so expected counts stay reasonable."""

    ca, cb = Counter(a), Counter(b)
    cats = sorted(set(ca) | set(cb), key=lambda k: -(ca[k] + cb[k]))
    big = [k for k in cats if ca[k] + cb[k] >= min_count]
    rows = [(ca[k], cb[k]) for k in big]
    rest = (sum(ca[k] for k in cats if k not in big), sum(cb[k] for k in cats if k not in big))
    if sum(rest):
        rows.append(rest)
    na, nb = len(a), len(b)
    stat = 0.0
    for x, y in rows:
        tot = x + y
        for obs, n in ((x, na), (y, nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp if exp else 0.0
    dof = max(len(rows) - 1, 1)
    return stat, dof, chi2_sf(stat, dof)


def chi2_sf(x: float, k: int) -> float:
    """Survival function of the chi-square distribution (regularised upper incomplete gamma)."""
    a, z = k / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    if z < a + 1:
        term = s = 1.0 / a
        n = a
        for _ in range(500):
            n += 1
            term *= z / n
            s += term
        return max(0.0, 1.0 - s * math.exp(-z + a * math.log(z) - math.lgamma(a)))
    b, c, d = z + 1 - a, 1e300, 1 / (z + 1 - a)
    h = d
    for i in range(1, 500):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1 / d if d else 1e300
        c = b + an / c
        h *= d * c
    return min(1.0, math.exp(-z + a * math.log(z) - math.lgamma(a)) * h)


def edit_gains(report: dict) -> dict[str, float]:
    """Each of our methods' decode tokens/s over baseline's on the edit section's whole-file edits (empty when it did
    not run): what a method gains on an editor's repeated text, which the chat prompts above do not show."""
    systems = ((report.get("edit") or {}).get("summary") or {}).get("systems") or {}
    base = (systems.get("baseline") or {}).get("decode_tokens_per_s")
    if not base:
        return {}
    return {m: e["decode_tokens_per_s"] / base for m, e in systems.items()
            if m != "baseline" and m in report["methods"] and e.get("decode_tokens_per_s")}


def advice(report: dict, methods: list[str]) -> dict:
    """The method to serve and when to switch speculation off. A crossover at one client is the curve's short
    requests reading the method no faster than baseline, never a reason to set `disable_at_batch: 1` (that switches
    speculation off for every request, edits included); under the load policy (`draft_length: load`) the method
    already steps plainly from its own rows, so nothing is to be set either."""
    exact = [m for m in methods if m != "baseline"
             and all(d.get("classification") == "numeric near-tie" for d in report["methods"][m]["divergences"])]
    best = max(exact, key=lambda m: report["methods"][m]["tokens_per_s"], default="baseline")
    if best != "baseline" and report["methods"][best]["speedup"] <= 1.0:
        best = "baseline"
    off = report["crossover"].get(best) if best != "baseline" else None
    load = report.get("draft_length") == "load"
    plain = (report.get("plain_from") or {}).get(best)
    advise_off = off if off and off > 1 and not load else None
    if best == "baseline":
        why = "no speculative method beat baseline"
    elif advise_off:
        why = (f"{best} is the fastest greedy-exact method at concurrency 1; at {off} concurrent requests baseline is "
               f"as fast or faster: set `speculation.disable_at_batch: {off}` in the spec and, with {off} or more "
               "requests in flight, the server decodes them plainly in its continuous batch (the baseline code "
               "itself, so switching off costs nothing)")
    elif off and load:
        why = (f"{best} is the fastest greedy-exact method at concurrency 1; the curve read it no faster than "
               f"baseline from {off} concurrent request{'s' if off > 1 else ''}, and under the load policy "
               "(`speculation.draft_length: load`) it "
               + (f"steps plainly from {plain} row{'s' if plain > 1 else ''} by itself" if plain else
                  "chooses each round's drafts by itself") + ": nothing to set")
    elif off:
        why = (f"{best} is the fastest greedy-exact method at concurrency 1, and the curve's short requests read it no "
               "faster than baseline even at one client (within its noise): no switch-off point to set")
    else:
        why = (f"{best} is the fastest greedy-exact method at concurrency 1; it stayed faster at every measured "
               "concurrency")
    gains = edit_gains(report)
    if gains:
        top = max(gains, key=gains.get)
        why += (f"; on the whole-file edits {top} decoded {gains[top]:.2f}x baseline"
                + (f" ({best} {gains[best]:.2f}x)" if best in gains and best != top else ""))
    return {"recommended_method": best,
            "speedup_at_concurrency_1": report["methods"][best]["speedup"],
            "switch_off_speculation_at_concurrency": advise_off,
            "set": f"speculation.disable_at_batch: {advise_off}" if advise_off else None,
            "edit_gains": gains,
            "why": why}


def write_report(spec: Spec, report: dict) -> None:
    out = spec.report_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "validate.json").write_text(json.dumps(report, indent=2, default=str))
    plots(report, out)
    (out / "validate.md").write_text(markdown(report))


def plots(report: dict, out: Path) -> None:
    import matplotlib  # lazy: matplotlib (~1.5 s) only for the plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: as above, after use("Agg")

    ms = list(report["methods"])
    names = ms + list(report["peers"])
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(names) + 1.5), 4.2))
    vals = [report["methods"][m]["tokens_per_s"] for m in ms]
    ax.bar(range(len(names)), vals + [p.get("tokens_per_s") or 0 for p in report["peers"].values()])
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")  # long names side by side ran into each other
    ax.set_ylabel("tokens/s (concurrency 1, gRPC)")
    ax.set_title(f"{report['spec']}: speed by method")
    fig.tight_layout()
    fig.savefig(out / "speed.png", dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for m in ms + [peer_curve.PEER_METHOD]:
        pts = [(e["concurrency"], e["tokens_per_s"]) for e in report["batch_curve"]
               if e["method"] == m and e.get("concurrency") and e.get("tokens_per_s") is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m + (" -np N" if m not in ms else ""),
                    linestyle="--" if m not in ms else "-")
    ax.set_xscale("log", base=2)
    levels = sorted({e["concurrency"] for e in report["batch_curve"] if e.get("concurrency")})
    ax.set_xticks(levels, [str(c) for c in levels])  # 1 2 4, not 2^0 2^1 2^2
    ax.minorticks_off()
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("aggregate tokens/s")
    per = f" ({report['curve_tokens']}-token requests)" if report.get("curve_tokens") else ""
    ax.set_title(f"{report['spec']}: tokens/s by concurrency{per}" + (" (left out)" if report.get("curve_left_out")
                                                                          else ""))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out / "batch_curve.png", dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for m, accs in report["acceptance_per_position"].items():
        ax.plot(range(1, len(accs) + 1), accs, marker="o", label=m)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1)
    if report["acceptance_per_position"]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=100)
    plt.close(fig)


def _draft_line(d: dict) -> str:
    frac = d.get("step_fraction_of_target")
    cov = d.get("vocab_coverage")
    return (f"Draft: {d['source']}, {d['layers']} layers, {d['dtype']}"
            + (f" {d['quantization']}" if d.get("quantization") else "")
            + f", head of {d['vocab']} tokens"
            + (f" (covers {cov:.1%} of the target's tokens on the evaluation prompts)" if cov else "")
            + f"; k = {d['num_draft_tokens']} ({d['chosen_by']})"
            + (f"; a draft step costs {frac:.3f} of a target step" if frac else "") + ".")


def curve_latency(by: dict, c: int, methods: list[str], what: str) -> str:
    """The curve table's latency cell at concurrency c: each method's `what` ('ttft' or 'itl') p50/p99 in ms, as
    `_burst` and peer_curve.burst write them (`ttft_ms_p50`, ...)."""
    return ", ".join(f"{m} {e[f'{what}_ms_p50']:.0f}/{e[f'{what}_ms_p99']:.0f}" for m in methods
                     if (e := by.get((c, m))) and f"{what}_ms_p50" in e)


def plain_from_rows(bundle, methods: list[str], max_rows: int) -> dict[str, int]:
    """Under `draft_length: load`: each speculative method's fewest rows from which it decodes plainly
    (`decode.plain_rows`), for the methods that do within `max_rows`. What explains an acceptance of 0 in the table: a
    method whose drafts are not expected to pay here steps plainly."""
    from pipeline.runtime.decode import plain_rows  # lazy: loads torch (~1.5 s); validate's report needs none

    out = {}
    for m in methods:
        at = plain_rows(bundle, m, max_rows)
        if at is not None:
            out[m] = at
    return out


def over_peer_by_prompt(report: dict) -> dict[str, dict[str, float]]:
    """Each method's tokens/s over llama-server plain's, prompt by prompt (the peer's requests interleaved with ours,
    so each pair saw the same minutes of this machine's moving memory speed): median, least and most. Empty where the
    peer did not run or was not interleaved."""
    plain = ((report.get("peers") or {}).get("llama_cpp_server") or {}).get("plain") or {}
    peer = plain.get("per_prompt_tokens_per_s") or []
    if not plain.get("interleaved") or not peer:
        return {}
    probes = report.get("memory_gbs_by_prompt") or []
    mem = [sum(p) / 2 for p in probes if all(p)]  # a prompt missing a probe leaves the whole run unsplit
    mid = statistics.median(mem) if len(mem) == len(probes) == len(peer) and len(mem) >= 2 else None
    out = {}
    for m, e in report["methods"].items():
        ours = e.get("per_prompt_tokens_per_s") or []
        pairs = [(a / b, i) for i, (a, b) in enumerate(zip(ours, peer)) if a and b]
        r = [x for x, _ in pairs]
        if not r:
            continue
        out[m] = {"median": statistics.median(r), "min": min(r), "max": max(r), "prompts": len(r)}
        if mid is None:
            continue
        slow, fast = [x for x, i in pairs if mem[i] <= mid], [x for x, i in pairs if mem[i] > mid]
        if slow and fast:  # the prompts read in the slower and the faster half of the memory's minutes
            out[m].update(slower_memory=statistics.median(slow), faster_memory=statistics.median(fast),
                          memory_gbs_median=mid)
    return out


def over_peer_line(ratios: dict[str, dict[str, float]]) -> list[str]:
    """validate.md's line with `over_peer_by_prompt`."""
    if not ratios:
        return []
    n = max(r["prompts"] for r in ratios.values())
    lines = ["", f"Over llama-server plain prompt by prompt ({n} prompts, its requests interleaved with ours): "
             + ", ".join(f"{m} median {r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})" for m, r in ratios.items())
             + "."]
    split = {m: r for m, r in ratios.items() if "slower_memory" in r}
    if split:
        mid = next(iter(split.values()))["memory_gbs_median"]
        lines += ["", "The same figures split by the memory's read speed around each prompt (probes before and "
                  f"after it, median {mid:g} GB/s): " + ", ".join(
                      f"{m} {r['slower_memory']:.2f}x where it read slower, {r['faster_memory']:.2f}x faster"
                      for m, r in split.items())
                  + " (llama-server's plain decoding reads the weights at the memory's speed, where a verification "
                  "of several tokens is partly bound by the integer units)."]
    return lines


def plain_from_line(plain_from: dict[str, int]) -> list[str]:
    """validate.md's line naming the methods the load policy keeps plain, from how many rows."""
    if not plain_from:
        return []
    return ["", "With `speculation.draft_length: load`, a method steps plainly from the rows where its drafts are not "
            "expected to pay on this machine (the stored costs and acceptance: pick-k's for a chain drafter, the "
            "tree's build for Medusa): " + ", ".join(f"{m} from {n} row{'s' if n > 1 else ''}"
                                                      for m, n in plain_from.items()) + "."]


def curve_setting(disable_at_batch: int, draft_length: str | None) -> str:
    """How the curve's requests speculate, for validate.md: each sends `disable_at_batch: 0`, so the spec's switch
    stays out of it; with `draft_length: load` the load policy still chooses each round's drafts, as served."""
    how = ("the load policy (`speculation.draft_length: load`) still chooses each round's drafts, none included, as "
           "it does served" if draft_length == "load" else "every round drafts the method's k")
    return (f"Each request sends `disable_at_batch: 0`, so the spec's switch (`speculation.disable_at_batch: "
            f"{disable_at_batch}`, 0 = never) does not apply; {how}.")


def curve_markdown(r: dict) -> list[str]:
    """The concurrency curve's table and notes, then the temperatures' (validate.md)."""
    lines: list[str] = []
    levels = sorted({e["concurrency"] for e in r["batch_curve"] if e.get("concurrency") is not None})
    ms = list(r["methods"])
    peer = [m for m in [peer_curve.PEER_METHOD] if any(e["method"] == m for e in r["batch_curve"])]
    cols = ms + [f"{m} -np N" for m in peer]
    lines += ["| concurrency | " + " | ".join(cols) + " | ttft p50/p99 ms | itl p50/p99 ms |",
              "|---" * (len(cols) + 3) + "|"]
    by = {(e["concurrency"], e["method"]): e for e in r["batch_curve"]}

    def cell(c: int, m: str) -> str:
        tps = (by.get((c, m)) or {}).get("tokens_per_s")
        return f"{tps:.1f}" if tps is not None else "n/a"

    for c in levels:
        lines.append(f"| {c} | " + " | ".join(cell(c, m) for m in ms + peer) + " | "
                     f"{curve_latency(by, c, ms + peer, 'ttft')} | {curve_latency(by, c, ms + peer, 'itl')} |")
    twice = [m for m in ms if any("bursts_tokens_per_s" in e for e in r["batch_curve"] if e["method"] == m)]
    if twice:
        lines += ["", f"{' and '.join(twice)}: two bursts a level, before and after the other methods, pooled "
                  "(`bursts_tokens_per_s` in validate.json holds each); the other methods one burst each."]
    stolen = {c: sum(e.get("steal_ms") or 0.0 for e in r["batch_curve"] if e.get("concurrency") == c) for c in levels}
    if any(stolen.values()):
        lines += ["", "Steal time over each level's bursts, all methods (the hypervisor taking this VM's cores, "
                  "/proc/stat): " + ", ".join(f"{c}: {v:.0f} ms" for c, v in stolen.items()) + ". A gap that lost a "
                  "slice of it lands in the p99 (pipeline/admission.py sets such steps apart in bench)."]
    if r.get("vs_llama_server_at_concurrency"):
        lines += ["", "Ours over `llama-server -np N` at the same concurrency, same run: " + "; ".join(
            f"{m} " + ", ".join(f"{c}: {x:.2f}x" for c, x in v.items())
            for m, v in r["vs_llama_server_at_concurrency"].items() if v) + ". Our inter-token latency is the gap "
            "between a stream's pieces (a speculative piece holds a round's tokens); llama-server's (not streamed) "
            "its decode time over its tokens, and its time to first token its wall time less that decode time."]
    lines += ["", f"Crossover (first concurrency where the method is no faster than baseline): {r['crossover']}. "
              + curve_setting(r.get("disable_at_batch", 0), r.get("draft_length"))]
    if r.get("curve_targets"):
        lines += ["", *curve_targets.markdown(r["curve_targets"])]
    lines += ["", "## Temperatures", "", "| T | method | tokens/s | speedup | mean accepted len |",
              "|---|---|---|---|---|"]
    for e in r["temperatures"]:
        sp = f"{e['speedup']:.2f}x" if e["speedup"] else ""
        lines.append(f"| {e['temperature']} | {e['method']}{' (lossy)' if e['lossy'] else ''} | "
                     f"{e['tokens_per_s']:.1f} | {sp} | {e['mean_accepted_len']:.2f} |")
    return lines


def markdown(r: dict) -> str:
    lines = [f"# Validation: {r['spec']} (gRPC {r['grpc_url']}, {r['prompts']} prompts x {r['new_tokens']} tokens)",
             "", r["acceptance_definition"], "",
             *([f"Trimmed to fit the main job's time budget: {'; '.join(r['trimmed'])}.", ""] if r.get("trimmed")
               else []),
             *([_draft_line(r["draft"]), ""] if r.get("draft") else []),
             "| method | tokens/s | speedup | acceptance | mean accepted len | greedy identical | p50 ms | p95 ms |"
             " TTFT p50 ms |", "|---|---|---|---|---|---|---|---|---|"]
    for m, e in r["methods"].items():
        lines.append(f"| {m} | {e['tokens_per_s']:.1f} | {e['speedup']:.2f}x | {e['acceptance_rate']:.2f} | "
                     f"{e['mean_accepted_len']:.2f} | {e['greedy_identical']}/{e['greedy_total']} | "
                     f"{e['latency_ms']['p50']:.0f} | {e['latency_ms']['p95']:.0f} | {e['ttft_ms']['p50']:.0f} |")
    for name, p in r["peers"].items():
        tps = p.get("tokens_per_s")
        short = f" ({p['prompts']} prompts x {p['new_tokens']} tokens)" if "new_tokens" in p else ""
        who = name if name.startswith("llama_cpp") else f"transformers {name}{short}"
        cell = f"{tps:.1f}" if tps else f"n/a ({p.get('note', '')})"
        if name == "llama_cpp_server" and tps:
            lines += peers_rows(p)
        else:
            lines.append(f"| {who} | {cell} | | | | | | | |")
    for m, e in r["methods"].items():
        for d in e["divergences"]:
            lines.append(f"\n- {m}, prompt {d['prompt']}: {d.get('classification')} at token {d.get('position')} "
                         f"(margin {d.get('top2_margin', float('nan')):.3f})")
    n = r["methods"].get("draft_target", {}).get("lookup_min_ngram")
    if n:
        lines += ["", f"draft_target takes the prompt-lookup continuation when the context's last {n}+ tokens occurred "
                  "earlier (`speculation.draft_lookup_min_ngram`), the draft's tokens otherwise."]
    lines += over_peer_line(r.get("over_llama_plain_by_prompt") or {})
    lines += plain_from_line(r.get("plain_from") or {})
    if r.get("first_prompt"):
        lines += ["", "First prompt run again after the pass (its first run came first after ready and the warm-up): "
                  + "; ".join(f"{m} {e['first_tokens_per_s']:.1f} then {e['again_tokens_per_s']:.1f} tokens/s "
                              f"({e['again_over_first']:.2f}x; the median prompt {e['median_over_first']:.2f}x)"
                              for m, e in r["first_prompt"].items()) + "."]
    if r["suspicious"]:
        lines += ["", "Suspicious: " + "; ".join(r["suspicious"])]
    per = f", requests of {r['curve_tokens']} new tokens" if r.get("curve_tokens") else ""
    lines += ["", f"## Concurrency curve (aggregate tokens/s{per})", ""]
    left = r.get("curve_left_out")
    lines += ([f"Left out: {left}; `make validate` (no main-job deadline) measures it.", "", "## Temperatures", "",
               f"Left out with the curve: {left}."] if left else curve_markdown(r))
    lines += ["", f"## Distribution test (first two sampled tokens of {DIST_TOKENS}-token answers, T=1 unless named, "
              "seeded, vs baseline at the same T)", ""]
    if r.get("distribution_left_out"):
        lines.append(f"Left out: {r['distribution_left_out']}; `make validate` (no main-job deadline) runs it.")
    for m, d in r["distribution"].items():
        lines.append(f"- {m}: chi2 {d['chi2']:.1f} on {d['dof']} dof, p = {d['p_value']:.3g} "
                     f"({'consistent' if d['consistent'] else 'DIFFERENT'}); {d['same_seed_identical']:.0%} of "
                     f"seeds give baseline's exact samples; {d.get('draft_tokens', 0)} draft tokens verified")
    if any(d["same_seed_identical"] == 1 for d in r["distribution"].values()):
        lines += ["", "A method at 100% used the request's seeded generator exactly as baseline did, so its samples "
                  "equal baseline's and chi2 is 0 by construction."]
    a = r["advice"]
    lines += ["", "## Advice", "", f"Recommended: **{a['recommended_method']}** "
              f"({a['speedup_at_concurrency_1']:.2f}x at concurrency 1). {a['why']}.", "",
              "![speed](speed.png) ![batch curve](batch_curve.png) ![acceptance](acceptance.png)", ""]
    lines += side_by_side_markdown(r)
    env = r["environment"]
    lines += ["## Environment", "", f"{env['date']}; {env['cpu']} ({env['cpu_count']} cores, "
              f"{env['torch_threads']} torch threads); packages {env['packages']}", ""]
    if r.get("phase_seconds"):
        lines += ["Sections took: " + ", ".join(f"{k} {v:.0f} s" for k, v in r["phase_seconds"].items())
                  + f" ({sum(r['phase_seconds'].values()) / 60:.1f} min).", ""]
    return "\n".join(lines)


def side_by_side_markdown(r: dict) -> list[str]:
    """validate.md's context and edit sections (or the note saying why one did not run)."""
    from pipeline import context_run, edit_run  # lazy: as above

    out = []
    for key, mod, title in (("context", context_run, "Long and repeated contexts"), ("edit", edit_run, "Edits")):
        e = r.get(key)
        if e and "error" in e:
            out += [f"## {title}", "", f"Not measured: {e['error']}.", ""]
        elif e:
            out += mod.markdown(e)
    return out


def peers_rows(p: dict) -> list[str]:
    """validate.md's rows for llama-server: plain, and speculative with its acceptance."""
    rows = [f"| llama-server plain | {p['plain']['tokens_per_s']:.1f} (decode {p['plain']['decode_tokens_per_s']:.1f}) "
            "| | | | | | | |"]
    d = p.get("draft")
    if d:
        acc = f"{d['acceptance']:.2f}" if d.get("acceptance") is not None else ""
        part = f", {d['prompts']} of {p['prompts']} prompts" if d.get("stopped") else ""
        rows.append(f"| llama-server + draft (n-max {d['spec_draft_n_max']}{part}) | {d['tokens_per_s']:.1f} (decode "
                    f"{d['decode_tokens_per_s']:.1f}) | | {acc} | | | | | |")
    return rows


def cmd_validate(args) -> int:
    s = specmod.load(args.spec)
    if getattr(args, "api", "grpc") == "openai":  # pipeline/validate_api.py: any OpenAI-compatible server
        run_validate_api(s, args.base_url or None, args.model or None, args.label)
        return 0
    if getattr(args, "only", "") == "side-by-side":
        run_side_by_side(s)
        return 0
    if s.threads:
        import torch  # lazy: torch (~1.5 s); the CLI imports this module at start

        torch.set_num_threads(s.threads)
    run_validate(s)
    return 0


def register(verb) -> None:
    sp = verb("validate", cmd_validate, "validate and benchmark through gRPC (--api openai: through an OpenAI-"
                                        "compatible endpoint); writes reports/<name>/validate.* (validate_openai.*)")
    sp.add_argument("--api", choices=("grpc", "openai"), default="grpc")
    sp.add_argument("--base-url", default="", help="with --api openai: a peer's endpoint, e.g. "
                                                   "http://127.0.0.1:8080/v1 (default: this deployment's own)")
    sp.add_argument("--model", default="", help="with --api openai: the served model name (default: the spec's name)")
    sp.add_argument("--label", default="", help="with --api openai: report as validate_openai_<label>.*")
    sp.add_argument("--only", choices=("side-by-side",), default="",
                    help="only the context and edit sections beside llama-server (context.json, edit.json)")

"""In-process benchmark: our methods against transformers on the same model, prompts and dtype, in one run.

Writes reports/<name>/bench.json and bench.md. Runs are interleaved prompt by prompt (every method
on prompt i before prompt i+1) after a separate warm-up, so machine noise hits all methods alike;
figures are medians over prompts and speedups are ratios measured in the same run.
"""

from __future__ import annotations

import gc
import importlib.metadata as md
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from pipeline import peers as gguf
from pipeline.admission import admission_lines, streams_while_admitting
from pipeline.common import chat_ids
from pipeline.contention import served_section
from pipeline.figures import Run, mean_accepted_len, median, summarize
from pipeline.precision import engine_float_state, gguf_source, macs_per_token, precision_table, read_bytes
from pipeline.rows_per_step import rows_per_step_lines
from pipeline.runtime import kernels, quant
from pipeline.runtime.decode import VERIFY_COST_FILE, apply_spec, decode, load_bundle
from pipeline.runtime.engine_io import load_model_dir
from pipeline.runtime.generate import Request, generate
from pipeline.runtime.gguf_weights import GGUFLinear
from pipeline.runtime.model import float_state, runtime_to_hf
from pipeline.runtime.quant import hugepage_tensor
from pipeline.runtime.sampling import SamplingParams
from pipeline.sources import spec_prompts
from pipeline.spec import Spec, to_dict
from pipeline.speedpick import verify_costs

# Prompts the precision table's agreement and log-probability count (its speed uses bench's 4): 16 x 64 tokens are
# 1,024 positions, enough to tell an agreement of 0.99 from 0.995 (256 are not: +-0.7% at 95%).
AGREEMENT_PROMPTS = 16


def measure_bandwidth_gbs(mb: int = 512, reps: int = 5) -> float:
    """Sustained read bandwidth: read a buffer much larger than the caches, on huge pages as the weights are, by
    the kernels' streaming read (torch's sum where the kernels are off)."""

    x = hugepage_tensor(mb << 20).view(torch.float32).fill_(1.0)
    read = kernels.stream_read if kernels.available() else torch.sum
    read(x)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        read(x)
        ts.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(ts) / 1e9


def hf_model(model, dtype: torch.dtype):
    """A transformers model of the engine's family (Llama, Mistral, Qwen2) holding exactly our engine's weights."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM  # lazy: transformers (~2 s) only for the peer


    c = model.cfg
    extra = {"use_sliding_window": False} if c.model_type == "qwen2" else {}
    cfg = CONFIG_MAPPING[c.model_type](
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_embeddings, max_position_embeddings=c.max_position_embeddings, **extra)
    from transformers.initialization import no_init_weights  # lazy: transformers (~2 s) only for the peer

    with no_init_weights():  # every weight is assigned below; a random init of 1.5B parameters costs seconds
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    state = {k: v.to(dtype) for k, v in runtime_to_hf(float_state(model), c).items()}
    if c.tie_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (c.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"transformers peer does not match the engine: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    if c.tie_embeddings:
        hf.tie_weights()
    return hf.to(dtype).eval()


def _hf_generate(hf, ids: list[list[int]], new: int, assistant=None, k: int = 4) -> tuple[float, list[list[int]]]:
    """Greedy transformers generate for exactly `new` tokens; returns (seconds, tokens per row)."""
    pad = 0
    S = max(len(r) for r in ids)
    x = torch.tensor([[pad] * (S - len(r)) + r for r in ids])
    att = torch.tensor([[0] * (S - len(r)) + [1] * len(r) for r in ids])
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad, eos_token_id=None)
    if assistant is not None:
        assistant.generation_config.num_assistant_tokens = k
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0
        kw["assistant_model"] = assistant
    t = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(x, attention_mask=att, **kw)
    return time.perf_counter() - t, out[:, S:].tolist()


def _timed(b, method: str, prompt: list[int], new: int, params=None, **opts) -> tuple[float, Any]:
    """One batch-1 decode of `new` tokens after `prompt`: (seconds, its result). Without the caches
    (`cache_prompt=False`): every method decodes each prompt as a fresh one, not from the suffix store's copy of the
    answer a method before it left."""
    req = Request(prompt, new, params or SamplingParams(), cache_prompt=False)
    t = time.perf_counter()
    (res,) = decode(b, method, [req], **opts)
    return time.perf_counter() - t, res


def _transformers_peers(spec: Spec, b, methods: list[str]) -> tuple[Any, Any]:
    """(transformers on our target's weights, transformers' draft for assisted generation or None), both in the
    engine's own dtype (a bf16 engine against bf16 transformers), as validate does."""
    peer_dtype = torch.float32 if spec.dtype == "float32" else torch.bfloat16
    hf_peer = hf_model(b.target, peer_dtype)
    draft_hf = None
    if "draft_target" in methods and (spec.engine_dir / "draft_hf").is_dir():
        from transformers import AutoModelForCausalLM  # heavy: only when there is a draft to assist with

        draft_hf = AutoModelForCausalLM.from_pretrained(str(spec.engine_dir / "draft_hf"), dtype=peer_dtype).eval()
    return hf_peer, draft_hf


def _labelled_runs(b, methods: list[str]) -> list[tuple[str, str, dict]]:
    """(label, method, decode options) of each timed run: every method, and draft_target without prompt lookup
    when it uses it, so the report shows what each part brings."""
    runs = [(m, m, {}) for m in methods]
    if "draft_target" in methods and b.spec.draft_lookup_min_ngram:
        runs.append(("draft_model_only", "draft_target", {"lookup_min_ngram": 0}))
    return runs


def _interleaved(b, runs: list[tuple[str, str, dict]], ids: list[list[int]], new: int, hf_peer, draft_hf, k: int,
                 probe: Callable[[], float], log, llama: gguf.PlainPeer | None = None, texts: Sequence[str] = ()
                 ) -> tuple[dict[str, list[Run]], dict[str, list[float]], list[float], list[float]]:
    """Every run, the transformers peers and `llama` (llama-server plain, on `texts`, the raw prompts) on prompt i
    before prompt i + 1, so machine noise hits all alike: (runs per label, peers' tokens/s, bandwidth probes between
    the prompts, a probe right after each prompt's baseline). The baseline runs first, just after a probe, so the
    roofline sets each of its decodes against the memory of its own seconds: it drifts by tens of percent within a
    prompt's round (transformers alone takes a minute of it)."""
    rows: dict[str, list[Run]] = {label: [] for label, _, _ in runs}
    peers: dict[str, list[float]] = {"hf_generate": [], "hf_assisted": []}
    bws, after_baseline = [probe()], []
    runs = sorted(runs, key=lambda r: r[0] != "baseline")  # the baseline first, right after the probe
    for i, p in enumerate(ids):
        for label, m, opts in runs:
            dt, res = _timed(b, m, p, new, **opts)
            rows[label].append(Run(len(res.tokens) / dt, res.tokens, len(res.tokens), res.steps, res.draft_proposed,
                                   res.draft_accepted))
            if label == "baseline":
                after_baseline.append(probe())
        dt, out = _hf_generate(hf_peer, [p], new)
        peers["hf_generate"].append(new / dt)
        if draft_hf is not None:
            dt, _ = _hf_generate(hf_peer, [p], new, assistant=draft_hf, k=k)
            peers["hf_assisted"].append(new / dt)
        theirs = llama.ask(texts[i]) if llama is not None else None
        log(f"  prompt {i + 1}/{len(ids)}: " + ", ".join(
            f"{m} {rows[m][-1].tokens_per_s:.1f}" for m in rows)
            + f", hf_generate {peers['hf_generate'][-1]:.1f}"
            + (f", llama-server plain {theirs['tokens_per_s']:.1f}" if theirs else "") + " tokens/s")
        bws.append(probe())
    return rows, peers, bws, after_baseline


def _methods_and_peers(report: dict, b, rows: dict[str, list[Run]], peers: dict[str, list[float]], k: int) -> None:
    """report's `methods` (each against the baseline, with its draft settings) and `peers` (transformers)."""
    base_tps = [r.tokens_per_s for r in rows["baseline"]]
    for m, rs in rows.items():
        entry = summarize(rs, rows["baseline"])
        if m in ("draft_target", "prompt_lookup", "draft_model_only"):
            entry["num_draft_tokens"] = k if m != "prompt_lookup" else b.spec.k_for(m)
        if m == "draft_target":
            entry["lookup_min_ngram"] = b.spec.draft_lookup_min_ngram
        if m == "medusa":
            entry["tree"] = b.medusa.choices if hasattr(b.medusa, "choices") else None
            entry["head_accuracy"] = getattr(b.medusa, "head_accuracy", None)
        report["methods"][m] = entry
    report["peers"]["hf_generate"] = {"tokens_per_s": median(peers["hf_generate"]),
                                      "per_prompt_tokens_per_s": peers["hf_generate"]}
    report["methods"]["baseline"]["vs_hf_generate"] = (
        median([a / h for a, h in zip(base_tps, peers["hf_generate"])]))
    if peers["hf_assisted"]:
        report["peers"]["hf_assisted"] = {"tokens_per_s": median(peers["hf_assisted"]), "num_assistant_tokens": k,
                                          "per_prompt_tokens_per_s": peers["hf_assisted"]}
        report["methods"]["draft_target"]["vs_hf_assisted"] = (
            report["methods"]["draft_target"]["tokens_per_s"] / report["peers"]["hf_assisted"]["tokens_per_s"])


def _roofline(b, bws: list[float], base_tps: list[float], baseline_tps: float,
              after_baseline: list[float] | None = None) -> dict:
    """Memory-bandwidth roofline for batch-1 decoding: the weights read per token against the measured bandwidth."""

    bw = median(bws)
    wbytes = read_bytes(b.target)  # buffers too: tiled and quantized layers hold their weights as buffers
    limit = bw * 1e9 / wbytes
    # Each prompt's baseline against the readings taken just before and just after it (`after_baseline`; without it,
    # after its prompt's whole round). The median of all probes against the median speed had read 117% in one run:
    # the decodes had run in faster minutes than most probes.
    around = [(a + c) / 2 for a, c in zip(bws, after_baseline or bws[1:])]
    return {"bandwidth_gbs": bw, "bandwidth_probes_gbs": bws, "weight_bytes_read_per_token": wbytes,
            "bandwidth_after_baseline_gbs": after_baseline or [], "limit_tokens_per_s": limit,
            "fraction_of_limit": median([t * wbytes / (g * 1e9) for t, g in zip(base_tps, around)]),
            "fraction_at_median_bandwidth": baseline_tps / limit,
            "skinny_kernel": kernels.available()}


def _precision(spec: Spec, b, ids: list[list[int]], quick: bool, probe: Callable[[], float], log) -> dict:
    """Speed and quality per weight precision of the target (issue 16): float32 / bfloat16 / int8 / int4; agreement
    and log-probability on AGREEMENT_PROMPTS prompts (the speed prompts and the next ones of validate.prompts)."""

    mcfg, fstate, ref = engine_float_state(spec.engine_dir / "target", spec)
    more = [] if quick else [chat_ids(b.tokenizer, p)
                             for p in spec_prompts(spec, 1 + AGREEMENT_PROMPTS)[1 + len(ids):]]
    return precision_table(mcfg, fstate, ids[:1] if quick else ids, 16 if quick else 64, probe,
                           spec.target.group_size, ref, end_ids=b.end_ids, log=log, gguf_path=gguf_source(spec),
                           agreement_ids=more)


def _sampled(b, methods: list[str], ids: list[list[int]], new: int) -> dict:
    """Sampling at temperature 0.7: baseline vs each speculative method; Medusa typical (lossy) vs exact."""

    hot = SamplingParams(temperature=0.7, seed=1234)
    sampled: dict[str, dict] = {}
    variants = [("baseline", {})] + [(m, {}) for m in methods if m in ("draft_target", "prompt_lookup")]
    if "medusa" in methods:
        variants += [("medusa", {"acceptance": "exact"}), ("medusa", {"acceptance": "typical"})]
    for m, opts in variants:
        label = m + (f"_{opts['acceptance']}" if opts else "")
        tps, toks, steps = [], 0, 0
        for p in ids[: max(2, len(ids) // 2)]:
            dt, res = _timed(b, m, p, new, hot, **opts)
            tps.append(len(res.tokens) / dt)
            toks, steps = toks + len(res.tokens), steps + res.steps
        sampled[label] = {"tokens_per_s": median(tps), "mean_accepted_len": mean_accepted_len(toks, steps)}
        if label.endswith("typical"):
            sampled[label]["lossy"] = True
    for v in sampled.values():
        v["speedup"] = v["tokens_per_s"] / sampled["baseline"]["tokens_per_s"]
    return sampled


def _write_report(spec: Spec, report: dict, log) -> None:
    """bench.json and bench.md under reports/<name>/; the markdown goes to the log too."""
    out = spec.report_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    (out / "bench.md").write_text(bench_markdown(report))
    log(bench_markdown(report))
    log(f"wrote {out / 'bench.json'}")


def run_bench(spec: Spec, quick: bool = False, log=print) -> dict:
    """Every method and its peers on the same prompts, interleaved; then the sections that explain the figures
    (roofline, precision, verify cost, sampling, bf16, batch 8). Returns the report it writes."""

    n_prompts, new = (2, 16) if quick else (4, 128)
    b = apply_spec(load_bundle(spec.engine_dir, spec.device), spec)
    prompts = spec_prompts(spec, n_prompts + 1)
    ids = [chat_ids(b.tokenizer, p) for p in prompts]
    warm, ids = ids[0], ids[1:]
    methods = b.methods()
    log(f"bench {spec.name}: methods {methods}, {len(ids)} prompts x {new} new tokens, batch 1, greedy")
    hf_peer, draft_hf = _transformers_peers(spec, b, methods)
    k = b.spec.k_for("draft_target")
    runs = _labelled_runs(b, methods)
    for _, m, opts in runs:  # warm-up, apart from the measured runs
        _timed(b, m, warm, new, **opts)
    _hf_generate(hf_peer, [warm], 8)

    def probe() -> float:
        return measure_bandwidth_gbs(128 if quick else 512, reps=3)

    with gguf.PlainPeer(spec, new, log, warm=prompts[0]) as llama:  # llama-server plain, between ours per prompt
        rows, peers, bws, after_baseline = _interleaved(b, runs, ids, new, hf_peer, draft_hf, k, probe, log, llama,
                                                        prompts[1:])
    report: dict = {"spec": spec.name, "new_tokens": new, "prompts": len(ids), "batch": 1, "dtype": spec.dtype,
                    "methods": {}, "peers": {}}
    _methods_and_peers(report, b, rows, peers, k)

    # llama.cpp's own server on the target's GGUF (plain and with the draft's GGUF), on the same prompts, when built.

    report["peers"].update(gguf.safe_llama_server_peer(spec, prompts[1:], new, log, warm=prompts[0], plain=llama))

    # A busy machine (issue 28): ours served and llama-server, quiet against one busy process, 64 tokens.

    report["contention"] = ({"note": "not measured with --quick"} if quick else served_section(
        spec, b.tokenizer, prompts[1], [m for m in ("baseline", "draft_target") if m in methods], 64, 2, log))
    # Running streams while a long prompt is admitted in chunks beside them (issue 48: p99 within 2x their median).
    n_long, chunk = 512 if quick else 4096, spec.kv_cache.prefill_chunk
    log(f"  admission: 2 streams while a {n_long}-token prompt is admitted (prefill_chunk {chunk})")
    report["admission"] = streams_while_admitting(b.target, chunk, prompt_tokens=n_long)
    log("   " + admission_lines(report["admission"])[-1])
    report["roofline"] = _roofline(b, bws, [r.tokens_per_s for r in rows["baseline"]],
                                   report["methods"]["baseline"]["tokens_per_s"], after_baseline)
    # Batch-8 throughput (baseline) with transformers alongside; then the transformers models go (4 GB for the
    # pair): the precision table builds up to five copies of the target and needs the room.
    report["batch8"] = batch_compare(b, hf_peer, ids, 8, 8 if quick else 32)
    del hf_peer, draft_hf
    gc.collect()
    report["precision"] = _precision(spec, b, ids, quick, probe, log)
    report["bandwidth_gbs"] = report["precision"]["bandwidth_gbs"]
    # Verify cost: one target forward over S new tokens, relative to S = 1.
    # S = 1..33: the suffix drafter drafts up to 32 tokens where this curve says verifying them is cheap enough.
    report["verify_cost_ms"] = verify_cost_curve(b.target, 8 if quick else 33)
    store_verify_cost(spec.engine_dir / "target", report["verify_cost_ms"])
    report["verify_floor"] = verify_floor(b.target.cfg, report["verify_cost_ms"], 0.05 if quick else 0.3)
    report["verify_cost_amx"] = verify_cost_amx(b.target, 8, 3 if quick else 9)
    report["temperature_0.7"] = _sampled(b, methods, ids, new)
    # bf16 weights with transformers alongside.
    report["bf16"] = bf16_compare(spec, b, ids[:2], 16 if quick else 64, log)
    report["environment"] = environment(spec)
    _write_report(spec, report, log)
    return report


def store_verify_cost(target_dir: Path, curve: list[dict]) -> None:
    """Keep the relative curve beside the target's weights, where the suffix drafter reads it
    (decode.load_verify_cost): its draft lengths follow this machine's verify cost, not a constant."""
    rel = [c["relative"] for c in curve]
    for i in range(1, len(rel)):  # more tokens never cost less (medians of paired rounds can dip)
        rel[i] = max(rel[i], rel[i - 1])
    data = {"relative": rel, "tokens": [c["tokens"] for c in curve], "written_by": "make bench",
            "date": time.strftime("%Y-%m-%d %H:%M")}
    tmp = target_dir / f".{VERIFY_COST_FILE}.tmp"
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(target_dir / VERIFY_COST_FILE)


def verify_cost_curve(model, max_s: int, reps: int = 9) -> list[dict]:
    """One forward over S new tokens at a realistic context length (speedpick.verify_costs): `ms` the best round
    (made non-decreasing), `relative` the median over rounds of that round's S-token time over its own one-token
    time. Paired within a round, the two see the same memory speed; the ratio of the two minima had paired a fast
    minute's one-token step with a slow minute's 8-token forward (six profiles within ten minutes on one Zen 4 read
    1.49-2.80)."""

    rounds: list[list[float]] = []
    verify_costs(model, max_s, reps=reps, rounds=rounds)
    return _curve(rounds)


def _curve(rounds: list[list[float]]) -> list[dict]:
    """The verify curve from timed rounds (seconds per S = 1..n in each): `ms` the best round, made non-decreasing
    as verify_costs makes it; `relative` the median of each round's S-token time over its own one-token time."""
    best = [min(r[i] for r in rounds) for i in range(len(rounds[0]))]
    for i in range(1, len(best)):
        best[i] = max(best[i], best[i - 1])
    return [{"tokens": s, "ms": 1000 * c, "relative": median([r[s - 1] / r[0] for r in rounds]),
             "rounds_ms": [1000 * r[s - 1] for r in rounds]} for s, c in enumerate(best, start=1)]


@torch.inference_mode()
def verify_cost_amx(model, max_s: int = 8, reps: int = 9, mode: str | None = None) -> dict | None:
    """Where the GGUF weights run on AMX tiles (`kernels.amx()` 'hardware'; 'emulated' in the tests), the verify curve
    on the AMX tiles and on the AVX-512 tiles side by side, the two alternating round by round so both see the same
    minutes: per S, each one's best ms and one-token steps (bench's paired median) and the median of the rounds'
    AMX / AVX-512 time; and whether an S-token forward gave the same bits on both. What AMX does for verification
    (issue 28) in one run on the machine that has it. None where the AVX-512 tiles are all there is, or the model has
    no GGUF weights."""
    mode = mode or kernels.amx()
    if mode == "off" or not any(isinstance(m, GGUFLinear) for m in model.modules()):
        return None  # the tiles only ever run GGUF weights
    tiles = {mode: "amx", "off": "avx512"}
    rounds: dict[str, list[list[float]]] = {"amx": [], "avx512": []}
    cache = model.new_cache(1, 3 * max_s)
    tok, pos = torch.arange(1, max_s + 1)[None] % model.cfg.vocab_size, torch.arange(max_s)[None]
    hidden = {}
    prev = kernels.set_amx(mode)
    min_rows = kernels.amx_min_rows(1)  # the tiles at every S: the comparison that sets where they take over
    try:
        for m in (mode, "off"):
            kernels.set_amx(m)
            hidden[tiles[m]] = model(tok, pos, cache)
        for _ in range(reps):
            for m in (mode, "off"):
                kernels.set_amx(m)
                verify_costs(model, max_s, reps=1, rounds=rounds[tiles[m]])
    finally:
        kernels.amx_min_rows(min_rows)
        kernels.set_amx(prev)
    return {"mode": mode, "rounds": reps, "same_bits": bool(torch.equal(hidden["amx"], hidden["avx512"])),
            "min_rows": min_rows,
            "amx": _curve(rounds["amx"]), "avx512": _curve(rounds["avx512"]),
            "amx_over_avx512": [median([a[s] / b[s] for a, b in zip(rounds["amx"], rounds["avx512"])])
                                for s in range(max_s)]}


def verify_cost_amx_lines(v: dict | None) -> list[str]:
    """bench.md's sentence on the AMX tiles against the AVX-512 tiles (nothing where AMX was not used)."""
    if not v:
        return []
    a, b, r = v["amx"][-1], v["avx512"][-1], v["amx_over_avx512"][-1]
    rows = (f" The tiles take chunks of {v['min_rows']} token rows or more (kernels.amx_min_rows); the AMX / AVX-512 "
            "time by S: " + ", ".join(f"{s}: {x:.2f}" for s, x in enumerate(v["amx_over_avx512"], start=1)) + "."
            if v.get("min_rows") else "")
    return [f"AMX tiles against the AVX-512 tiles at every S ({v['rounds']} alternating rounds, {v['mode']}; same "
            f"bits: {'yes' if v['same_bits'] else 'NO'}): {a['tokens']} tokens {a['ms']:.1f} against {b['ms']:.1f} ms "
            f"({r:.2f}x the time), {a['relative']:.2f} against {b['relative']:.2f} one-token steps.{rows}", ""]


def verify_floor(cfg, curve: list[dict], seconds: float, tokens: int = 8) -> dict:
    """How cheap verifying `tokens` tokens could be on this machine: their multiply-adds at the kernel build's
    measured int8 peak (kernels.int8_peak), against the measured one-token step. When that floor alone is near or
    above 1.3 steps (issue 28's target), no tile order on these vector units reaches the target; AMX tiles (path
    `avx512+amx`, whose TDPBSSD this peak does not time) are not bound by it."""
    if not kernels.available():
        return {"note": "the skinny kernel is off (torch path): no int8 dot product to measure"}
    peak = kernels.int8_peak(seconds)
    macs = macs_per_token(cfg)
    floor_ms = 1000 * tokens * macs / peak["macs_per_s"]
    one = curve[0]["ms"]
    at = next((c for c in curve if c["tokens"] == tokens), None)
    return {"tokens": tokens, "macs_per_token": macs, "int8_macs_per_s": peak["macs_per_s"],
            "instruction": peak["instruction"], "threads": peak["threads"], "kernel_path": kernels.path(),
            "floor_ms": floor_ms, "floor_relative": floor_ms / one,
            "measured_relative": at["relative"] if at else None,
            "fraction_of_peak": floor_ms / at["ms"] if at else None}


def verify_floor_lines(f: dict) -> list[str]:
    """bench.md's sentence on the verify floor (nothing for an older report without it)."""
    if not f:
        return []
    if "floor_ms" not in f:
        return [f"Verify floor: {f.get('note', 'not measured')}.", ""]
    got = (f" Measured: {f['measured_relative']:.2f} steps, {100 * f['fraction_of_peak']:.0f}% of that peak."
           if f.get("measured_relative") is not None else "")
    return [f"Verify floor: {f['tokens']} tokens x {f['macs_per_token'] / 1e9:.2f} G multiply-adds at this build's "
            f"int8 peak, {f['int8_macs_per_s'] / 1e9:.0f} G/s ({f['instruction']}, {f['threads']} threads), take "
            f"{f['floor_ms']:.1f} ms: {f['floor_relative']:.2f} one-token steps before any other instruction.{got}",
            ""]


def bf16_compare(spec: Spec, b, ids: list[list[int]], new: int, log) -> dict:

    model16, _ = load_model_dir(spec.engine_dir / "target", spec.device, dtype="bfloat16", verify=False)
    hf16 = hf_model(b.target, torch.bfloat16)
    ours, theirs = [], []
    generate(model16, [Request(ids[0], 4)])
    for p in ids:
        t = time.perf_counter()
        generate(model16, [Request(p, new)])
        ours.append(new / (time.perf_counter() - t))
        dt, _ = _hf_generate(hf16, [p], new)
        theirs.append(new / dt)
    log(f"  bf16: ours {median(ours):.1f} tokens/s, transformers {median(theirs):.1f}")
    return {"new_tokens": new, "baseline_tokens_per_s": median(ours), "hf_generate_tokens_per_s": median(theirs),
            "ratio": median(ours) / median(theirs),
            "note": "ours: bf16 weights, bf16-rounded activations, fp32 sums" if spec.target.quantization == "none"
            else f"ours: the target engine's {spec.target.quantization} weights; transformers: those weights in bf16"}


def batch_compare(b, hf, ids: list[list[int]], batch: int, new: int) -> dict:

    rows = [ids[i % len(ids)] for i in range(batch)]
    t = time.perf_counter()
    generate(b.target, [Request(r, new) for r in rows])
    ours = batch * new / (time.perf_counter() - t)
    dt, _ = _hf_generate(hf, rows, new)
    theirs = batch * new / dt
    return {"batch": batch, "new_tokens": new, "baseline_tokens_per_s": ours, "hf_generate_tokens_per_s": theirs,
            "ratio": ours / theirs}


def environment(spec: Spec) -> dict:


    pk = {}
    for name in ("torch", "transformers", "numpy", "tritonclient", "nvidia-pytriton", "tokenizers"):
        try:
            pk[name] = md.version(name)
        except md.PackageNotFoundError:
            pk[name] = None
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    return {"date": datetime.now(UTC).isoformat(timespec="seconds"), "python": platform.python_version(),
            "packages": pk, "cpu": cpu, "cpu_count": __import__("os").cpu_count(),
            "torch_threads": torch.get_num_threads(), "kernel_path": kernels.path(),
            "amx_unavailable": kernels.amx_unavailable() if kernels.path().startswith("avx512") else None,
            "kernel_threads": kernels.threads(), "transparent_hugepages": quant.thp_mode(),
            "hugepage_mb": quant.hugepage_bytes() >> 20,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "spec": to_dict(spec)}


def contention_lines(c: dict) -> list[str]:
    """bench.md's busy-machine table: quiet and busy tokens/s and the slowdown per decoder."""
    rows = [(f"ours, {m}", e) for m, e in (c.get("ours") or {}).items() if isinstance(e, dict)]
    if "plain" in (c.get("llama_cpp_server") or {}):
        rows.append(("llama-server plain", c["llama_cpp_server"]["plain"]))
    notes = [f"{who}: {e['note']}" for who, e in (("ours", c.get("ours")), ("llama-server", c.get("llama_cpp_server")))
             if isinstance(e, dict) and "note" in e]
    if c.get("note"):
        notes.append(c["note"])
    if not rows and not notes:
        return []
    out = ["", f"## A busy machine ({c.get('new_tokens', '')} tokens, one Python busy loop beside the server, "
           f"{c.get('cores', '')} cores)", ""]
    if rows:
        out += ["| decoder | quiet tokens/s | busy tokens/s | slowdown |", "|---|---|---|---|"]
        out += [f"| {who} | {e['quiet_tokens_per_s']:.1f} | {e['busy_tokens_per_s']:.1f} | {e['slowdown']:.2f}x |"
                for who, e in rows]
    return out + [f"- {n}" for n in notes]


def precision_lines(t: dict) -> list[str]:
    """bench.md's precision table: each weight precision of the target against the reference, and how it was run."""
    rows = [(p, t[p]) for p in ("float32", "bfloat16", "int8", "int4", "int4_a8", "gguf") if p in t]
    if not rows:
        return []
    first = rows[0][1]
    n = first.get("agreement_prompts", 0)
    agreed_on = (f"; agreement and log-prob over {n} prompt{'s' if n != 1 else ''}, {first['agreement_positions']} "
                 "positions" if n else "")
    lines = ["", f"## Target per weight precision ({t['prompts']} prompts x {t['new_tokens']} tokens, decode steps "
             f"only; vs {t['reference']}; kernels {t['kernel_path']}{agreed_on})", "",
             "| precision | tokens/s | vs reference | MB read per token | roofline | agreement | mean log-prob |",
             "|---|---|---|---|---|---|---|"]
    for p, e in rows:
        mb = f"{e['bytes_per_token'] / 1e6:.0f}"
        if "bytes_vs_gguf" in e:
            mb += f" ({e['bytes_vs_gguf']:.3f}x the GGUF's {e['gguf_tensor_bytes'] / 1e6:.0f})"
        lines.append(f"| {p} | {e['tokens_per_s']:.1f} | {e['speedup_vs_reference']:.2f}x | {mb} | "
                     f"{100 * e['roofline_fraction']:.0f}% | {e['agreement_vs_reference']:.3f} | "
                     f"{e['mean_logprob']:.3f} |")
    groups = t.get("groups") or []
    if len(groups) > 1:
        lines += ["", "Decoded in groups that fit this machine's memory, each beside the reference: "
                  + "; ".join(", ".join(g) for g in groups) + "."]
    if t.get("skipped"):
        lines += ["", f"Left out: {t['skipped']}."]
    return lines + rows_per_step_lines(t)


def bench_markdown(r: dict) -> str:
    lines = [f"# Benchmark: {r['spec']} ({r['dtype']}, batch {r['batch']}, {r['new_tokens']} new tokens, "
             f"{r['prompts']} prompts, greedy)", "",
             "| method | tokens/s | speedup vs baseline | acceptance | mean accepted len | greedy identical |",
             "|---|---|---|---|---|---|"]
    for m, e in r["methods"].items():
        lines.append(f"| {m} | {e['tokens_per_s']:.1f} | {e['speedup']:.2f}x | {e['acceptance_rate']:.2f} | "
                     f"{e['mean_accepted_len']:.2f} | {e['greedy_identical']}/{e['greedy_total']} |")
    for name, e in r["peers"].items():
        if name == "llama_cpp_server" and e.get("tokens_per_s") is not None:
            lines.append(f"| llama-server plain | {e['plain']['tokens_per_s']:.1f} (decode "
                         f"{e['plain']['decode_tokens_per_s']:.1f}) | | | | |")
            if e.get("draft"):
                d = e["draft"]
                acc = f"{d['acceptance']:.2f}" if d.get("acceptance") is not None else ""
                lines.append(f"| llama-server + draft (n-max {d['spec_draft_n_max']}) | {d['tokens_per_s']:.1f} "
                             f"(decode {d['decode_tokens_per_s']:.1f}) | | {acc} | | |")
            continue
        who = "llama.cpp llama-server" if name.startswith("llama_cpp") else f"transformers {name}"
        speed = f"n/a ({e.get('note', '')})" if e.get("tokens_per_s") is None else f"{e['tokens_per_s']:.1f}"
        lines.append(f"| {who} | {speed} | | | | |")
    rf = r["roofline"]
    n = r["methods"].get("draft_target", {}).get("lookup_min_ngram")
    if n:
        lines += ["", f"draft_target takes the prompt-lookup continuation when the context's last {n}+ tokens "
                  "occurred earlier (`speculation.draft_lookup_min_ngram`), the draft's tokens otherwise; "
                  "draft_model_only is the same draft alone."]
    lines += ["", f"Baseline vs transformers generate: {r['methods']['baseline']['vs_hf_generate']:.2f}x. "
              f"Bandwidth {rf['bandwidth_gbs']:.1f} GB/s; {rf['weight_bytes_read_per_token'] / 1e6:.0f} MB read per "
              f"token gives a limit of {rf['limit_tokens_per_s']:.1f} tokens/s; baseline reaches "
              f"{100 * rf['fraction_of_limit']:.0f}% of the limit, each prompt against the bandwidth read around it "
              f"(skinny kernel: {rf['skinny_kernel']}).", "",
              "Verify cost (one forward over S new tokens over one token's, the median of rounds that time both): "
              + ", ".join(f"{c['tokens']}: {c['relative']:.2f}" for c in r["verify_cost_ms"]), "",
              *verify_floor_lines(r.get("verify_floor") or {}),
              *verify_cost_amx_lines(r.get("verify_cost_amx")),
              "## Temperature 0.7", "", "| method | tokens/s | speedup | mean accepted len |", "|---|---|---|---|"]
    for m, e in r["temperature_0.7"].items():
        lines.append(f"| {m}{' (lossy)' if e.get('lossy') else ''} | {e['tokens_per_s']:.1f} | {e['speedup']:.2f}x | "
                     f"{e['mean_accepted_len']:.2f} |")
    lines += contention_lines(r.get("contention") or {})
    lines += admission_lines(r.get("admission") or {})
    lines += precision_lines(r.get("precision") or {})
    bf, b8 = r["bf16"], r["batch8"]
    lines += ["", f"bf16: ours {bf['baseline_tokens_per_s']:.1f} tokens/s vs transformers "
              f"{bf['hf_generate_tokens_per_s']:.1f} ({bf['ratio']:.2f}x).",
              f"Batch {b8['batch']}: ours {b8['baseline_tokens_per_s']:.1f} tokens/s vs transformers "
              f"{b8['hf_generate_tokens_per_s']:.1f} ({b8['ratio']:.2f}x).", ""]
    return "\n".join(lines)

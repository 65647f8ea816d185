"""GPU preflight: every problem that would make the planned or built engines fail or mis-serve."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pipeline.spec import Spec
from pipeline.trtllm.era import ERA, PlanError
from pipeline.trtllm.memory import memory_plan
from pipeline.trtllm.planning import engine_dir, medusa_choices, num_draft_tokens, read_engine_configs, roles, source

# ------------------------------------------------------------------------------------------------
# Preflight


def spec_mode(cfg: dict) -> str:
    """speculative_decoding_mode as a name, whether config.json stored the IntFlag value or a string."""
    v = cfg.get("build_config", {}).get("speculative_decoding_mode", "none")
    if isinstance(v, int):
        names = [n for bit, n in ERA.spec_modes if v & bit and n != "none"]
        return names[0] if names else "none"
    v = str(v).lower()
    return v.split(".")[-1] if v else "none"


def _build(cfg: dict, key: str, default: Any = None) -> Any:
    b = cfg.get("build_config", {})
    if key in b:
        return b[key]
    return b.get("plugin_config", {}).get(key, default)


def _pre(cfg: dict, key: str, default: Any = None) -> Any:
    return cfg.get("pretrained_config", {}).get(key, default)


def _tokenizer_digest(source: str) -> str | None:
    """sha256 of the tokenizer files of a local checkpoint (None when it is not on this machine)."""
    d = Path(source)
    files = [d / n for n in ("tokenizer.json", "tokenizer.model") if (d / n).is_file()]
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()


def built_engine_problems(spec: Spec, role: str, cfg: dict | None = None) -> list[str]:
    """What is wrong with a built engine directory: its config.json version and its rank*.engine files.

    An engine of another TensorRT-LLM release does not deserialize in the pinned container, and a
    directory without every rank's engine fails only when tritonserver loads it.
    """
    d = engine_dir(spec, role)
    path = d / "config.json"
    if cfg is None:
        if not path.is_file():
            return [f"{role} engine: {path} does not exist; build it with `make engine SPEC=...` (inside {ERA.image})"]
        try:
            cfg = json.loads(path.read_text())
        except (json.JSONDecodeError, OSError) as e:
            return [f"{role} engine: {path} is not readable JSON ({e}); rebuild it with "
                    "`make engine SPEC=... ARGS=--force`"]
    problems = []
    version = str(cfg.get("version", "?"))
    if version != ERA.tensorrt_llm:
        problems.append(f"{role} engine: {path} was built by TensorRT-LLM {version}, the repository targets "
                        f"{ERA.tensorrt_llm} ({ERA.image}); rebuild it there with `make engine SPEC=... ARGS=--force`")
    world = int(cfg.get("pretrained_config", {}).get("mapping", {}).get("world_size", 1))
    missing = [f"rank{r}.engine" for r in range(world) if not (d / f"rank{r}.engine").is_file()]
    if missing:
        problems.append(f"{role} engine: {d} lacks {', '.join(missing)} (world size {world}); the build did not "
                        "finish: rerun `make engine SPEC=... ARGS=--force`")
    return problems


def quantization_problems(role: str, cfg: dict) -> list[str]:
    """What TensorRT-LLM 0.18's builder or attention plugin rejects in an engine config's quantization.

    The spec refuses these combinations up front; this reads them from a config.json (built elsewhere,
    or passed in), where they would otherwise fail at trtllm-build or at the first request.
    """
    q = _pre(cfg, "quantization") or {}
    algo, kv = q.get("quant_algo"), q.get("kv_cache_quant_algo")
    paged = bool(_build(cfg, "use_paged_context_fmha", False))
    out = []
    if kv == "INT8" and paged:
        out.append(f"{role} engine: an INT8 KV cache with paged context FMHA (\"Paged Context FMHA doesn't work with "
                   "int8 kv cache\"): use tensorrt_llm.kv_cache_dtype fp8 (with FP8 weights) or auto")
    if kv == "FP8" and paged and algo != "FP8":
        out.append(f"{role} engine: an FP8 KV cache with paged context FMHA needs the FP8 quantization workflow "
                   f"(quant_algo FP8, got {algo}): set the model's quantization to fp8 or kv_cache_dtype auto")
    if algo in ("W8A16", "W4A16", "W4A16_AWQ", "W4A8_AWQ") and _pre(cfg, "dtype") == "float32":
        kind = "" if algo == "W4A8_AWQ" else "weight-only "
        out.append(f"{role} engine: {kind}{algo} needs float16 or bfloat16 activations, the dtype is float32: "
                   "convert with --dtype bfloat16")
    return out


def preflight(spec: Spec, engine_configs: dict | None = None) -> list[str]:
    """Every problem that would make these engines fail or mis-serve; each names the flag to change.

    `engine_configs` maps a role (target, draft, medusa) to its config.json; None reads the built
    engines, falling back to the plan for the ones not built yet.
    """
    try:
        rs = roles(spec)
    except PlanError as e:
        return [str(e)]
    problems: list[str] = []
    try:
        cfgs = read_engine_configs(spec) if engine_configs is None else engine_configs
    except (PlanError, json.JSONDecodeError, OSError) as e:
        return [str(e)]
    missing = [r for r in rs if r not in cfgs]
    if missing:
        return [f"no engine config for {', '.join(missing)}; run `make engine SPEC=...` or pass its config.json"]
    k = num_draft_tokens(spec)
    if spec.has_draft:
        t, d = cfgs["target"], cfgs["draft"]
        if spec_mode(t) != "draft_tokens_external":
            problems.append(f"target engine: speculative_decoding_mode is {spec_mode(t)!r}; rebuild it with "
                            f"`trtllm-build {ERA.spec_mode_flag} draft_tokens_external {ERA.max_draft_len_flag} {k}`")
        mdl = int(_build(t, "max_draft_len", 0) or 0)
        if mdl < k:
            problems.append(f"target engine: max_draft_len is {mdl} but requests use {k} draft tokens "
                            f"(speculation.num_draft_tokens); rebuild the target with `{ERA.max_draft_len_flag} {k}` "
                            "or higher, or lower speculation.num_draft_tokens")
        for role, c in (("target", t), ("draft", d)):
            if not _build(c, "use_paged_context_fmha", False):
                problems.append(f"{role} engine: paged context FMHA is off; draft-target needs KV-cache reuse: "
                                f"rebuild with `{ERA.paged_context_fmha_flag} enable`")
        if spec.speculation.use_draft_logits and not _build(d, "gather_generation_logits", False):
            problems.append(f"draft engine: built without generation logits but speculation.use_draft_logits is true; "
                            f"rebuild the draft with `{ERA.generation_logits_flag}` or set "
                            "speculation.use_draft_logits: false")
        vt, vd = _pre(t, "vocab_size"), _pre(d, "vocab_size")
        if vt and vd and vt != vd:
            problems.append(f"draft vocab_size {vd} != target vocab_size {vt}: draft-target needs the same tokenizer; "
                            "pick a draft from the target's family (draft.source)")
        ht, hd = _tokenizer_digest(source(spec, "target")), _tokenizer_digest(source(spec, "draft"))
        if ht and hd and ht != hd:
            problems.append(f"tokenizer files differ between target.source ({spec.target.source}) and draft.source "
                            f"({spec.draft.source}); draft-target needs one tokenizer")
    if spec.has_medusa:
        m = cfgs["medusa"]
        if spec_mode(m) != "medusa":
            problems.append(f"medusa engine: speculative_decoding_mode is {spec_mode(m)!r}; rebuild with "
                            f"`trtllm-build {ERA.spec_mode_flag} medusa`")
        heads = _pre(m, "num_medusa_heads")
        ch = medusa_choices(spec)
        depth = max(len(p) for p in ch) if ch else ERA.default_medusa_tree_depth
        size = len(ch) if ch else ERA.default_medusa_tree_size
        if heads is not None and depth > int(heads):
            problems.append(f"medusa engine has {heads} heads but the tree (medusa.choices"
                            f"{'' if ch else ': auto -> mc_sim_7b_63'}) is {depth} deep; convert with "
                            f"`--num_medusa_heads {depth}` or give shallower medusa.choices")
        if heads is not None and int(heads) != spec.medusa.num_heads:
            problems.append(f"medusa engine has {heads} heads but medusa.num_heads is {spec.medusa.num_heads}; "
                            f"reconvert with `--num_medusa_heads {spec.medusa.num_heads}`")
        mdl = int(_build(m, "max_draft_len", 0) or _pre(m, "max_draft_len", 0) or 0)
        if size > mdl:
            problems.append(f"medusa tree has {size} nodes but the engine's max_draft_len is {mdl}; rebuild with "
                            f"`{ERA.medusa_token_len_flag} {size}` / `{ERA.max_draft_len_flag} {size}` or prune "
                            "medusa.choices")
    for role in rs:
        c = cfgs[role]
        tp = int(c.get("pretrained_config", {}).get("mapping", {}).get("tp_size", 1))
        want_tp = spec.tensorrt_llm.draft_tp if role == "draft" else spec.parallel.tp
        if tp != want_tp:
            key = "tensorrt_llm.draft_tp" if role == "draft" else "parallel.tp"
            problems.append(f"{role} engine was converted with --tp_size {tp} but {key} is {want_tp}; reconvert "
                            f"with `--tp_size {want_tp}` (TensorRT-LLM fixes parallelism at conversion)")
    for role in rs:
        problems += quantization_problems(role, cfgs[role])
    for role in rs:
        if not cfgs[role].get("planned") and engine_configs is None:
            problems += built_engine_problems(spec, role, cfgs[role])
    mem = memory_plan(spec, cfgs)
    problems += mem.problems
    return problems


"""The tensorrt_llm backend: TensorRT-LLM engine plan and runner, launch plan, and GPU preflight.

TensorRT-LLM cannot be installed on the development machines, so everything here is a plan that
prints exactly what would run, plus a runner that executes it where `tensorrt_llm` imports (the
NGC `tritonserver:<yy.mm>-trtllm-python-py3` container). The checks run from the engines'
`config.json` when they exist, otherwise from the plan itself, so a bad spec fails here before a
GPU hour is spent. Every name that changed between TensorRT-LLM releases lives in `ERA`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.spec import Spec


@dataclass(frozen=True)
class Era:
    """One pinned TensorRT-LLM / tensorrtllm_backend / Triton container triple and its names.

    Flags, template keys and tensor names below are those of tensorrtllm_backend v0.18.0 and the
    TensorRT-LLM 0.18.0 engine flow (convert_checkpoint.py -> trtllm-build). Moving to another
    release means editing this object only, after reading that container's config.pbtxt files.
    """

    tensorrt_llm: str = "0.18.0"
    backend_tag: str = "v0.18.0"
    image: str = "nvcr.io/nvidia/tritonserver:25.03-trtllm-python-py3"
    # examples/ layout: 0.18 moved the core models under models/core/; the older path is the fallback.
    convert_scripts: tuple[str, ...] = ("models/core/{family}/convert_checkpoint.py", "{family}/convert_checkpoint.py")
    medusa_convert_script: str = "medusa/convert_checkpoint.py"
    build_cli: str = "trtllm-build"
    # Inside the container: NVIDIA's python models for preprocessing, postprocessing and the BLS.
    all_models: str = "/app/all_models/inflight_batcher_llm"
    launch_script: str = "/app/scripts/launch_triton_server.py"
    tritonserver: str = "/opt/tritonserver/bin/tritonserver"
    executor_worker: str = "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker"
    # Triton > 24.06 needs these per-GPU pool settings in orchestrator (--multi-model) mode.
    orchestrator_extra_flags: bool = True
    # Request tensor names of the tensorrt_llm model and the BLS (renamed seed / min_tokens later).
    seed_input: str = "random_seed"
    min_tokens_input: str = "min_length"
    # Preprocessing parameter that model.py reads unconditionally (renamed multimodal_model_path later).
    preprocessing_model_path_keys: tuple[str, ...] = ("visual_model_path", "multimodal_model_path")
    # trtllm-build flags.
    spec_mode_flag: str = "--speculative_decoding_mode"
    max_draft_len_flag: str = "--max_draft_len"
    paged_context_fmha_flag: str = "--use_paged_context_fmha"
    generation_logits_flag: str = "--gather_generation_logits"
    kv_cache_type_flag: str = "--kv_cache_type"
    # Values of SpeculativeDecodingMode (an IntFlag) as config.json may store them.
    spec_modes: tuple[tuple[int, str], ...] = ((1, "none"), (2, "draft_tokens_external"), (4, "medusa"),
                                               (8, "lookahead_decoding"), (16, "explicit_draft_tokens"),
                                               (32, "eagle"))
    # Medusa conversion writes max_draft_len from this flag (default 63 = mc_sim_7b_63).
    medusa_token_len_flag: str = "--max_medusa_token_len"
    default_medusa_tree_size: int = 63
    default_medusa_tree_depth: int = 4


ERA = Era()

# Families whose checkpoints go through another family's converter.
CONVERTER_FAMILY = {"llama": "llama", "mistral": "llama", "qwen": "qwen", "gemma": "gemma"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Arch:
    """The shape numbers the memory plan needs (Hugging Face config.json names)."""

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    intermediate_size: int
    tie_word_embeddings: bool = False
    name: str = ""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


# Well-known configs (from the models' published config.json), so a plan works without the files.
KNOWN_ARCHS = {
    "llama-3.1-70b": Arch(80, 8192, 64, 8, 128256, 28672, False, "llama-3.1-70b"),
    "llama-3.1-8b": Arch(32, 4096, 32, 8, 128256, 14336, False, "llama-3.1-8b"),
    "llama-3.2-3b": Arch(28, 3072, 24, 8, 128256, 8192, True, "llama-3.2-3b"),
    "llama-3.2-1b": Arch(16, 2048, 32, 8, 128256, 8192, True, "llama-3.2-1b"),
    "llama-2-7b": Arch(32, 4096, 32, 32, 32000, 11008, False, "llama-2-7b"),
    "llama-2-13b": Arch(40, 5120, 40, 40, 32000, 13824, False, "llama-2-13b"),
}
# Source-name patterns -> KNOWN_ARCHS key (first match wins; Vicuna v1.3/v1.5 are Llama fine-tunes).
ARCH_PATTERNS = [
    (r"llama-?3(\.[0-9])?-70b", "llama-3.1-70b"),
    (r"llama-?3(\.[0-9])?-8b", "llama-3.1-8b"),
    (r"llama-?3\.2-3b", "llama-3.2-3b"),
    (r"llama-?3\.2-1b", "llama-3.2-1b"),
    (r"(vicuna|llama-?2)-7b", "llama-2-7b"),
    (r"(vicuna|llama-?2)-13b", "llama-2-13b"),
]

# Memory-plan constants: rough, documented bounds rather than measurements.
RUNTIME_OVERHEAD_GIB = 2.0  # CUDA context, TensorRT/cuBLAS workspaces, NCCL buffers, per model per GPU
ACTIVATION_FACTOR = 2.0  # TensorRT activation memory vs the plain per-token estimate below
KV_SHARE = 0.9  # part of the free memory handed to KV caches; the rest is left as headroom


class PlanError(ValueError):
    """A spec this backend cannot plan; the message names the key and the fix."""


# ------------------------------------------------------------------------------------------------
# The plan


@dataclass
class Step:
    """One command of the plan: what it makes, the argv, and where its log goes."""

    name: str
    argv: list[str]
    output: Path
    log: Path
    why: str = ""
    env: dict[str, str] = field(default_factory=dict)

    def shell(self) -> str:
        return " ".join(shlex.quote(a) for a in self.argv)


def roles(spec: Spec) -> list[str]:
    """The engines a spec needs: target (+ draft) for draft-target, medusa for Medusa."""
    if spec.has_draft and spec.has_medusa:
        raise PlanError("draft.source and medusa.source are both set; the tensorrt_llm backend serves one drafter "
                        "per spec: set one of them to none (write a second spec for the other method)")
    for key, src in (("target.source", spec.target.source), ("draft.source", spec.draft.source),
                     ("medusa.source", spec.medusa.source)):
        if src in ("train", "smollm2") or src.endswith(".gguf"):
            raise PlanError(f"{key}: got {src!r}; the tensorrt_llm backend converts Hugging Face checkpoint "
                            "directories only: give a directory path (train or export with backend: torch first)")
    if spec.has_medusa:
        return ["medusa"]
    return ["target", "draft"] if spec.has_draft else ["target"]


def num_draft_tokens(spec: Spec) -> int:
    """The draft length requests will use ('auto' plans for the largest, limits.max_draft_len)."""
    k = spec.speculation.num_draft_tokens
    return spec.limits.max_draft_len if k == "auto" else int(k)


def checkpoint_dir(spec: Spec, role: str) -> Path:
    return spec.path(spec.tensorrt_llm.checkpoint_dir) / role


def engine_dir(spec: Spec, role: str) -> Path:
    return spec.engine_dir / role


def log_dir(spec: Spec) -> Path:
    return spec.engine_dir / "logs"


def convert_script(spec: Spec) -> str:
    """The family's convert_checkpoint.py: the first ERA candidate that exists, else the pinned one."""
    family = CONVERTER_FAMILY[spec.target.family]
    base = Path(spec.tensorrt_llm.examples_dir)
    candidates = [base / c.format(family=family) for c in ERA.convert_scripts]
    for c in candidates:
        if c.is_file():
            return str(c)
    return str(candidates[0])


def medusa_choices(spec: Spec) -> list[list[int]] | None:
    return spec.medusa.choices if isinstance(spec.medusa.choices, list) else None


def medusa_token_len(spec: Spec) -> int:
    """max_draft_len of the Medusa engine: the tree size, bounded by limits.max_draft_len."""
    ch = medusa_choices(spec)
    return len(ch) if ch else min(spec.limits.max_draft_len, ERA.default_medusa_tree_size)


def _draft_dtype(spec: Spec) -> str:
    return spec.dtype if spec.draft.dtype == "auto" else spec.draft.dtype


def plan(spec: Spec) -> list[Step]:
    """The ordered commands: convert every checkpoint, then trtllm-build every engine."""
    rs = roles(spec)
    tp, pp = spec.parallel.tp, spec.parallel.pp
    trt = spec.tensorrt_llm
    lim = spec.limits
    logs = log_dir(spec)
    py = "python3"
    steps: list[Step] = []

    def convert(role: str, src: str, dtype: str, tp_: int, pp_: int, extra: list[str], script: str, why: str):
        argv = [py, script, "--model_dir", src, "--output_dir", str(checkpoint_dir(spec, role)), "--dtype", dtype,
                "--tp_size", str(tp_), "--pp_size", str(pp_), "--workers", str(max(1, min(tp_ * pp_, trt.gpus)))]
        steps.append(Step(f"convert-{role}", argv + extra, checkpoint_dir(spec, role), logs / f"convert-{role}.log",
                          why))

    if "target" in rs:
        convert("target", spec.target.source, spec.dtype, tp, pp, [], convert_script(spec),
                f"target checkpoint, {spec.dtype}, TP={tp} PP={pp}")
    if "draft" in rs:
        convert("draft", spec.draft.source, _draft_dtype(spec), trt.draft_tp, 1, [], convert_script(spec),
                f"draft checkpoint, {_draft_dtype(spec)}, TP={trt.draft_tp}")
    if "medusa" in rs:
        med = spec.medusa
        extra = ["--medusa_model_dir", med.source, "--num_medusa_heads", str(med.num_heads),
                 "--num_medusa_layers", str(med.num_layers), ERA.medusa_token_len_flag, str(medusa_token_len(spec))]
        convert("medusa", spec.target.source, spec.dtype, tp, pp, extra,
                str(Path(trt.examples_dir) / ERA.medusa_convert_script),
                f"base model + {med.num_heads} Medusa heads ({med.num_layers} layer(s) each); head count and layers "
                "are explicit because the heads' config.json is unreliable")

    def build(role: str, extra: list[str], why: str):
        ranks = trt.draft_tp if role == "draft" else tp * pp
        workers = str(max(1, min(ranks, trt.gpus)))
        argv = [ERA.build_cli, "--checkpoint_dir", str(checkpoint_dir(spec, role)),
                "--output_dir", str(engine_dir(spec, role)), "--gemm_plugin", trt.gemm_plugin,
                "--max_batch_size", str(lim.max_batch_size), "--max_input_len", str(lim.max_input_len),
                "--max_seq_len", str(lim.max_seq_len), "--max_num_tokens", str(trt.max_num_tokens),
                ERA.kv_cache_type_flag, "paged", "--tokens_per_block", str(trt.tokens_per_block),
                ERA.paged_context_fmha_flag, "enable", "--workers", workers]
        steps.append(Step(f"build-{role}", argv + extra, engine_dir(spec, role), logs / f"build-{role}.log", why))

    logits = [ERA.generation_logits_flag] if spec.speculation.use_draft_logits else []
    if "draft" in rs:
        build("draft", logits, "draft engine: paged context FMHA for KV reuse across BLS iterations"
              + ("; generation logits for logits-based acceptance" if logits else ""))
    if "target" in rs:
        if spec.has_draft:
            build("target", [ERA.spec_mode_flag, "draft_tokens_external", ERA.max_draft_len_flag,
                             str(lim.max_draft_len)] + logits,
                  f"target engine accepting up to {lim.max_draft_len} external draft tokens per step")
        else:
            build("target", [], "target engine (no speculation)")
    if "medusa" in rs:
        build("medusa", [ERA.spec_mode_flag, "medusa", ERA.max_draft_len_flag, str(medusa_token_len(spec))],
              f"Medusa engine, tree of {medusa_token_len(spec)} nodes")
    return steps


def format_plan(spec: Spec, steps: list[Step]) -> str:
    lines = [f"# TensorRT-LLM {ERA.tensorrt_llm} engine plan for {spec.name} "
             f"(container {ERA.image}, tensorrtllm_backend {ERA.backend_tag})"]
    for i, s in enumerate(steps, 1):
        lines.append(f"\n# [{i}/{len(steps)}] {s.name}: {s.why}")
        lines.append(" \\\n    ".join(_argv_lines(s.argv)))
    return "\n".join(lines)


def _argv_lines(argv: list[str]) -> list[str]:
    """Group `--flag value` pairs one per line, as the TensorRT-LLM READMEs print them."""
    out, i = [], 0
    head = []
    while i < len(argv) and not argv[i].startswith("--"):
        head.append(shlex.quote(argv[i]))
        i += 1
    out.append(" ".join(head))
    while i < len(argv):
        part = [argv[i]]
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            part.append(shlex.quote(argv[i + 1]))
            i += 1
        out.append(" ".join(part))
        i += 1
    return out


# ------------------------------------------------------------------------------------------------
# Planned engine configs (what trtllm-build writes), read back by preflight like real ones


def resolve_arch(source: str, override: str = "auto") -> Arch | None:
    """Model shapes: the override key, else <source>/config.json, else a KNOWN_ARCHS name match."""
    if override != "auto":
        if override not in KNOWN_ARCHS:
            raise PlanError(f"got arch {override!r}; known: {', '.join(sorted(KNOWN_ARCHS))} (or 'auto')")
        return KNOWN_ARCHS[override]
    cfg = Path(source) / "config.json"
    if cfg.is_file():
        c = json.loads(cfg.read_text())
        return Arch(c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"],
                    c.get("num_key_value_heads", c["num_attention_heads"]), c["vocab_size"], c["intermediate_size"],
                    bool(c.get("tie_word_embeddings", False)), str(cfg))
    name = Path(source).name.lower()
    for pat, key in ARCH_PATTERNS:
        if re.search(pat, name):
            return KNOWN_ARCHS[key]
    return None


def _pretrained(arch: Arch | None, dtype: str, tp: int, pp: int, architecture: str) -> dict:
    cfg: dict[str, Any] = {"architecture": architecture, "dtype": dtype, "logits_dtype": "float32",
                           "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp}}
    if arch:
        cfg.update(vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, num_hidden_layers=arch.num_hidden_layers,
                   num_attention_heads=arch.num_attention_heads, num_key_value_heads=arch.num_key_value_heads,
                   intermediate_size=arch.intermediate_size, share_embedding_table=False,
                   tie_word_embeddings=arch.tie_word_embeddings)
    return cfg


def planned_engine_configs(spec: Spec) -> dict[str, dict]:
    """config.json as the planned trtllm-build would write it (max_seq_len grows by max_draft_len)."""
    trt, lim = spec.tensorrt_llm, spec.limits
    out: dict[str, dict] = {}
    logits = spec.speculation.use_draft_logits
    for role in roles(spec):
        src = spec.draft.source if role == "draft" else spec.target.source
        key = "draft_arch" if role == "draft" else "target_arch"
        try:
            arch = resolve_arch(src, getattr(trt, key))
        except PlanError as e:
            raise PlanError(f"tensorrt_llm.{key}: {e}") from None
        tp, pp = (trt.draft_tp, 1) if role == "draft" else (spec.parallel.tp, spec.parallel.pp)
        dtype = _draft_dtype(spec) if role == "draft" else spec.dtype
        mode, mdl = "none", 0
        if role == "target" and spec.has_draft:
            mode, mdl = "draft_tokens_external", lim.max_draft_len
        if role == "medusa":
            mode, mdl = "medusa", medusa_token_len(spec)
        pre = _pretrained(arch, dtype, tp, pp, "MedusaForCausalLM" if role == "medusa" else "LlamaForCausalLM")
        if role == "medusa":
            pre.update(num_medusa_heads=spec.medusa.num_heads, num_medusa_layers=spec.medusa.num_layers,
                       max_draft_len=mdl)
        max_num_tokens = max(trt.max_num_tokens, lim.max_batch_size * (mdl + 1)) if mdl else trt.max_num_tokens
        out[role] = {
            "version": ERA.tensorrt_llm,
            "planned": True,
            "pretrained_config": pre,
            "build_config": {
                "max_batch_size": lim.max_batch_size, "max_input_len": lim.max_input_len,
                "max_seq_len": lim.max_seq_len + mdl, "max_num_tokens": max_num_tokens,
                "max_draft_len": mdl, "speculative_decoding_mode": mode,
                "gather_generation_logits": bool(logits and role in ("target", "draft") and spec.has_draft),
                "plugin_config": {"use_paged_context_fmha": True, "tokens_per_block": trt.tokens_per_block,
                                  "paged_kv_cache": True, "gemm_plugin": trt.gemm_plugin},
            },
        }
    return out


def read_engine_configs(spec: Spec) -> dict[str, dict]:
    """The built engines' config.json where present, the planned ones elsewhere."""
    out = planned_engine_configs(spec)
    for role in out:
        p = engine_dir(spec, role) / "config.json"
        if p.is_file():
            out[role] = json.loads(p.read_text())
    return out


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
        ht, hd = _tokenizer_digest(spec.target.source), _tokenizer_digest(spec.draft.source)
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
    mem = memory_plan(spec, cfgs)
    problems += mem.problems
    return problems


# ------------------------------------------------------------------------------------------------
# Memory plan


@dataclass
class ModelMemory:
    role: str
    gpus: list[int]
    weights_gib: float  # per GPU
    activations_gib: float
    overhead_gib: float
    kv_bytes_per_token: int  # per GPU
    tokens_needed: int
    kv_tokens: int = 0  # capacity planned
    kv_fraction: float = 0.0
    max_tokens_in_paged_kv_cache: int = 0


@dataclass
class MemoryPlan:
    gpu_memory_gib: float
    models: dict[str, ModelMemory]
    free_gib: dict[int, float]
    problems: list[str]

    def summary(self) -> str:
        lines = [f"# memory plan per GPU ({self.gpu_memory_gib:g} GiB each)"]
        for m in self.models.values():
            lines.append(f"#   {m.role:7s} GPUs {','.join(map(str, m.gpus))}: weights {m.weights_gib:.1f} GiB, "
                         f"activations {m.activations_gib:.1f} GiB, runtime {m.overhead_gib:.1f} GiB, "
                         f"KV {m.kv_bytes_per_token / 1024:.0f} KiB/token -> capacity {m.kv_tokens} tokens "
                         f"(needs {m.tokens_needed}), kv_cache_free_gpu_mem_fraction {m.kv_fraction:.2f}")
        for p in self.problems:
            lines.append(f"#   PROBLEM: {p}")
        return "\n".join(lines)


GIB = float(1 << 30)


def _param_counts(c: dict, tp: int, pp: int, medusa: tuple[int, int] = (0, 0)) -> tuple[float, int]:
    """(parameters held by the most loaded rank, KV heads per rank) from a pretrained_config."""
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    nh, nkv, inter, vocab = c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"], c["vocab_size"]
    hd = c.get("head_size") or h // nh
    attn = h * nh * hd * 2 + h * nkv * hd * 2
    mlp = 3 * h * inter
    per_layer = attn + mlp + 2 * h
    # Embedding replicated per rank (no --use_parallel_embedding), LM head split on the vocabulary.
    embed = vocab * h
    head = vocab * h / tp
    heads, layers_m = medusa
    med = heads * (layers_m * (h * h + h) + vocab * h) / tp
    kv_heads_rank = max(1, math.ceil(nkv / tp))
    return per_layer * math.ceil(layers / pp) / tp + embed + head + med + h, kv_heads_rank


def memory_plan(spec: Spec, cfgs: dict[str, dict] | None = None) -> MemoryPlan:
    """Weights, activations and KV caches of every model on its GPUs, against tensorrt_llm.gpu_memory_gib.

    The target needs max_batch_size sequences of max_seq_len (+ max_draft_len) tokens in its KV
    cache, the draft max_batch_size x max_seq_len. Free memory after weights, activations and
    runtime overhead is split between the models sharing a GPU in proportion to their need.
    """
    trt, lim = spec.tensorrt_llm, spec.limits
    cfgs = cfgs if cfgs is not None else read_engine_configs(spec)
    problems: list[str] = []
    placement = gpu_placement(spec)
    models: dict[str, ModelMemory] = {}
    for role in roles(spec):
        c = cfgs[role]
        pre = c.get("pretrained_config", {})
        if "hidden_size" not in pre:
            key = "tensorrt_llm.draft_arch" if role == "draft" else "tensorrt_llm.target_arch"
            src = spec.draft.source if role == "draft" else spec.target.source
            problems.append(f"{role}: model shape unknown ({src} is not on this machine and its name matches no "
                            f"known config); set {key} to one of {', '.join(sorted(KNOWN_ARCHS))}")
            continue
        mapping = pre.get("mapping", {})
        tp, pp = int(mapping.get("tp_size", 1)), int(mapping.get("pp_size", 1))
        dtype = pre.get("dtype", spec.dtype)
        nbytes = DTYPE_BYTES.get(dtype, 2)
        med = (int(pre.get("num_medusa_heads", 0)), int(pre.get("num_medusa_layers", 0)))
        params, kvh = _param_counts(pre, tp, pp, med)
        h, nh = pre["hidden_size"], pre["num_attention_heads"]
        hd = pre.get("head_size") or h // nh
        layers_rank = math.ceil(pre["num_hidden_layers"] / pp)
        kv_per_token = 2 * layers_rank * kvh * hd * nbytes
        bc = c.get("build_config", {})
        mdl = int(bc.get("max_draft_len", 0) or 0)
        seq = int(bc.get("max_seq_len", lim.max_seq_len + mdl))
        batch = int(bc.get("max_batch_size", lim.max_batch_size))
        tokens = int(bc.get("max_num_tokens", trt.max_num_tokens))
        per_token_act = nbytes * (4 * h + 3 * math.ceil(nh / tp) * hd + 2 * pre["intermediate_size"] / tp)
        logits = batch * (mdl + 1) * pre["vocab_size"] / tp * 4
        act = (tokens * per_token_act * ACTIVATION_FACTOR + logits) / GIB
        models[role] = ModelMemory(role, placement[role], params * nbytes / GIB, act, RUNTIME_OVERHEAD_GIB,
                                   kv_per_token, batch * seq)
    free: dict[int, float] = {}
    for gpu in sorted({g for m in models.values() for g in m.gpus}):
        on = [m for m in models.values() if gpu in m.gpus]
        used = sum(m.weights_gib + m.activations_gib + m.overhead_gib for m in on)
        free[gpu] = trt.gpu_memory_gib - used
        if free[gpu] <= 0:
            parts = ", ".join(f"{m.role} {m.weights_gib:.1f} GiB weights + {m.activations_gib:.1f} GiB activations"
                              for m in on)
            problems.append(f"GPU {gpu}: {parts} + runtime exceed tensorrt_llm.gpu_memory_gib "
                            f"({trt.gpu_memory_gib:g} GiB) before any KV cache; raise parallel.tp, use a smaller "
                            "dtype or quantized checkpoint, or lower tensorrt_llm.max_num_tokens")
    for gpu, f in free.items():
        if f <= 0:
            continue
        on = [m for m in models.values() if gpu in m.gpus]
        need = {m.role: m.tokens_needed * m.kv_bytes_per_token for m in on}
        total = sum(need.values())
        for m in on:
            share = need[m.role] / total
            alloc = KV_SHARE * share * f * GIB
            tokens = int(alloc // m.kv_bytes_per_token)
            tokens -= tokens % spec.tensorrt_llm.tokens_per_block
            others = sum(KV_SHARE * need[o.role] / total * f for o in on if o is not m)
            # Fraction of the free memory this model sees when it loads last; the token cap keeps a
            # first loader from taking the other's share.
            frac = min(0.95, math.ceil(100 * (alloc / GIB) / max(f - others, 1e-9)) / 100)
            if m.kv_tokens == 0 or tokens < m.kv_tokens:
                m.kv_tokens, m.kv_fraction = tokens, frac
                m.max_tokens_in_paged_kv_cache = tokens
    fixed = trt.kv_cache_free_gpu_mem_fraction
    for m in models.values():
        if any(free.get(g, 0) <= 0 for g in m.gpus):
            continue
        if fixed != "auto":
            f = min(free[g] for g in m.gpus)
            m.kv_fraction = float(fixed)
            m.kv_tokens = min(m.kv_tokens, int(float(fixed) * f * GIB // m.kv_bytes_per_token))
        if m.kv_tokens < m.tokens_needed:
            problems.append(f"{m.role}: KV cache fits {m.kv_tokens} tokens per GPU but max_batch_size x max_seq_len"
                            f"{' (+ max_draft_len)' if m.role != 'draft' else ''} needs {m.tokens_needed}; lower "
                            "limits.max_batch_size or limits.max_seq_len, raise parallel.tp, or give more memory "
                            f"(tensorrt_llm.gpu_memory_gib {trt.gpu_memory_gib:g}"
                            + (f", tensorrt_llm.kv_cache_free_gpu_mem_fraction {fixed}" if fixed != "auto" else "")
                            + ")")
    return MemoryPlan(trt.gpu_memory_gib, models, free, problems)


def gpu_placement(spec: Spec) -> dict[str, list[int]]:
    """GPU ids per model: the target (or Medusa) on 0..tp*pp-1; the draft on the next free GPUs, else shared."""
    n = spec.parallel.tp * spec.parallel.pp
    out = {r: list(range(n)) for r in ("target", "medusa")}
    dtp = spec.tensorrt_llm.draft_tp
    out["draft"] = list(range(n, n + dtp)) if spec.tensorrt_llm.gpus >= n + dtp else list(range(dtp))
    return out


# ------------------------------------------------------------------------------------------------
# Running the plan


def tensorrt_llm_available() -> str | None:
    """None when the engine flow can run here, else the reason it cannot."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        return (f"`import tensorrt_llm` fails in {sys.executable}; run this inside {ERA.image} "
                f"(TensorRT-LLM {ERA.tensorrt_llm}) or an environment with that wheel")
    if shutil.which(ERA.build_cli) is None:
        return f"`{ERA.build_cli}` is not on PATH; install TensorRT-LLM {ERA.tensorrt_llm}"
    return None


def _stamp(step: Step) -> str:
    return hashlib.sha256(json.dumps(step.argv).encode()).hexdigest()


def run_plan(spec: Spec, steps: list[Step], force: bool = False) -> int:
    """Run each step with its output in a log file; skip steps whose output came from the same argv."""
    for i, s in enumerate(steps, 1):
        stamp = s.output / ".pipeline-step.json"
        if not force and stamp.is_file() and json.loads(stamp.read_text()).get("argv_sha256") == _stamp(s):
            print(f"[{i}/{len(steps)}] {s.name}: up to date ({s.output})")
            continue
        s.log.parent.mkdir(parents=True, exist_ok=True)
        print(f"[{i}/{len(steps)}] {s.name}: {s.why}\n    {s.shell()}\n    log: {s.log}", flush=True)
        t0 = time.time()
        with open(s.log, "w") as log:
            proc = subprocess.Popen(s.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env={**os.environ, **s.env})
            assert proc.stdout is not None
            last = t0
            for line in proc.stdout:
                log.write(line)
                if time.time() - last > 30:
                    print(f"    ... {s.name} running {time.time() - t0:.0f}s: {line.strip()[:100]}", flush=True)
                    last = time.time()
            rc = proc.wait()
        if rc != 0:
            tail = s.log.read_text().splitlines()[-20:]
            print(f"[{i}/{len(steps)}] {s.name} FAILED (exit {rc}) after {time.time() - t0:.0f}s; last lines of "
                  f"{s.log}:\n" + "\n".join("    " + t for t in tail), file=sys.stderr)
            return rc
        s.output.mkdir(parents=True, exist_ok=True)
        stamp.write_text(json.dumps({"argv_sha256": _stamp(s), "argv": s.argv}))
        print(f"[{i}/{len(steps)}] {s.name}: done in {time.time() - t0:.0f}s", flush=True)
    return 0


def engine_command(spec: Spec, dry_run: bool, force: bool = False) -> int:
    """`python -m pipeline engine SPEC [--dry-run]` for backend tensorrt_llm."""
    try:
        steps = plan(spec)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_plan(spec, steps))
    mem = memory_plan(spec, planned_engine_configs(spec))
    print("\n" + mem.summary())
    problems = preflight(spec, planned_engine_configs(spec))
    if problems:
        print("\npreflight found problems; fix them before building:", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 2
    if dry_run:
        print(f"\n# dry run: nothing was executed. Next: make repo SPEC=... ; make serve SPEC=... "
              f"(inside {ERA.image})")
        return 0
    why = tensorrt_llm_available()
    if why:
        print(f"\nerror: cannot build here: {why}. Use --dry-run to print the plan.", file=sys.stderr)
        return 3
    missing = [s for s in (spec.target.source, spec.draft.source if spec.has_draft else None,
                           spec.medusa.source if spec.has_medusa else None) if s and not Path(s).is_dir()]
    if missing:
        print(f"error: checkpoint directories not found: {', '.join(missing)} (target.source / draft.source / "
              "medusa.source)", file=sys.stderr)
        return 2
    rc = run_plan(spec, steps, force=force)
    if rc == 0:
        problems = preflight(spec, None)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 2 if problems else 0
    return rc


# ------------------------------------------------------------------------------------------------
# Repository and launch


def repo_command(spec: Spec) -> int:
    """`python -m pipeline repo SPEC` for backend tensorrt_llm: write triton_repo/<name>/."""
    from pipeline.triton.trtllm_repo import write_repo

    try:
        out, copies = write_repo(spec)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    for src, dst, done in copies:
        print(f"  copied {src} -> {dst}/1" if done else f"  to do inside {ERA.image}: cp -r {src} {dst}/")
    if not all(done for *_, done in copies):
        print(f"  (the same commands are in {out.parent / (out.name + '.copy.sh')})")
    return 0


def launch_plan(spec: Spec) -> tuple[list[str], dict[str, str], str]:
    """(argv, env, equivalent launch_triton_server.py line) for the spec's repository.

    One model: leader mode, one tritonserver rank per GPU under mpirun (world size tp*pp); ranks
    above 0 only load tensorrt_llm. Draft-target: two TensorRT-LLM models, which the era's launcher
    serves in orchestrator mode (--multi-model): one tritonserver process (its launcher asserts
    --world_size=1) that spawns each model's tp*pp workers on that model's gpu_device_ids.
    """
    tr = spec.triton
    repo = str(spec.repo_dir.resolve())
    world = spec.parallel.tp * spec.parallel.pp
    common = [f"--model-repository={repo}", f"--grpc-port={tr.grpc_port}", f"--http-port={tr.http_port}",
              f"--metrics-port={tr.metrics_port}", "--disable-auto-complete-config"]
    env: dict[str, str] = {}
    argv = ["mpirun", "--allow-run-as-root"]
    if spec.has_draft:
        env = {"TRTLLM_ORCHESTRATOR": "1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "1"}
        extra = []
        if ERA.orchestrator_extra_flags:
            gpus = sorted({g for r in ("target", "draft") for g in gpu_placement(spec)[r]})
            extra = ["--pinned-memory-pool-byte-size=0", "--enable-peer-access=false"]
            extra += [f"--cuda-memory-pool-byte-size={g}:0" for g in gpus]
        argv += ["-n", "1", ERA.tritonserver, *common, "--backend-config=python,shm-region-prefix-name=prefix0_",
                 *extra]
        launcher = (f"python3 {ERA.launch_script} --model_repo={repo} --multi-model --world_size=1 "
                    f"--grpc_port={tr.grpc_port} --http_port={tr.http_port} --metrics_port={tr.metrics_port} --log")
    else:
        for rank in range(world):
            if rank:
                argv.append(":")
            rank_args = [] if rank == 0 else ["--model-control-mode=explicit", "--load-model=tensorrt_llm"]
            argv += ["-n", "1", ERA.tritonserver, *common, *rank_args,
                     f"--backend-config=python,shm-region-prefix-name=prefix{rank}_"]
        launcher = (f"python3 {ERA.launch_script} --model_repo={repo} --world_size={world} "
                    f"--grpc_port={tr.grpc_port} --http_port={tr.http_port} --metrics_port={tr.metrics_port} --log")
    return argv, env, launcher


def serve_command(spec: Spec, dry_run: bool) -> int:
    """`python -m pipeline serve SPEC [--dry-run]` for backend tensorrt_llm."""
    try:
        argv, env, launcher = launch_plan(spec)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    envs = " ".join(f"{k}={v}" for k, v in env.items())
    print(f"# {ERA.image}: serve {spec.repo_dir}" + (" (orchestrator mode, two TensorRT-LLM models)"
                                                     if spec.has_draft else ""))
    print(f"# equivalent: {launcher}")
    lines, cur = [], []
    for a in argv:
        if a in (":", "-n") or a.startswith("--model-repository") or (a.startswith("--") and cur and cur[0] != "-n"):
            if cur:
                lines.append(" ".join(cur))
            cur = []
        cur.append(shlex.quote(a))
    lines.append(" ".join(cur))
    print((envs + " " if envs else "") + " \\\n    ".join(lines))
    if dry_run:
        return 0
    if not (spec.repo_dir / "tensorrt_llm" / "config.pbtxt").is_file():
        print(f"error: {spec.repo_dir} has no repository; run `make repo SPEC=...` first", file=sys.stderr)
        return 2
    for tool in ("mpirun", ERA.tritonserver):
        if shutil.which(tool) is None:
            print(f"error: {tool} not found; serve inside {ERA.image} (or use --dry-run)", file=sys.stderr)
            return 3
    problems = preflight(spec, None)
    if problems:
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 2
    return subprocess.call(argv, env={**os.environ, **env})


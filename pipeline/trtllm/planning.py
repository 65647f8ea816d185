"""The engine plan: convert every checkpoint, then trtllm-build every engine; and the config.json each would write."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.spec import Spec
from pipeline.trtllm.era import (
    ARCH_PATTERNS,
    ARCHITECTURE,
    CONVERTER_FAMILY,
    ERA,
    KNOWN_ARCHS,
    KV_QUANT_ALGO,
    QUANT,
    Arch,
    PlanError,
)

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


def source(spec: Spec, role: str) -> str:
    """A role's checkpoint directory as the commands see it: relative spec paths resolve against the spec root."""
    src = {"target": spec.target.source, "draft": spec.draft.source, "medusa": spec.medusa.source}[role]
    return str(spec.path(src)) if not Path(src).is_absolute() else src


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


def quantization(spec: Spec, role: str) -> str:
    """The weight quantization of a role's engine (Medusa: the target's)."""
    return spec.draft.quantization if role == "draft" else spec.target.quantization


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
        quant = quantization(spec, role)
        q = QUANT[quant]
        group = spec.draft.group_size if role == "draft" else spec.target.group_size
        out = str(checkpoint_dir(spec, role))
        kv = trt.kv_cache_dtype
        workers = str(max(1, min(tp_ * pp_, trt.gpus)))
        if q["tool"] == "quantize":
            # ModelOpt's script: calibrates, quantizes and writes the unified checkpoint itself.
            argv = [py, str(Path(trt.examples_dir) / ERA.quantize_script), "--model_dir", src, "--output_dir", out,
                    "--dtype", dtype, *q["flags"], "--tp_size", str(tp_), "--pp_size", str(pp_),
                    "--calib_size", "512"]
            if quant in ("int4_awq", "int4_a8"):
                argv += ["--awq_block_size", str(group)]
            if kv != "auto":
                argv += ["--kv_cache_dtype", kv]
            why += f"; {quant} through {ERA.quantize_script}"
        elif spec.target.family == "gemma" and role != "medusa":
            # The Gemma converter has its own flag names (and no pipeline parallelism).
            argv = [py, script, "--ckpt-type", "hf", "--model-dir", src, "--output-model-dir", out,
                    "--dtype", dtype, "--world-size", str(tp_)]
            if quant != "none":
                argv += ["--use-weight-only-with-precision", quant]
        else:
            argv = [py, script, "--model_dir", src, "--output_dir", out, "--dtype", dtype,
                    "--tp_size", str(tp_), "--pp_size", str(pp_), "--workers", workers, *q["flags"]]
            if kv == "int8":
                argv += ["--int8_kv_cache"]
        if quant != "none" and q["tool"] == "convert":
            why += f"; weight-only {quant} ({q['quant_algo']})"
        steps.append(Step(f"convert-{role}", argv + extra, checkpoint_dir(spec, role), logs / f"convert-{role}.log",
                          why))

    if "target" in rs:
        convert("target", source(spec, "target"), spec.dtype, tp, pp, [], convert_script(spec),
                f"target checkpoint, {spec.dtype}, TP={tp} PP={pp}")
    if "draft" in rs:
        convert("draft", source(spec, "draft"), _draft_dtype(spec), trt.draft_tp, 1, [], convert_script(spec),
                f"draft checkpoint, {_draft_dtype(spec)}, TP={trt.draft_tp}")
    if "medusa" in rs:
        med = spec.medusa
        extra = ["--medusa_model_dir", source(spec, "medusa"), "--num_medusa_heads", str(med.num_heads),
                 "--num_medusa_layers", str(med.num_layers), ERA.medusa_token_len_flag, str(medusa_token_len(spec))]
        convert("medusa", source(spec, "target"), spec.dtype, tp, pp, extra,
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
        src = source(spec, "draft" if role == "draft" else "target")
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
        pre = _pretrained(arch, dtype, tp, pp,
                          "MedusaForCausalLM" if role == "medusa" else ARCHITECTURE[spec.target.family])
        quant = quantization(spec, role)
        pre["quantization"] = {"quant_algo": QUANT[quant]["quant_algo"],
                               "kv_cache_quant_algo": KV_QUANT_ALGO[trt.kv_cache_dtype],
                               "group_size": (spec.draft.group_size if role == "draft" else spec.target.group_size)}
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



def gpu_placement(spec: Spec) -> dict[str, list[int]]:
    """GPU ids per model: the target (or Medusa) on 0..tp*pp-1; the draft on the next free GPUs, else shared."""
    n = spec.parallel.tp * spec.parallel.pp
    out = {r: list(range(n)) for r in ("target", "medusa")}
    dtp = spec.tensorrt_llm.draft_tp
    out["draft"] = list(range(n, n + dtp)) if spec.tensorrt_llm.gpus >= n + dtp else list(range(dtp))
    return out


def participant_ids(spec: Spec) -> dict[str, list[int]]:
    """MPI ranks per model in orchestrator mode without spawned processes (fast logits): 0 orchestrates."""
    dtp, n = spec.tensorrt_llm.draft_tp, spec.parallel.tp * spec.parallel.pp
    return {"draft": list(range(1, 1 + dtp)), "target": list(range(1 + dtp, 1 + dtp + n))}


def write_copy_script(script: Path, header: str, commands: list[str]) -> None:
    """`<repo>.copy.sh`: the cp commands that bring the container's own model code into a written repository (its
    code is referenced, never shipped), or no script when everything was copied already."""
    if commands:
        script.write_text(f"#!/bin/sh\n# Run inside {header}\nset -e\n" + "".join(c + "\n" for c in commands))
        script.chmod(0o755)
    elif script.exists():
        script.unlink()

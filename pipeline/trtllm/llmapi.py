"""The llmapi era's plan: Hugging Face checkpoints plus one LLM-API config, for Triton's llmapi model and trtllm-serve.

TensorRT-LLM 1.x (PyTorch backend) loads the checkpoints directly: there is no convert or build step. What a spec
becomes is the argument dict of `LLM(...)` (`llm_args`), written as the Triton model's `1/model.yaml` (with its
`triton_config`) and as trtllm-serve's `--extra_llm_api_options` YAML. Every key and value name comes from
`era.LLMAPI_ERA`, which says where each was read. The memory plan and the checks that need no GPU (tokenizer
identity, draft lengths, FP8 on pre-Ada GPUs, ModelOpt checkpoints) reuse the engine era's code.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import yaml

from pipeline.spec import Spec
from pipeline.trtllm.era import LLMAPI_ERA, PlanError
from pipeline.trtllm.memory import memory_plan
from pipeline.trtllm.planning import num_draft_tokens, planned_engine_configs, source
from pipeline.trtllm.preflight import _tokenizer_digest

QUANT_ALGO = dict(LLMAPI_ERA.quant_algo)


def method(spec: Spec) -> str:
    """The speculative method of this deployment: draft_target, ngram, eagle3 or none."""
    m = spec.tensorrt_llm.speculative
    if m != "auto":
        return m
    if spec.has_draft:
        return "draft_target"
    if spec.tensorrt_llm.eagle3_model != "none":
        return "eagle3"
    return "ngram"


def draft_len(spec: Spec) -> int:
    """max_draft_len of the speculative_config: the spec's k (NGram: prompt_lookup_num_tokens)."""
    if method(spec) == "ngram":
        return spec.speculation.prompt_lookup_num_tokens
    return num_draft_tokens(spec)


def speculative_config(spec: Spec) -> dict[str, Any] | None:
    """The `speculative_config` mapping (decoding_type and its keys, era.LLMAPI_ERA.spec_keys)."""
    e, m = LLMAPI_ERA, method(spec)
    if m == "none":
        return None
    if m == "draft_target":
        return {"decoding_type": e.draft_target, "max_draft_len": draft_len(spec),
                "speculative_model": source(spec, "draft")}
    if m == "eagle3":
        eagle = spec.tensorrt_llm.eagle3_model
        return {"decoding_type": e.eagle3, "max_draft_len": draft_len(spec),
                "speculative_model": str(spec.path(eagle)) if not Path(eagle).is_absolute() else eagle,
                "eagle3_one_model": True}
    return {"decoding_type": e.ngram, "max_draft_len": draft_len(spec),
            "max_matching_ngram_size": spec.speculation.prompt_lookup_max_ngram,
            "is_keep_all": True, "is_use_oldest": True, "is_public_pool": True}


def kv_fraction(spec: Spec) -> float:
    """free_gpu_memory_fraction of the KV cache: the spec's, else what the memory plan leaves for the KV caches."""
    f = spec.tensorrt_llm.kv_cache_free_gpu_mem_fraction
    if f != "auto":
        return float(f)
    mem = memory_plan(spec, planned_engine_configs(spec))
    kv = [m for m in mem.models.values() if m.kv_fraction > 0]
    if not kv:
        return 0.9
    # One LLM holds both caches (Draft_Target runs both models in one executor): their fractions add up.
    return round(min(0.9, sum(m.kv_fraction for m in kv)), 2)


def llm_args(spec: Spec) -> dict[str, Any]:
    """The keyword arguments of `LLM(...)` (era.LLMAPI_ERA.llm_keys), as model.yaml and trtllm-serve take them."""
    lim, trt = spec.limits, spec.tensorrt_llm
    kv: dict[str, Any] = {"free_gpu_memory_fraction": kv_fraction(spec), "enable_block_reuse": True,
                          "tokens_per_block": trt.tokens_per_block}
    if trt.kv_cache_dtype == "fp8":
        kv["dtype"] = "fp8"
    args: dict[str, Any] = {
        "model": source(spec, "target"),
        "backend": LLMAPI_ERA.backend_value,
        "tensor_parallel_size": spec.parallel.tp,
        "pipeline_parallel_size": spec.parallel.pp,
        "dtype": spec.dtype,
        "max_batch_size": lim.max_batch_size,
        "max_input_len": lim.max_input_len,
        "max_seq_len": lim.max_seq_len,
        "max_num_tokens": trt.max_num_tokens,
        "kv_cache_config": kv,
    }
    sc = speculative_config(spec)
    if sc:
        args["speculative_config"] = sc
    unknown = set(args) - set(LLMAPI_ERA.llm_keys) | set(kv) - set(LLMAPI_ERA.kv_cache_keys) | (
        set(sc or {}) - set(LLMAPI_ERA.spec_keys))
    assert not unknown, f"keys not pinned in LLMAPI_ERA: {unknown}"
    return args


def model_yaml(spec: Spec) -> dict[str, Any]:
    """1/model.yaml of Triton's llmapi tensorrt_llm model: LLM(...) keys plus triton_config.

    decoupled: the model streams (its model.py refuses `streaming` otherwise); max_batch_size 0: the model
    takes one prompt per request (model.yaml's own comment: "does not support batching").
    """
    return {**llm_args(spec), LLMAPI_ERA.triton_config_key: {"max_batch_size": 0, "decoupled": True}}


def serve_config(spec: Spec) -> dict[str, Any]:
    """trtllm-serve's --extra_llm_api_options YAML: the LLM(...) keys but `model` (its positional argument)."""
    return {k: v for k, v in llm_args(spec).items() if k != "model"}


def serve_config_path(spec: Spec) -> Path:
    return spec.engine_dir / "trtllm_serve.yaml"


def serve_argv(spec: Spec, config: Path | None = None) -> list[str]:
    """The trtllm-serve command: OpenAI-compatible server on the spec's host and triton.http_port."""
    e = LLMAPI_ERA
    return [e.serve_cli, source(spec, "target"), "--host", spec.triton.host, "--port", str(spec.triton.http_port),
            "--backend", e.backend_value, e.serve_config_flag, str(config or serve_config_path(spec))]


def openai_base_url(spec: Spec) -> str:
    """Where trtllm-serve answers (the OpenAI client's base URL)."""
    return f"http://{spec.triton.host}:{spec.triton.http_port}{LLMAPI_ERA.openai_path}"


def dump_yaml(data: dict) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def format_plan(spec: Spec) -> str:
    """What `python -m pipeline engine SPEC --dry-run` prints for the llmapi era."""
    e = LLMAPI_ERA
    m = method(spec)
    lines = [f"# TensorRT-LLM {e.tensorrt_llm} LLM API plan for {spec.name} (era: llmapi, PyTorch backend; "
             f"wheel {e.wheel}, Triton container {e.image} built from {e.backend_repo}@{e.backend_commit} "
             f"{e.dockerfile})",
             "# No engine build: the Hugging Face checkpoints load directly.",
             f"#   target: {source(spec, 'target')}"]
    if spec.has_draft and m == "draft_target":
        lines.append(f"#   draft:  {source(spec, 'draft')}")
    lines.append(f"# speculation: {m}" + (f" (max_draft_len {draft_len(spec)})" if m != "none" else ""))
    for role, q in (("target", spec.target.quantization), ("draft", spec.draft.quantization)):
        if q != "none" and (role == "target" or spec.has_draft):
            lines.append(f"# {role}.quantization {q}: the checkpoint must be a ModelOpt export "
                         f"({e.quant_config_file} quant_algo {QUANT_ALGO[q]}); the PyTorch backend reads it from there")
    lines.append("\n# LLM(...) arguments (Triton: <repo>/tensorrt_llm/1/model.yaml; trtllm-serve: the YAML below)")
    lines.append(dump_yaml(llm_args(spec)).rstrip())
    lines.append(f"\n# trtllm-serve (OpenAI API at {openai_base_url(spec)}; `validate --api openai` can point there):")
    lines.append(f"# {serve_config_path(spec)}:")
    lines.append("\n".join("#   " + ln for ln in dump_yaml(serve_config(spec)).rstrip().splitlines()))
    lines.append(" ".join(shlex.quote(a) for a in serve_argv(spec)))
    return "\n".join(lines)


def preflight(spec: Spec) -> list[str]:
    """Everything checkable without a GPU: draft lengths, tokenizers, ModelOpt checkpoints, the memory plan."""
    problems: list[str] = []
    m = method(spec)
    k = draft_len(spec)
    if m != "none" and k > spec.limits.max_draft_len:
        key = "speculation.prompt_lookup_num_tokens" if m == "ngram" else "speculation.num_draft_tokens"
        problems.append(f"{key}: {k} draft tokens exceed limits.max_draft_len ({spec.limits.max_draft_len})")
    if m == "draft_target":
        ht, hd = _tokenizer_digest(source(spec, "target")), _tokenizer_digest(source(spec, "draft"))
        if ht and hd and ht != hd:
            problems.append(f"tokenizer files differ between target.source ({spec.target.source}) and draft.source "
                            f"({spec.draft.source}); Draft_Target needs one tokenizer")
        vocab = [_vocab(source(spec, r)) for r in ("target", "draft")]
        if all(vocab) and vocab[0] != vocab[1]:
            problems.append(f"draft vocab_size {vocab[1]} != target vocab_size {vocab[0]}: Draft_Target needs the "
                            "target's vocabulary; pick a draft from the target's family (draft.source)")
    for role, q in (("target", spec.target.quantization), ("draft", spec.draft.quantization)):
        if role == "draft" and not (spec.has_draft and m == "draft_target"):
            continue
        qf = Path(source(spec, role)) / LLMAPI_ERA.quant_config_file
        if q != "none" and Path(source(spec, role)).is_dir():
            algo = _quant_algo(qf)
            if algo != QUANT_ALGO[q]:
                problems.append(f"{role}.quantization: {q} needs a ModelOpt checkpoint with {qf.name} quant_algo "
                                f"{QUANT_ALGO[q]}, {source(spec, role)} has {algo or 'none'}; export one with ModelOpt "
                                f"or set {role}.quantization: none")
    try:
        mem = memory_plan(spec, planned_engine_configs(spec))
    except PlanError as e:
        return problems + [str(e)]
    return problems + mem.problems


def _vocab(d: str) -> int | None:
    p = Path(d) / "config.json"
    try:
        return int(json.loads(p.read_text())["vocab_size"]) if p.is_file() else None
    except (ValueError, KeyError, OSError):
        return None


def _quant_algo(path: Path) -> str | None:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return (d.get("quantization") or {}).get("quant_algo") or d.get("quant_algo")

"""The memory plan: weights, activations and KV caches of every model on its GPUs."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.spec import Spec
from pipeline.trtllm.era import DTYPE_BYTES, KNOWN_ARCHS
from pipeline.trtllm.planning import gpu_placement, read_engine_configs, roles

# Memory-plan constants: rough, documented bounds rather than measurements.
RUNTIME_OVERHEAD_GIB = 2.0  # CUDA context, TensorRT/cuBLAS workspaces, NCCL buffers, per model per GPU
ACTIVATION_FACTOR = 2.0  # TensorRT activation memory vs the plain per-token estimate below
KV_SHARE = 0.9  # part of the free memory handed to KV caches; the rest is left as headroom


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
    precision: str = ""  # dtype, weight quantization and KV-cache quantization, as counted


@dataclass
class MemoryPlan:
    gpu_memory_gib: float
    models: dict[str, ModelMemory]
    free_gib: dict[int, float]
    problems: list[str]

    def summary(self) -> str:
        lines = [f"# memory plan per GPU ({self.gpu_memory_gib:g} GiB each)"]
        for m in self.models.values():
            lines.append(f"#   {m.role:7s} GPUs {','.join(map(str, m.gpus))}: weights {m.weights_gib:.1f} GiB "
                         f"({m.precision}), "
                         f"activations {m.activations_gib:.1f} GiB, runtime {m.overhead_gib:.1f} GiB, "
                         f"KV {m.kv_bytes_per_token / 1024:.0f} KiB/token -> capacity {m.kv_tokens} tokens "
                         f"(needs {m.tokens_needed}), kv_cache_free_gpu_mem_fraction {m.kv_fraction:.2f}")
        for p in self.problems:
            lines.append(f"#   PROBLEM: {p}")
        return "\n".join(lines)


GIB = float(1 << 30)


def _param_split(c: dict, tp: int, pp: int, medusa: tuple[int, int] = (0, 0)) -> tuple[float, float, int]:
    """(linear-layer parameters, other parameters, KV heads) of the most loaded rank, from a pretrained_config.

    Weight-only and FP8 quantization apply to the linear layers of the decoder blocks; embeddings, the LM
    head, norms and Medusa heads keep the model dtype (TensorRT-LLM excludes lm_head by default).
    """
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    nh, nkv, inter, vocab = c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"], c["vocab_size"]
    hd = c.get("head_size") or h // nh
    attn = h * nh * hd * 2 + h * nkv * hd * 2
    mlp = 3 * h * inter
    layers_rank = math.ceil(layers / pp)
    linear = (attn + mlp) * layers_rank / tp
    # Embedding replicated per rank (no --use_parallel_embedding), LM head split on the vocabulary.
    embed = vocab * h
    head = vocab * h / tp
    heads, layers_m = medusa
    med = heads * (layers_m * (h * h + h) + vocab * h) / tp
    kv_heads_rank = max(1, math.ceil(nkv / tp))
    return linear, 2 * h * layers_rank / tp + embed + head + med + h, kv_heads_rank


def _param_counts(c: dict, tp: int, pp: int, medusa: tuple[int, int] = (0, 0)) -> tuple[float, int]:
    """(parameters held by the most loaded rank, KV heads per rank) from a pretrained_config."""
    linear, other, kvh = _param_split(c, tp, pp, medusa)
    return linear + other, kvh


def weight_bytes(pre: dict, tp: int, pp: int, medusa: tuple[int, int] = (0, 0)) -> float:
    """Bytes of weights on the most loaded rank, counting the quantization config.json records."""
    nbytes = DTYPE_BYTES.get(pre.get("dtype", "float16"), 2)
    q = pre.get("quantization") or {}
    algo = q.get("quant_algo")
    linear, other, _ = _param_split(pre, tp, pp, medusa)
    bits = {"W8A16": 8, "W4A16": 4, "W4A16_AWQ": 4, "W4A8_AWQ": 4, "FP8": 8}.get(algo or "")
    if bits is None:
        return (linear + other) * nbytes
    # Weight-only: one dtype scale per output channel (int8) or per group of group_size inputs (int4).
    group = int(q.get("group_size") or 128)
    scales = linear / group * nbytes if bits == 4 else 0.0
    return linear * bits / 8 + scales + other * nbytes


def kv_element_bytes(pre: dict) -> int:
    """Bytes per KV-cache element: 1 for an FP8 or INT8 cache, else the model dtype."""
    q = pre.get("quantization") or {}
    if q.get("kv_cache_quant_algo") in ("FP8", "INT8"):
        return 1
    return DTYPE_BYTES.get(pre.get("dtype", "float16"), 2)


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
        wbytes = weight_bytes(pre, tp, pp, med)
        _, kvh = _param_counts(pre, tp, pp, med)
        h, nh = pre["hidden_size"], pre["num_attention_heads"]
        hd = pre.get("head_size") or h // nh
        layers_rank = math.ceil(pre["num_hidden_layers"] / pp)
        kv_per_token = 2 * layers_rank * kvh * hd * kv_element_bytes(pre)
        bc = c.get("build_config", {})
        mdl = int(bc.get("max_draft_len", 0) or 0)
        seq = int(bc.get("max_seq_len", lim.max_seq_len + mdl))
        batch = int(bc.get("max_batch_size", lim.max_batch_size))
        tokens = int(bc.get("max_num_tokens", trt.max_num_tokens))
        per_token_act = nbytes * (4 * h + 3 * math.ceil(nh / tp) * hd + 2 * pre["intermediate_size"] / tp)
        logits = batch * (mdl + 1) * pre["vocab_size"] / tp * 4
        act = (tokens * per_token_act * ACTIVATION_FACTOR + logits) / GIB
        q = pre.get("quantization") or {}
        precision = dtype + (f" {q['quant_algo']}" if q.get("quant_algo") else "") + (
            f", KV {q['kv_cache_quant_algo']}" if q.get("kv_cache_quant_algo") else "")
        models[role] = ModelMemory(role, placement[role], wbytes / GIB, act, RUNTIME_OVERHEAD_GIB,
                                   kv_per_token, batch * seq, precision=precision)
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


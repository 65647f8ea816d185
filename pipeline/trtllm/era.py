"""The pinned TensorRT-LLM era: every name that changed between releases, the model families and shapes.

TensorRT-LLM cannot be installed on the development machines; everything in `pipeline.trtllm` is a
plan built from these tables, checked here and run where `tensorrt_llm` imports.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    # examples/ layout of the 0.18 container (/app/examples, tensorrtllm_backend's docs at v0.18.0 use
    # tensorrt_llm/examples/<family>/convert_checkpoint.py); models/core/<family>/ came after 0.18.
    convert_scripts: tuple[str, ...] = ("{family}/convert_checkpoint.py", "models/core/{family}/convert_checkpoint.py")
    medusa_convert_script: str = "medusa/convert_checkpoint.py"
    # INT4-AWQ and FP8 (weights and FP8 KV cache) go through ModelOpt's script instead of convert_checkpoint.
    quantize_script: str = "quantization/quantize.py"
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
    # speculative_decoding_fast_logits needs orchestrator mode without spawned processes (0.15+).
    fast_logits: bool = True


# Weight quantization per spec value: how the era makes the checkpoint and what config.json records.
#   tool "convert": the family's convert_checkpoint.py with these flags; "quantize": quantization/quantize.py.
QUANT = {
    "none": {"tool": "convert", "flags": [], "quant_algo": None, "weight_bits": None},
    "int8": {"tool": "convert", "flags": ["--use_weight_only", "--weight_only_precision", "int8"],
             "quant_algo": "W8A16", "weight_bits": 8},
    "int4": {"tool": "convert", "flags": ["--use_weight_only", "--weight_only_precision", "int4"],
             "quant_algo": "W4A16", "weight_bits": 4},
    "int4_awq": {"tool": "quantize", "flags": ["--qformat", "int4_awq"], "quant_algo": "W4A16_AWQ", "weight_bits": 4},
    # int4 weights with 8-bit activations: the torch runtime's int8, TensorRT-LLM's fp8 (Ada, Hopper, Blackwell).
    "int4_a8": {"tool": "quantize", "flags": ["--qformat", "w4a8_awq"], "quant_algo": "W4A8_AWQ", "weight_bits": 4},
    "fp8": {"tool": "quantize", "flags": ["--qformat", "fp8"], "quant_algo": "FP8", "weight_bits": 8},
}
KV_QUANT_ALGO = {"auto": None, "fp8": "FP8", "int8": "INT8"}
# GPU architectures with FP8 tensor cores (Ada sm_89, Hopper sm_90, Blackwell sm_100+).
FP8_ARCHS = ("ada", "hopper", "blackwell")


ERA = Era()

# Families whose checkpoints go through another family's converter.
CONVERTER_FAMILY = {"llama": "llama", "mistral": "llama", "qwen": "qwen", "gemma": "gemma"}
# TensorRT-LLM architecture names written to config.json per family.
ARCHITECTURE = {"llama": "LlamaForCausalLM", "mistral": "LlamaForCausalLM", "qwen": "Qwen2ForCausalLM",
                "gemma": "GemmaForCausalLM"}
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
    "qwen2.5-coder-1.5b": Arch(28, 1536, 12, 2, 151936, 8960, False, "qwen2.5-coder-1.5b"),
    "qwen2.5-coder-0.5b": Arch(24, 896, 14, 2, 151936, 4864, True, "qwen2.5-coder-0.5b"),
}
# Source-name patterns -> KNOWN_ARCHS key (first match wins; Vicuna v1.3/v1.5 are Llama fine-tunes).
ARCH_PATTERNS = [
    (r"llama-?3(\.[0-9])?-70b", "llama-3.1-70b"),
    (r"llama-?3(\.[0-9])?-8b", "llama-3.1-8b"),
    (r"llama-?3\.2-3b", "llama-3.2-3b"),
    (r"llama-?3\.2-1b", "llama-3.2-1b"),
    (r"(vicuna|llama-?2)-7b", "llama-2-7b"),
    (r"(vicuna|llama-?2)-13b", "llama-2-13b"),
    (r"qwen2\.5-coder-1\.5b", "qwen2.5-coder-1.5b"),
    (r"qwen2\.5-coder-0\.5b", "qwen2.5-coder-0.5b"),
]


class PlanError(ValueError):
    """A spec this backend cannot plan; the message names the key and the fix."""


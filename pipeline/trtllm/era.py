"""The pinned TensorRT-LLM era: every name that changed between releases, the model families and shapes.

TensorRT-LLM cannot be installed on the development machines; everything in `pipeline.trtllm` is a
plan built from these tables, checked here and run where `tensorrt_llm` imports.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.contract import MIN_TOKENS_INPUT, SEED_INPUT


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
    # Request tensor names of the tensorrt_llm model and the BLS (renamed seed / min_tokens later): this era's are the
    # client contract's own (pipeline/contract.py).
    seed_input: str = SEED_INPUT
    min_tokens_input: str = MIN_TOKENS_INPUT
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



# ------------------------------------------------------------------------------------------------
# The llmapi era: TensorRT-LLM 1.x, PyTorch backend, HF checkpoints loaded directly (no engine build)


@dataclass(frozen=True)
class LlmapiEra:
    """Every name the llmapi era relies on, each with where it was read (repository, version, path).

    Sources (read, never copied):
    - [W] PyPI `tensorrt-llm` 1.2.1 (2026-04), the newest release in this project's package lists.
    - [D] triton-inference-server/tensorrtllm_backend @ 0b9d7d5 (2026-07-14, main after v1.0.0):
      dockerfile/Dockerfile.triton.trt_llm_backend builds TENSORRTLLM_REPO_TAG=release/1.2.1,
      TENSORRTLLM_VER=1.2.1 on nvcr.io/nvidia/tritonserver:25.12-py3-min and copies
      tensorrt_llm/triton_backend/{scripts,all_models,tools} to /app/{scripts,all_models,tools};
      docs/llmapi.md there (the request and perf-metrics example).
    - [M] NVIDIA/TensorRT-LLM triton_backend/all_models/llmapi/tensorrt_llm/: 1/model.py @ b35ac1b6
      (tensorrt_llm/version.py there: 1.2.0rc2, the release/1.2 line; auto_complete_config, _convert_request,
      _create_response); config.pbtxt and 1/model.yaml @ c8c6df08 (exactly the tensors below; a later stored
      config.pbtxt @ 0a71057 adds the optional `image_url` and LoRA inputs, which we neither send nor declare).
    - [H] NVIDIA/TensorRT-LLM triton_backend/all_models/llmapi/tensorrt_llm/1/helpers.py @ 0df60f9
      (get_sampling_params_from_request: the sampling_param_* names and their defaults).
    - [A] NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/llm_args.py, the release/1.2 form (pydantic
      `decoding_type: Literal[...]`): DecodingBaseConfig.max_draft_len, .speculative_model (alias
      speculative_model_dir), DraftTargetDecodingConfig "Draft_Target" (needs max_draft_len > 0 and
      speculative_model), NGramDecodingConfig "NGram" (max_draft_len, max_matching_ngram_size,
      is_keep_all, is_use_oldest, is_public_pool), Eagle3DecodingConfig "Eagle3" (speculative_model,
      eagle3_one_model), MedusaDecodingConfig.supports_backend: not "pytorch"; BaseLlmArgs (StrictBaseModel,
      extra="forbid"): model, tokenizer, tensor_parallel_size, pipeline_parallel_size, dtype, kv_cache_config,
      speculative_config (discriminator decoding_type), max_batch_size, max_input_len, max_seq_len,
      max_num_tokens; KvCacheConfig: enable_block_reuse, free_gpu_memory_fraction, dtype ("PyTorch backend
      only"), tokens_per_block. (model.yaml's `backend: "pytorch"` is [M]'s.)
    - [S] NVIDIA/TensorRT-LLM tensorrt_llm/commands/serve.py: `@click.option("--config",
      "--extra_llm_api_options", ...)` (the alias pair; 1.0-1.2 releases document --extra_llm_api_options).
    Moving to another release means editing this object only, after reading that release's files.
    """

    tensorrt_llm: str = "1.2.1"  # [W]
    wheel: str = "tensorrt-llm==1.2.1"  # [W]
    # The Triton container: tensorrtllm_backend's Dockerfile at [D] (no NGC tag was read that names 1.2.1).
    backend_repo: str = "triton-inference-server/tensorrtllm_backend"
    backend_commit: str = "0b9d7d5"  # [D]
    dockerfile: str = "dockerfile/Dockerfile.triton.trt_llm_backend"  # [D]
    base_image: str = "nvcr.io/nvidia/tritonserver:25.12-py3-min"  # [D] ARG BASE_IMAGE
    image: str = "tritonserver-trtllm:1.2.1"  # the tag our docs build [D]'s Dockerfile under
    # Inside that container [D]: the llmapi model and the launcher.
    model_dir: str = "/app/all_models/llmapi/tensorrt_llm/1"  # [D] COPY ... all_models all_models
    model_files: tuple[str, ...] = ("model.py", "helpers.py")  # [M] model.py imports helpers
    launch_script: str = "/app/scripts/launch_triton_server.py"  # [D] COPY ... scripts scripts
    # 1/model.yaml [M]: every key but triton_config goes to LLM(...); triton_config sets the Triton config.
    yaml_name: str = "model.yaml"
    yaml_env: str = "LLM_CONFIG_PATH"  # [M] os.environ.get('LLM_CONFIG_PATH', 'model.yaml')
    triton_config_key: str = "triton_config"
    triton_config_keys: tuple[str, ...] = ("max_batch_size", "decoupled")  # [M] auto_complete_config reads both
    backend_value: str = "pytorch"  # [M] model.yaml `backend: "pytorch"`
    # LLM(...) argument names used in model.yaml and trtllm-serve's config [A].
    llm_keys: tuple[str, ...] = ("model", "backend", "tensor_parallel_size", "pipeline_parallel_size", "dtype",
                                 "max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens",
                                 "kv_cache_config", "speculative_config", "tokenizer")
    kv_cache_keys: tuple[str, ...] = ("free_gpu_memory_fraction", "enable_block_reuse", "dtype", "tokens_per_block")
    # speculative_config [A]: the decoding_type values and the keys each takes.
    draft_target: str = "Draft_Target"
    ngram: str = "NGram"
    eagle3: str = "Eagle3"
    spec_keys: tuple[str, ...] = ("decoding_type", "max_draft_len", "speculative_model", "max_matching_ngram_size",
                                  "is_keep_all", "is_use_oldest", "is_public_pool", "eagle3_one_model")
    # The triton model's tensors [M] config.pbtxt: (name, data type, dims, optional).
    inputs: tuple[tuple[str, str, tuple[int, ...], bool], ...] = (
        ("text_input", "TYPE_STRING", (-1,), False),
        ("streaming", "TYPE_BOOL", (1,), True),
        ("sampling_param_best_of", "TYPE_INT32", (1,), True),
        ("sampling_param_temperature", "TYPE_FP32", (1,), True),
        ("sampling_param_top_k", "TYPE_INT32", (1,), True),
        ("sampling_param_top_p", "TYPE_FP32", (1,), True),
        ("sampling_param_frequency_penalty", "TYPE_FP32", (1,), True),
        ("sampling_param_presence_penalty", "TYPE_FP32", (1,), True),
        ("sampling_param_max_tokens", "TYPE_INT32", (1,), True),
        ("sampling_param_stop", "TYPE_STRING", (-1,), True),
        ("sampling_param_seed", "TYPE_UINT64", (1,), True),
        ("sampling_param_exclude_input_from_output", "TYPE_BOOL", (1,), True),
        ("sampling_param_return_perf_metrics", "TYPE_BOOL", (1,), True),
        ("return_finish_reason", "TYPE_BOOL", (1,), True),
        ("return_stop_reason", "TYPE_BOOL", (1,), True),
        ("return_cumulative_logprob", "TYPE_BOOL", (1,), True),
        ("stop", "TYPE_BOOL", (1,), True),
    )
    outputs: tuple[tuple[str, str, tuple[int, ...]], ...] = (
        ("text_output", "TYPE_STRING", (-1,)),
        ("finish_reason", "TYPE_STRING", (-1,)),
        ("stop_reason", "TYPE_STRING", (-1,)),
        ("cumulative_logprob", "TYPE_FP32", (-1,)),
        ("kv_cache_reused_block", "TYPE_INT32", (-1,)),
        ("kv_cache_missed_block", "TYPE_INT32", (-1,)),
        ("kv_cache_alloc_new_blocks", "TYPE_INT32", (-1,)),
        ("kv_cache_alloc_total_blocks", "TYPE_INT32", (-1,)),
        ("kv_cache_hit_rate", "TYPE_FP32", (-1,)),
        ("arrival_time_ns", "TYPE_INT64", (1,)),
        ("first_scheduled_time_ns", "TYPE_INT64", (1,)),
        ("first_token_time_ns", "TYPE_INT64", (1,)),
        ("last_token_time_ns", "TYPE_INT64", (1,)),
        ("acceptance_rate", "TYPE_FP32", (1,)),
        ("total_accepted_draft_tokens", "TYPE_INT32", (1,)),
        ("total_draft_tokens", "TYPE_INT32", (1,)),
    )
    # [M] _create_response: each streamed response carries `output.text`, the text so far (cumulative), and
    # every perf output is sent with text_output's dtype (strings; docs/llmapi.md at [D] shows
    # "acceptance_rate": "0.0"), only when sampling_param_return_perf_metrics is true.
    streamed_text: str = "cumulative"
    perf_outputs_as_strings: bool = True
    # [M] _execute_single_request: "Streaming is only supported in decoupled mode."
    streaming_needs_decoupled: bool = True
    # trtllm-serve [S].
    serve_cli: str = "trtllm-serve"
    serve_config_flag: str = "--extra_llm_api_options"
    serve_flags: tuple[str, ...] = ("--host", "--port", "--backend")
    openai_path: str = "/v1"
    # Methods the PyTorch backend has (docs/source/features/speculative-decoding.md; [A] Medusa refuses pytorch).
    engine_only_methods: tuple[str, ...] = ("medusa", "redrafter", "eagle1/2", "lookahead")
    # Quantization: the PyTorch backend reads it from a ModelOpt checkpoint (hf_quant_config.json quant_algo).
    quant_algo: tuple[tuple[str, str | None], ...] = (("none", None), ("fp8", "FP8"), ("int4_awq", "W4A16_AWQ"),
                                                      ("int4_a8", "W4A8_AWQ"))
    quant_config_file: str = "hf_quant_config.json"


LLMAPI_ERA = LlmapiEra()
ERAS = ("llmapi", "engine")

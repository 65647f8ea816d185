"""Triton model repository for the tensorrt_llm backend, in tensorrtllm_backend's layout.

Models: `ensemble` (preprocessing -> tensorrt_llm -> postprocessing, plus our `perf_metrics`),
`preprocessing`, `tensorrt_llm`, `postprocessing`, `tensorrt_llm_bls`, and `tensorrt_llm_draft`
for draft-target (driven by the BLS through `tensorrt_llm_draft_model_name`). Medusa needs no
extra model: `tensorrt_llm` points at the Medusa engine with `decoding_mode: medusa` and the tree
in `medusa_choices` ("{0}, {0, 0}, ...").

Every config.pbtxt comes from the templates below (ours, filled with `string.Template.substitute`,
so a missing value is an error and no `${...}` survives) and is parsed with Triton's own schema
before it is written. The python models preprocessing, postprocessing and tensorrt_llm_bls run
NVIDIA's `1/` code shipped in the container (ERA.all_models); the writer copies it when that
directory exists and otherwise writes `<repo>.copy.sh` with the cp commands to run in the container.
Our configs declare every tensor and parameter those 0.18-era files look up, so they load as-is.

BLS prompt-in-output trap (draft-target): the BLS loop slices `output_ids` assuming they include
the prompt, so both LLM models are filled with `exclude_input_in_output: false`, and the BLS does
not declare an `exclude_input_in_output` input: a client that sends it gets a clear Triton error
instead of silently corrupted speculation. The `ensemble` keeps the input (it does not speculate
in the two-model setup), so there the prompt is in text_output unless the request excludes it;
without a draft model the default is the torch backend's (prompt excluded).

`perf_metrics` (ours) turns preprocessing's input length and the engine's sequence_length into
num_input_tokens / num_output_tokens, reports the speculation statistics this backend release
cannot (-1 for Medusa, 0 where the ensemble runs the target alone), and answers a `method` it
cannot serve with an error that names the model that can.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from string import Template

from pipeline.contract import ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS, Tensor, _t  # noqa: F401 (re-exported)
from pipeline.spec import Spec
from pipeline.trtllm.era import ERA, PlanError
from pipeline.trtllm.memory import memory_plan
from pipeline.trtllm.planning import (
    engine_dir,
    gpu_placement,
    participant_ids,
    planned_engine_configs,
    roles,
    source,
    write_copy_script,
)
from pipeline.trtllm.preflight import built_engine_problems

LOGITS = "TYPE_FP32"  # logits_datatype: engines keep the default logits_dtype float32

# What NVIDIA's preprocessing/1/model.py (0.18 era) reads or writes by name; declared in full
# because its initialize() looks up the output configs even for multimodal tensors.
PREPROCESSING_INPUTS: list[Tensor] = [
    _t("QUERY", "TYPE_STRING", [1]),
    _t("DECODER_QUERY", "TYPE_STRING", [1], True),
    _t("IMAGE_BYTES", "TYPE_UINT8", [-1, -1, -1, -1], True),
    _t("IMAGE_URL", "TYPE_STRING", [1], True),
    _t("VIDEO_BYTES", "TYPE_UINT8", [-1, -1, -1, -1], True),
    _t("REQUEST_OUTPUT_LEN", "TYPE_INT32", [1]),
    _t("BAD_WORDS_DICT", "TYPE_STRING", [-1], True),
    _t("STOP_WORDS_DICT", "TYPE_STRING", [-1], True),
    _t("EMBEDDING_BIAS_WORDS", "TYPE_STRING", [-1], True),
    _t("EMBEDDING_BIAS_WEIGHTS", "TYPE_FP32", [-1], True),
    _t("END_ID", "TYPE_INT32", [1], True),
    _t("PAD_ID", "TYPE_INT32", [1], True),
    _t("PROMPT_TABLE_EXTRA_ID", "TYPE_UINT64", [1], True),
]
PREPROCESSING_OUTPUTS: list[Tensor] = [
    _t("INPUT_ID", "TYPE_INT32", [-1]),
    _t("REQUEST_INPUT_LEN", "TYPE_INT32", [1]),
    _t("DECODER_INPUT_ID", "TYPE_INT32", [-1]),
    _t("REQUEST_DECODER_INPUT_LEN", "TYPE_INT32", [1]),
    _t("BAD_WORDS_IDS", "TYPE_INT32", [2, -1]),
    _t("STOP_WORDS_IDS", "TYPE_INT32", [2, -1]),
    _t("EMBEDDING_BIAS", "TYPE_FP32", [-1]),
    _t("REQUEST_OUTPUT_LEN", "TYPE_INT32", [-1]),
    _t("OUT_END_ID", "TYPE_INT32", [1]),
    _t("OUT_PAD_ID", "TYPE_INT32", [1]),
    _t("OUT_PROMPT_TABLE_EXTRA_IDS", "TYPE_UINT64", [-1]),
    _t("PIXEL_VALUES", "TYPE_FP16", [-1, -1, -1, -1]),
    _t("ASPECT_RATIO_IDS", "TYPE_INT64", [-1]),
    _t("ASPECT_RATIO_MASK", "TYPE_INT64", [-1, -1]),
    _t("CROSS_ATTENTION_MASK", "TYPE_INT64", [-1, -1, -1]),
    _t("IMAGE_SIZES", "TYPE_INT64", [2]),
    # v0.18's BLS asks preprocessing for all 13 of its _preproc_outputs, this one included.
    _t("IS_VIDEO_INPUT", "TYPE_BOOL", [1]),
]
POSTPROCESSING_INPUTS: list[Tensor] = [
    _t("TOKENS_BATCH", "TYPE_INT32", [-1, -1]),
    _t("SEQUENCE_LENGTH", "TYPE_INT32", [-1]),
]
POSTPROCESSING_OUTPUTS: list[Tensor] = [_t("OUTPUT", "TYPE_STRING", [-1])]


def llm_inputs() -> list[Tensor]:
    """The tensorrt_llm C++ model's request tensors (names of ERA's backend)."""
    s = dict(optional=True, scalar=True)
    return [
        _t("input_ids", "TYPE_INT32", [-1], ragged=True),
        _t("input_lengths", "TYPE_INT32", [1], scalar=True),
        _t("request_output_len", "TYPE_INT32", [1], scalar=True),
        _t("draft_input_ids", "TYPE_INT32", [-1], True, ragged=True),
        _t("draft_logits", LOGITS, [-1, -1], True, ragged=True),
        _t("draft_acceptance_threshold", "TYPE_FP32", [1], **s),
        _t("end_id", "TYPE_INT32", [1], **s),
        _t("pad_id", "TYPE_INT32", [1], **s),
        _t("stop_words_list", "TYPE_INT32", [2, -1], True, ragged=True),
        _t("bad_words_list", "TYPE_INT32", [2, -1], True, ragged=True),
        _t("embedding_bias", "TYPE_FP32", [-1], True, ragged=True),
        _t("beam_width", "TYPE_INT32", [1], **s),
        _t("temperature", "TYPE_FP32", [1], **s),
        _t("runtime_top_k", "TYPE_INT32", [1], **s),
        _t("runtime_top_p", "TYPE_FP32", [1], **s),
        _t("len_penalty", "TYPE_FP32", [1], **s),
        _t("repetition_penalty", "TYPE_FP32", [1], **s),
        _t(ERA.min_tokens_input, "TYPE_INT32", [1], **s),
        _t("presence_penalty", "TYPE_FP32", [1], **s),
        _t("frequency_penalty", "TYPE_FP32", [1], **s),
        _t(ERA.seed_input, "TYPE_UINT64", [1], **s),
        _t("return_log_probs", "TYPE_BOOL", [1], **s),
        _t("return_context_logits", "TYPE_BOOL", [1], **s),
        _t("return_generation_logits", "TYPE_BOOL", [1], **s),
        _t("exclude_input_in_output", "TYPE_BOOL", [1], **s),
        _t("return_kv_cache_reuse_stats", "TYPE_BOOL", [1], **s),
        _t("stop", "TYPE_BOOL", [1], **s),
        _t("streaming", "TYPE_BOOL", [1], **s),
        _t("num_return_sequences", "TYPE_INT32", [1], **s),
        # Sent by the BLS whenever preprocessing returns them (encoder-decoder / prompt-tuning slots).
        _t("decoder_input_ids", "TYPE_INT32", [-1], True, ragged=True),
        _t("prompt_table_extra_ids", "TYPE_UINT64", [-1], True, ragged=True),
        _t("prompt_embedding_table", "TYPE_FP16", [-1, -1], True, ragged=True),
        _t("prompt_vocab_size", "TYPE_INT32", [1], **s),
    ]


LLM_OUTPUTS: list[Tensor] = [
    _t("output_ids", "TYPE_INT32", [-1, -1]),
    _t("sequence_length", "TYPE_INT32", [-1]),
    _t("cum_log_probs", "TYPE_FP32", [-1]),
    _t("output_log_probs", "TYPE_FP32", [-1, -1]),
    _t("context_logits", LOGITS, [-1, -1]),
    _t("generation_logits", LOGITS, [-1, -1, -1]),
    _t("batch_index", "TYPE_INT32", [1]),
    _t("sequence_index", "TYPE_INT32", [1]),
    _t("kv_cache_alloc_new_blocks", "TYPE_INT32", [1]),
    _t("kv_cache_reused_blocks", "TYPE_INT32", [1]),
    _t("kv_cache_alloc_total_blocks", "TYPE_INT32", [1]),
]

PERF_INPUTS: list[Tensor] = [
    _t("REQUEST_INPUT_LEN", "TYPE_INT32", [1]),
    _t("SEQUENCE_LENGTH", "TYPE_INT32", [-1]),
    _t("exclude_input_in_output", "TYPE_BOOL", [1], True),
    _t("return_perf_metrics", "TYPE_BOOL", [1], True),
]
PERF_OUTPUTS: list[Tensor] = [t for t in ENSEMBLE_OUTPUTS if t[0] in (
    "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "num_input_tokens", "num_output_tokens")]
# request_check runs first: it folds seed / min_tokens into the era's names and refuses what the ensemble
# cannot do (a method served elsewhere, draft tokens in a draft-target repository) before any GPU work.
CHECK_INPUTS: list[Tensor] = [
    _t("max_tokens", "TYPE_INT32", [1]),
    _t("seed", "TYPE_UINT64", [1], True),
    _t(ERA.seed_input, "TYPE_UINT64", [1], True),
    _t("min_tokens", "TYPE_INT32", [1], True),
    _t(ERA.min_tokens_input, "TYPE_INT32", [1], True),
    _t("method", "TYPE_STRING", [1], True),
    _t("num_draft_tokens", "TYPE_INT32", [1], True),
    _t("use_draft_logits", "TYPE_BOOL", [1], True),
    _t("disable_at_batch", "TYPE_INT32", [1], True),
]
CHECK_OUTPUTS: list[Tensor] = [
    # max_tokens passes through, so preprocessing waits for the check: a refused request leaves no step
    # running (an ensemble that errors while a parallel step is in flight crashed tritonserver here).
    _t("OUT_MAX_TOKENS", "TYPE_INT32", [1]),
    _t("OUT_RANDOM_SEED", "TYPE_UINT64", [1]),
    _t("OUT_MIN_LENGTH", "TYPE_INT32", [1]),
]

# v0.18's tensorrt_llm_bls request tensors (Request in its lib/decode.py, no multimodal or LoRA here).
NVIDIA_BLS_INPUTS: list[Tensor] = [
    _t("text_input", "TYPE_STRING", [1]),
    _t("decoder_text_input", "TYPE_STRING", [1], True),
    _t("max_tokens", "TYPE_INT32", [1]),
    _t("bad_words", "TYPE_STRING", [-1], True),
    _t("stop_words", "TYPE_STRING", [-1], True),
    _t("exclude_input_in_output", "TYPE_BOOL", [1], True),
    _t("end_id", "TYPE_INT32", [1], True),
    _t("pad_id", "TYPE_INT32", [1], True),
    _t("top_k", "TYPE_INT32", [1], True),
    _t("top_p", "TYPE_FP32", [1], True),
    _t("temperature", "TYPE_FP32", [1], True),
    _t("length_penalty", "TYPE_FP32", [1], True),
    _t("repetition_penalty", "TYPE_FP32", [1], True),
    _t(ERA.min_tokens_input, "TYPE_INT32", [1], True),
    _t("presence_penalty", "TYPE_FP32", [1], True),
    _t("frequency_penalty", "TYPE_FP32", [1], True),
    _t(ERA.seed_input, "TYPE_UINT64", [1], True),
    _t("return_log_probs", "TYPE_BOOL", [1], True, True),
    _t("return_context_logits", "TYPE_BOOL", [1], True, True),
    _t("return_generation_logits", "TYPE_BOOL", [1], True, True),
    _t("num_return_sequences", "TYPE_INT32", [1], True),
    _t("beam_width", "TYPE_INT32", [1], True),
    _t("stream", "TYPE_BOOL", [1], True),
    _t("prompt_embedding_table", "TYPE_FP16", [-1, -1], True),
    _t("prompt_vocab_size", "TYPE_INT32", [1], True),
    _t("prompt_table_extra_id", "TYPE_UINT64", [1], True),
    _t("embedding_bias_words", "TYPE_STRING", [-1], True),
    _t("embedding_bias_weights", "TYPE_FP32", [-1], True),
    _t("num_draft_tokens", "TYPE_INT32", [1], True),
    _t("use_draft_logits", "TYPE_BOOL", [1], True, True),
    _t("return_kv_cache_reuse_stats", "TYPE_BOOL", [1], True, True),
]
# Ours adds the project's contract: the later names, perf metrics, method selection.
CONTRACT_BLS_INPUTS: list[Tensor] = [
    _t("seed", "TYPE_UINT64", [1], True),
    _t("min_tokens", "TYPE_INT32", [1], True),
    _t("return_perf_metrics", "TYPE_BOOL", [1], True),
    _t("method", "TYPE_STRING", [1], True),
    _t("disable_at_batch", "TYPE_INT32", [1], True),
]


def bls_inputs(spec: Spec) -> list[Tensor]:
    """The BLS request tensors: v0.18's for NVIDIA's BLS, plus the project's contract for ours.

    NVIDIA's BLS (bls: nvidia) forwards exclude_input_in_output to both LLM models while its
    draft-target loop slices output_ids assuming they hold the prompt, so with a draft that input is
    left undeclared there: a client sending it gets a clear Triton error, not corrupted speculation.
    It gets return_perf_metrics declared (and ignored: no perf outputs) so the project's client runs.
    """
    if spec.tensorrt_llm.bls == "pipeline":
        return NVIDIA_BLS_INPUTS + CONTRACT_BLS_INPUTS
    ins = [t for t in NVIDIA_BLS_INPUTS if not (spec.has_draft and t[0] == "exclude_input_in_output")]
    return ins + [t for t in CONTRACT_BLS_INPUTS if t[0] == "return_perf_metrics"]


BLS_OUTPUTS: list[Tensor] = [
    _t("text_output", "TYPE_STRING", [-1]),
    _t("cum_log_probs", "TYPE_FP32", [-1]),
    _t("output_log_probs", "TYPE_FP32", [-1, -1]),
    _t("context_logits", LOGITS, [-1, -1]),
    _t("generation_logits", LOGITS, [-1, -1, -1]),
    _t("batch_index", "TYPE_INT32", [1]),
    _t("sequence_index", "TYPE_INT32", [1]),
    _t("kv_cache_alloc_new_blocks", "TYPE_INT32", [1]),
    _t("kv_cache_reused_blocks", "TYPE_INT32", [1]),
    _t("kv_cache_alloc_total_blocks", "TYPE_INT32", [1]),
]

# Ensemble wiring: (model, {model input: ensemble tensor}, {model output: ensemble tensor}).
ENSEMBLE_STEPS: list[tuple[str, dict[str, str], dict[str, str]]] = [
    ("request_check",
     {n: n for n, *_ in CHECK_INPUTS},
     {"OUT_MAX_TOKENS": "_MAX_TOKENS", "OUT_RANDOM_SEED": "_RANDOM_SEED", "OUT_MIN_LENGTH": "_MIN_LENGTH"}),
    ("preprocessing",
     {"QUERY": "text_input", "DECODER_QUERY": "decoder_text_input", "REQUEST_OUTPUT_LEN": "_MAX_TOKENS",
      "BAD_WORDS_DICT": "bad_words", "STOP_WORDS_DICT": "stop_words", "EMBEDDING_BIAS_WORDS": "embedding_bias_words",
      "EMBEDDING_BIAS_WEIGHTS": "embedding_bias_weights", "END_ID": "end_id", "PAD_ID": "pad_id"},
     {"INPUT_ID": "_INPUT_ID", "DECODER_INPUT_ID": "_DECODER_INPUT_ID", "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN",
      "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN", "BAD_WORDS_IDS": "_BAD_WORDS_IDS",
      "STOP_WORDS_IDS": "_STOP_WORDS_IDS", "EMBEDDING_BIAS": "_EMBEDDING_BIAS", "OUT_END_ID": "_END_ID",
      "OUT_PAD_ID": "_PAD_ID"}),
    ("tensorrt_llm",
     {"input_ids": "_INPUT_ID", "decoder_input_ids": "_DECODER_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN",
      "request_output_len": "_REQUEST_OUTPUT_LEN", "end_id": "_END_ID", "pad_id": "_PAD_ID",
      "stop_words_list": "_STOP_WORDS_IDS", "bad_words_list": "_BAD_WORDS_IDS", "embedding_bias": "_EMBEDDING_BIAS",
      "runtime_top_k": "top_k", "runtime_top_p": "top_p", "temperature": "temperature",
      ERA.seed_input: "_RANDOM_SEED", ERA.min_tokens_input: "_MIN_LENGTH",
      "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
      "frequency_penalty": "frequency_penalty", "len_penalty": "length_penalty", "beam_width": "beam_width",
      "num_return_sequences": "num_return_sequences", "return_log_probs": "return_log_probs",
      "return_context_logits": "return_context_logits", "return_generation_logits": "return_generation_logits",
      "return_kv_cache_reuse_stats": "return_kv_cache_reuse_stats",
      "exclude_input_in_output": "exclude_input_in_output", "streaming": "stream"},
     {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH", "cum_log_probs": "cum_log_probs",
      "output_log_probs": "output_log_probs"}),
    ("postprocessing",
     {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"},
     {"OUTPUT": "text_output"}),
    ("perf_metrics",
     {"REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH",
      "exclude_input_in_output": "exclude_input_in_output", "return_perf_metrics": "return_perf_metrics"},
     {n: n for n, *_ in PERF_OUTPUTS}),
]

# ------------------------------------------------------------------------------------------------
# Templates

CONFIG_TEMPLATE = Template("""\
# Generated by pipeline.trtllm.engine_repo for spec "${spec_name}" (tensorrtllm_backend ${era}).
name: "${name}"
${kind}
max_batch_size: ${max_batch_size}
${policy}${batching}input [
${inputs}
]
output [
${outputs}
]
${body}""")

TENSOR_TEMPLATE = Template("""\
  {
    name: "${name}"
    data_type: ${dtype}
    dims: [ ${dims} ]${extra}
  }""")

PARAM_TEMPLATE = Template("""\
parameters {
  key: "${key}"
  value: { string_value: "${value}" }
}
""")

STEP_TEMPLATE = Template("""\
    {
      model_name: "${model}"
      model_version: -1
${maps}
    }""")

INSTANCE_TEMPLATE = Template("""\
instance_group [
  {
    count: ${count}
    kind: KIND_CPU
  }
]
""")

# Our python models of the repository: real modules next to this file, copied as <model>/1/model.py.
MODELS_DIR = Path(__file__).resolve().parent / "engine_models"
OUR_MODELS = {"perf_metrics": "perf_metrics.py", "request_check": "request_check.py"}


def _tensor_text(t: Tensor) -> str:
    name, dtype, dims, optional, scalar, ragged = t
    extra = ""
    if scalar:
        extra += "\n    reshape: { shape: [ ] }"
    if optional:
        extra += "\n    optional: true"
    if ragged:
        extra += "\n    allow_ragged_batch: true"
    return TENSOR_TEMPLATE.substitute(name=name, dtype=dtype, dims=", ".join(map(str, dims)), extra=extra)


def _params_text(params: dict[str, str]) -> str:
    return "".join(PARAM_TEMPLATE.substitute(key=k, value=str(v).replace('"', '\\"')) for k, v in params.items())


def _maps_text(kind: str, mapping: dict[str, str]) -> str:
    return "\n".join(f'      {kind} {{ key: "{k}" value: "{v}" }}' for k, v in mapping.items())


def render(spec: Spec, name: str, kind: str, inputs: list[Tensor], outputs: list[Tensor], *, params=None,
           instances: int | None = None, decoupled: bool | None = None, batching: str = "", steps=None) -> str:
    """One config.pbtxt from CONFIG_TEMPLATE; `substitute` raises on any unfilled key."""
    body = ""
    if steps:
        step_text = ",\n".join(STEP_TEMPLATE.substitute(
            model=m, maps="\n".join(filter(None, [_maps_text("input_map", i), _maps_text("output_map", o)])))
            for m, i, o in steps)
        body += f"ensemble_scheduling {{\n  step [\n{step_text}\n  ]\n}}\n"
    if params:
        body += _params_text(params)
    if instances is not None:
        body += INSTANCE_TEMPLATE.substitute(count=instances)
    policy = "" if decoupled is None else f"model_transaction_policy {{\n  decoupled: {str(decoupled).lower()}\n}}\n"
    return CONFIG_TEMPLATE.substitute(
        spec_name=spec.name, era=ERA.backend_tag, name=name, kind=kind, max_batch_size=spec.limits.max_batch_size,
        policy=policy, batching=batching, inputs=",\n".join(map(_tensor_text, inputs)),
        outputs=",\n".join(map(_tensor_text, outputs)), body=body)


def parse_config(text: str):
    """Parse config.pbtxt text with Triton's ModelConfig schema (raises on any unknown field)."""
    # lazy: tritonclient.grpc (~0.5 s, grpc) and protobuf, only where a config is written or read
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(text, model_config_pb2.ModelConfig())


# ------------------------------------------------------------------------------------------------
# The repository


def medusa_choices_text(choices: list[list[int]]) -> str:
    """medusa_choices in the backend's brace format: "{0}, {0, 0}, {1}"."""
    return ", ".join("{" + ", ".join(map(str, p)) + "}" for p in choices)


def exclude_default(spec: Spec) -> str:
    """text_output without the prompt, like the torch backend, except where the BLS trap forbids it.

    Draft-target: the BLS loop needs output_ids with the prompt, and the target model is shared
    with the ensemble, so there the prompt is included unless a request sends
    exclude_input_in_output=true to the ensemble.
    """
    return "false" if spec.has_draft else "true"


def _llm_params(spec: Spec, role: str, mem) -> dict[str, str]:
    trt = spec.tensorrt_llm
    m = mem.models.get(role)
    p = {
        "max_beam_width": "1",
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": str(engine_dir(spec, role).resolve()),
        "executor_worker_path": ERA.executor_worker,
        "batch_scheduler_policy": "guaranteed_no_evict",
        "kv_cache_free_gpu_mem_fraction": f"{m.kv_fraction:.2f}" if m else str(trt.kv_cache_free_gpu_mem_fraction),
        "enable_kv_cache_reuse": "true" if spec.has_draft else "false",
        "exclude_input_in_output": exclude_default(spec),
        "enable_chunked_context": "false",
    }
    if m and m.max_tokens_in_paged_kv_cache and spec.has_draft:
        p["max_tokens_in_paged_kv_cache"] = str(m.max_tokens_in_paged_kv_cache)
    if spec.has_draft:
        p["gpu_device_ids"] = ",".join(map(str, gpu_placement(spec)[role]))
    if spec.has_draft and trt.fast_logits:
        # Orchestrator mode without spawned processes: the ranks each model runs on (rank 0 orchestrates).
        p["speculative_decoding_fast_logits"] = "1"
        p["participant_ids"] = ",".join(map(str, participant_ids(spec)[role]))
    if role == "medusa":
        p["decoding_mode"] = "medusa"
        if isinstance(spec.medusa.choices, list):
            p["medusa_choices"] = medusa_choices_text(spec.medusa.choices)
    return p


def llm_queue_delay_us(spec: Spec) -> int:
    """Dynamic-batching delay of the LLM models: 0 for draft-target (the BLS calls draft and target in turn,
    every round, as NVIDIA's draft-target recipe fills it), else triton.max_queue_delay_us."""
    return 0 if spec.has_draft else spec.triton.max_queue_delay_us


def bls_params(spec: Spec) -> dict[str, str]:
    """tensorrt_llm_bls parameters: v0.18's keys, plus what our BLS reads."""
    p = {"accumulate_tokens": "false", "tensorrt_llm_model_name": "tensorrt_llm",
         "tensorrt_llm_draft_model_name": "tensorrt_llm_draft" if spec.has_draft else "",
         "multimodal_encoders_name": ""}
    if spec.tensorrt_llm.bls == "pipeline":
        k = spec.speculation.num_draft_tokens
        p.update({"default_num_draft_tokens": str(spec.limits.max_draft_len if k == "auto" else k),
                  "max_draft_len": str(spec.limits.max_draft_len),
                  "use_draft_logits": str(spec.speculation.use_draft_logits).lower(),
                  "exclude_input_in_output": "true",
                  "engine_method": "medusa" if spec.has_medusa else "baseline",
                  "max_concurrency": str(max(spec.limits.max_batch_size, spec.triton.instance_count))})
    return p


def build_configs(spec: Spec, python_path: str = "") -> dict[str, str]:
    """{model name: config.pbtxt text} for every model of the repository.

    `python_path` (colon-separated) is prepended to sys.path by our python models before they import
    anything but the standard library; only needed outside the container (the tests' tritonserver).
    """
    rs = roles(spec)
    lim, tr = spec.limits, spec.triton
    mem = memory_plan(spec, planned_engine_configs(spec))
    tokenizer = source(spec, "target")
    llm_role = "medusa" if "medusa" in rs else "target"
    decoupled = spec.tensorrt_llm.decoupled
    queue = (f"dynamic_batching {{\n  preferred_batch_size: [ {lim.max_batch_size} ]\n"
             f"  max_queue_delay_microseconds: {llm_queue_delay_us(spec)}\n"
             "  default_queue_policy: { max_queue_size: 0 }\n}\n")
    pre_params = {"tokenizer_dir": tokenizer, "add_special_tokens": "true", "max_num_images": "",
                  **{k: "" for k in ERA.preprocessing_model_path_keys},
                  "gpt_model_path": str(engine_dir(spec, llm_role).resolve())}
    ours = spec.tensorrt_llm.bls == "pipeline"
    bls_outputs = BLS_OUTPUTS + (PERF_OUTPUTS if ours else [])
    out = {
        "ensemble": render(spec, "ensemble", 'platform: "ensemble"', ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS,
                           steps=ENSEMBLE_STEPS),
        "request_check": render(spec, "request_check", 'backend: "python"', CHECK_INPUTS, CHECK_OUTPUTS,
                                params=check_params(spec, python_path), instances=tr.instance_count),
        "preprocessing": render(spec, "preprocessing", 'backend: "python"', PREPROCESSING_INPUTS,
                                PREPROCESSING_OUTPUTS, params=pre_params, instances=tr.instance_count),
        "postprocessing": render(spec, "postprocessing", 'backend: "python"', POSTPROCESSING_INPUTS,
                                 POSTPROCESSING_OUTPUTS, params={"tokenizer_dir": tokenizer,
                                                                 "skip_special_tokens": "true"},
                                 instances=tr.instance_count),
        "perf_metrics": render(spec, "perf_metrics", 'backend: "python"', PERF_INPUTS, PERF_OUTPUTS,
                               params=perf_params(spec, python_path), instances=tr.instance_count),
        "tensorrt_llm": render(spec, "tensorrt_llm", 'backend: "tensorrtllm"', llm_inputs(), LLM_OUTPUTS,
                               params=_llm_params(spec, llm_role, mem), instances=1, decoupled=decoupled,
                               batching=queue),
        # Ours is decoupled (streams draft-target rounds) or not (answers unary infer) as triton.decoupled says, the
        # key that makes the torch backend's served models stream; NVIDIA's follows the LLM models.
        "tensorrt_llm_bls": render(spec, "tensorrt_llm_bls", 'backend: "python"', bls_inputs(spec), bls_outputs,
                                   params={**bls_params(spec), **({"python_path": python_path} if ours else {})},
                                   instances=tr.instance_count, decoupled=tr.decoupled if ours else decoupled),
    }
    if spec.has_draft:
        out["tensorrt_llm_draft"] = render(spec, "tensorrt_llm_draft", 'backend: "tensorrtllm"', llm_inputs(),
                                           LLM_OUTPUTS, params=_llm_params(spec, "draft", mem), instances=1,
                                           decoupled=decoupled, batching=queue)
    for name, text in out.items():
        if "${" in text:
            raise PlanError(f"{name}/config.pbtxt: unfilled template parameter left: {text[text.index('${'):][:40]}")
        parse_config(text)
    return out


def perf_params(spec: Spec, python_path: str = "") -> dict[str, str]:
    """What perf_metrics must know: whether the ensemble's engine speculates, and the prompt default."""
    return {"exclude_input_in_output": exclude_default(spec), "method": "medusa" if spec.has_medusa else "baseline",
            "python_path": python_path}


def check_params(spec: Spec, python_path: str = "") -> dict[str, str]:
    """What request_check must know: the ensemble's method and where the other methods are served."""
    if spec.has_medusa:
        method, other = "medusa", ""
    else:
        method, other = "baseline", "draft_target=tensorrt_llm_bls" if spec.has_draft else ""
    return {"method": method, "other_methods": other, "draft_model": "true" if spec.has_draft else "false",
            "python_path": python_path}


CONTAINER_MODELS = ("preprocessing", "postprocessing", "tensorrt_llm_bls")


def container_models(spec: Spec) -> tuple[str, ...]:
    """NVIDIA's python models this repository runs (ours replaces the BLS with bls: pipeline)."""
    return tuple(m for m in CONTAINER_MODELS if not (m == "tensorrt_llm_bls" and spec.tensorrt_llm.bls == "pipeline"))


def engine_todo(spec: Spec) -> list[str]:
    """Engines the repository points at that are not built here yet (a wrong built one is an error)."""
    todo = []
    for role in roles(spec):
        problems = built_engine_problems(spec, role)
        if not (engine_dir(spec, role) / "config.json").is_file():
            todo += problems
        elif problems:
            raise PlanError("; ".join(problems))
    return todo


def write_repo(spec: Spec, container_models_dir: str | Path = ERA.all_models,
               python_path: str = "") -> tuple[Path, list[tuple[str, str, bool]]]:
    """Write triton_repo/<name>/ (replacing it whole); returns (path, [(src, dst, copied)]).

    A built engine under engines/<name>/ of another TensorRT-LLM release, or without all its
    rank*.engine files, is an error here, before a repository points at it.
    """
    configs = build_configs(spec, python_path)
    engine_todo(spec)
    dest = spec.repo_dir
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    copies: list[tuple[str, str, bool]] = []
    ours = dict(OUR_MODELS, **({"tensorrt_llm_bls": "bls.py"} if spec.tensorrt_llm.bls == "pipeline" else {}))
    try:
        for name, text in configs.items():
            (tmp / name / "1").mkdir(parents=True)
            (tmp / name / "config.pbtxt").write_text(text)
        for name, module in ours.items():
            shutil.copyfile(MODELS_DIR / module, tmp / name / "1" / "model.py")
        for name in container_models(spec):
            src = Path(container_models_dir) / name / "1"
            done = src.is_dir()
            if done:
                shutil.copytree(src, tmp / name / "1", dirs_exist_ok=True)
            # What is not here is copied inside the container, from the container's own path.
            copies.append((str(src) if done else f"{ERA.all_models}/{name}/1", str(dest / name), done))
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_copy_script(dest.parent / f"{dest.name}.copy.sh", ERA.image + ": NVIDIA's python models for this repository.",
                      [f"cp -r {s} {d}/" for s, d, done in copies if not done])
    return dest, copies


def ensemble_io(spec: Spec | None = None) -> tuple[list[tuple[str, str, list[int]]], list[tuple[str, str, list[int]]]]:
    """The client-visible `ensemble` inputs and outputs as (name, data type, dims)."""
    return ([(n, d, list(dims)) for n, d, dims, *_ in ENSEMBLE_INPUTS],
            [(n, d, list(dims)) for n, d, dims, *_ in ENSEMBLE_OUTPUTS])

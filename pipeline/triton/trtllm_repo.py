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

from pipeline.spec import Spec
from pipeline.trtllm.era import ERA, PlanError
from pipeline.trtllm.memory import memory_plan
from pipeline.trtllm.planning import engine_dir, gpu_placement, planned_engine_configs, roles

# (name, data type, dims, optional, reshape-to-scalar, ragged)
Tensor = tuple[str, str, list[int], bool, bool, bool]


def _t(name: str, dtype: str, dims: list[int], optional: bool = False, scalar: bool = False,
       ragged: bool = False) -> Tensor:
    return (name, dtype, dims, optional, scalar, ragged)


LOGITS = "TYPE_FP32"  # logits_datatype: engines keep the default logits_dtype float32

# The client contract: what `ensemble` accepts and returns (DESIGN.md "Client contract").
ENSEMBLE_INPUTS: list[Tensor] = [
    _t("text_input", "TYPE_STRING", [1]),
    _t("max_tokens", "TYPE_INT32", [1]),
    _t("bad_words", "TYPE_STRING", [-1], True),
    _t("stop_words", "TYPE_STRING", [-1], True),
    _t("end_id", "TYPE_INT32", [1], True),
    _t("pad_id", "TYPE_INT32", [1], True),
    _t("top_k", "TYPE_INT32", [1], True),
    _t("top_p", "TYPE_FP32", [1], True),
    _t("temperature", "TYPE_FP32", [1], True),
    _t("seed", "TYPE_UINT64", [1], True),
    _t("min_tokens", "TYPE_INT32", [1], True),
    _t("repetition_penalty", "TYPE_FP32", [1], True),
    _t("presence_penalty", "TYPE_FP32", [1], True),
    _t("frequency_penalty", "TYPE_FP32", [1], True),
    _t("length_penalty", "TYPE_FP32", [1], True),
    _t("return_log_probs", "TYPE_BOOL", [1], True),
    _t("exclude_input_in_output", "TYPE_BOOL", [1], True),
    _t("stream", "TYPE_BOOL", [1], True),
    _t("return_perf_metrics", "TYPE_BOOL", [1], True),
    _t("num_draft_tokens", "TYPE_INT32", [1], True),
    _t("use_draft_logits", "TYPE_BOOL", [1], True),
    _t("method", "TYPE_STRING", [1], True),
    _t("disable_at_batch", "TYPE_INT32", [1], True),
]
ENSEMBLE_OUTPUTS: list[Tensor] = [
    _t("text_output", "TYPE_STRING", [-1]),
    _t("cum_log_probs", "TYPE_FP32", [-1]),
    _t("output_log_probs", "TYPE_FP32", [-1, -1]),
    _t("acceptance_rate", "TYPE_FP32", [1]),
    _t("total_accepted_draft_tokens", "TYPE_INT32", [1]),
    _t("total_draft_tokens", "TYPE_INT32", [1]),
    _t("num_input_tokens", "TYPE_INT32", [1]),
    _t("num_output_tokens", "TYPE_INT32", [1]),
]

# What NVIDIA's preprocessing/1/model.py (0.18 era) reads or writes by name; declared in full
# because its initialize() looks up the output configs even for multimodal tensors.
PREPROCESSING_INPUTS: list[Tensor] = [
    _t("QUERY", "TYPE_STRING", [1]),
    _t("DECODER_QUERY", "TYPE_STRING", [1], True),
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
    _t("IMAGE_SIZES", "TYPE_INT64", [2]),
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
    _t("num_draft_tokens", "TYPE_INT32", [1], True),
    _t("use_draft_logits", "TYPE_BOOL", [1], True),
    _t("method", "TYPE_STRING", [1], True),
    _t("disable_at_batch", "TYPE_INT32", [1], True),
]
PERF_OUTPUTS: list[Tensor] = [t for t in ENSEMBLE_OUTPUTS if t[0] in (
    "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "num_input_tokens", "num_output_tokens")]


def bls_inputs(spec: Spec) -> list[Tensor]:
    """The BLS request tensors NVIDIA's tensorrt_llm_bls (0.18) reads; see the module note on the trap."""
    ins = [
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
        _t("beam_width", "TYPE_INT32", [1], True),
        _t("stream", "TYPE_BOOL", [1], True),
        _t("embedding_bias_words", "TYPE_STRING", [-1], True),
        _t("embedding_bias_weights", "TYPE_FP32", [-1], True),
        _t("prompt_embedding_table", "TYPE_FP16", [-1, -1], True),
        _t("prompt_vocab_size", "TYPE_INT32", [1], True),
        _t("prompt_table_extra_id", "TYPE_UINT64", [1], True),
        _t("num_draft_tokens", "TYPE_INT32", [1], True),
        _t("use_draft_logits", "TYPE_BOOL", [1], True, True),
    ]
    if spec.has_draft:
        ins = [t for t in ins if t[0] != "exclude_input_in_output"]
    return ins


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
    ("preprocessing",
     {"QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "BAD_WORDS_DICT": "bad_words",
      "STOP_WORDS_DICT": "stop_words", "END_ID": "end_id", "PAD_ID": "pad_id"},
     {"INPUT_ID": "_INPUT_ID", "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN", "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN",
      "BAD_WORDS_IDS": "_BAD_WORDS_IDS", "STOP_WORDS_IDS": "_STOP_WORDS_IDS", "OUT_END_ID": "_END_ID",
      "OUT_PAD_ID": "_PAD_ID"}),
    ("tensorrt_llm",
     {"input_ids": "_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN", "request_output_len": "_REQUEST_OUTPUT_LEN",
      "end_id": "_END_ID", "pad_id": "_PAD_ID", "stop_words_list": "_STOP_WORDS_IDS",
      "bad_words_list": "_BAD_WORDS_IDS", "runtime_top_k": "top_k", "runtime_top_p": "top_p",
      "temperature": "temperature", ERA.seed_input: "seed", ERA.min_tokens_input: "min_tokens",
      "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
      "frequency_penalty": "frequency_penalty", "len_penalty": "length_penalty",
      "return_log_probs": "return_log_probs", "exclude_input_in_output": "exclude_input_in_output",
      "streaming": "stream"},
     {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH", "cum_log_probs": "cum_log_probs",
      "output_log_probs": "output_log_probs"}),
    ("postprocessing",
     {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"},
     {"OUTPUT": "text_output"}),
    ("perf_metrics",
     {"REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH",
      "exclude_input_in_output": "exclude_input_in_output", "return_perf_metrics": "return_perf_metrics",
      "num_draft_tokens": "num_draft_tokens", "use_draft_logits": "use_draft_logits", "method": "method",
      "disable_at_batch": "disable_at_batch"},
     {n: n for n, *_ in PERF_OUTPUTS}),
]

# ------------------------------------------------------------------------------------------------
# Templates

CONFIG_TEMPLATE = Template("""\
# Generated by pipeline.triton.trtllm_repo for spec "${spec_name}" (tensorrtllm_backend ${era}).
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

PERF_MODEL_PY = '''\
"""perf_metrics: per-response token counts and speculation statistics for the ensemble.

Generated by pipeline.triton.trtllm_repo. tensorrtllm_backend ${era} reports no per-request
acceptance. With a Medusa engine the ensemble speculates but the three statistics are -1 ("not
reported"); in a draft-target deployment the ensemble runs the target alone (draft-target runs
through tensorrt_llm_bls), so they are 0. num_input_tokens and num_output_tokens are exact.
A `method` the ensemble cannot serve is an error that names the model that can; so is a
`disable_at_batch` above 0 on a speculating ensemble (in-flight batching cannot switch it off).
"""

import json
import sys

np = pb_utils = None


class TritonPythonModel:
    def initialize(self, args):
        global np, pb_utils
        params = json.loads(args["model_config"]).get("parameters", {})
        get = lambda k, d: params.get(k, {}).get("string_value", d)
        # Optional site-packages to import numpy from (empty in the container).
        sys.path[:0] = [p for p in get("python_path", "").split(":") if p]
        import numpy as np
        import triton_python_backend_utils as pb_utils

        self.exclude_default = get("exclude_input_in_output", "false").lower() in ("1", "true", "yes")
        self.method = get("method", "baseline")
        self.speculates = self.method != "baseline"
        self.elsewhere = {m: w for m, _, w in (x.partition("=") for x in get("other_methods", "").split(";") if x)}

    def _method_error(self, request):
        t = pb_utils.get_input_tensor_by_name(request, "method")
        if t is None:
            return None
        want = t.as_numpy().reshape(-1)[0]
        want = (want.decode() if isinstance(want, bytes) else str(want)).strip()
        if want == self.method:
            return None
        where = self.elsewhere.get(want)
        hint = f"send it to model {where}" if where else f"this deployment serves only {self.method!r}"
        return pb_utils.TritonError(f"method: got {want!r}; the ensemble runs {self.method!r}: {hint}")

    def _disable_error(self, request):
        t = pb_utils.get_input_tensor_by_name(request, "disable_at_batch")
        if t is None or not self.speculates or int(t.as_numpy().reshape(-1)[0]) == 0:
            return None
        return pb_utils.TritonError("disable_at_batch: tensorrtllm_backend's in-flight batching cannot switch "
                                    "speculation off per batch; send 0 or leave it out")

    def execute(self, requests):
        responses = []
        for request in requests:
            err = self._method_error(request) or self._disable_error(request)
            if err is not None:
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=err))
                continue
            n_in = pb_utils.get_input_tensor_by_name(request, "REQUEST_INPUT_LEN").as_numpy().reshape(-1)
            seq = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
            seq = seq.reshape(seq.shape[0], -1)[:, 0]
            excl = pb_utils.get_input_tensor_by_name(request, "exclude_input_in_output")
            exclude = bool(excl.as_numpy().reshape(-1)[0]) if excl is not None else self.exclude_default
            n_out = seq if exclude else np.maximum(seq - n_in, 0)
            rows = n_in.shape[0]
            stat = -1 if self.speculates else 0
            out = [
                pb_utils.Tensor("num_input_tokens", n_in.astype(np.int32).reshape(rows, 1)),
                pb_utils.Tensor("num_output_tokens", n_out.astype(np.int32).reshape(rows, 1)),
                pb_utils.Tensor("acceptance_rate", np.full((rows, 1), float(stat), np.float32)),
                pb_utils.Tensor("total_accepted_draft_tokens", np.full((rows, 1), stat, np.int32)),
                pb_utils.Tensor("total_draft_tokens", np.full((rows, 1), stat, np.int32)),
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=out))
        return responses
'''


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
    if role == "medusa":
        p["decoding_mode"] = "medusa"
        if isinstance(spec.medusa.choices, list):
            p["medusa_choices"] = medusa_choices_text(spec.medusa.choices)
    return p


def build_configs(spec: Spec, python_path: str = "") -> dict[str, str]:
    """{model name: config.pbtxt text} for every model of the repository.

    `python_path` (colon-separated) is prepended to sys.path by our perf_metrics model before it
    imports numpy; only needed outside the container, where the stub's Python is not the venv's.
    """
    rs = roles(spec)
    lim, tr = spec.limits, spec.triton
    mem = memory_plan(spec, planned_engine_configs(spec))
    tokenizer = spec.target.source
    llm_role = "medusa" if "medusa" in rs else "target"
    decoupled = spec.tensorrt_llm.decoupled
    queue = (f"dynamic_batching {{\n  preferred_batch_size: [ {lim.max_batch_size} ]\n"
             f"  max_queue_delay_microseconds: {tr.max_queue_delay_us}\n"
             "  default_queue_policy: { max_queue_size: 0 }\n}\n")
    pre_params = {"tokenizer_dir": tokenizer, "add_special_tokens": "true", "max_num_images": "",
                  **{k: "" for k in ERA.preprocessing_model_path_keys},
                  "gpt_model_path": str(engine_dir(spec, llm_role).resolve())}
    out = {
        "ensemble": render(spec, "ensemble", 'platform: "ensemble"', ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS,
                           steps=ENSEMBLE_STEPS),
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
        "tensorrt_llm_bls": render(spec, "tensorrt_llm_bls", 'backend: "python"', bls_inputs(spec), BLS_OUTPUTS,
                                   params={"accumulate_tokens": "false", "tensorrt_llm_model_name": "tensorrt_llm",
                                           "tensorrt_llm_draft_model_name":
                                               "tensorrt_llm_draft" if spec.has_draft else "",
                                           "multimodal_encoders_name": ""},
                                   instances=tr.instance_count, decoupled=decoupled),
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
    """What perf_metrics must know: the ensemble's method, and where the other methods are served."""
    if spec.has_medusa:
        method, other = "medusa", ""
    else:
        method, other = "baseline", "draft_target=tensorrt_llm_bls (with num_draft_tokens)" if spec.has_draft else ""
    return {"exclude_input_in_output": exclude_default(spec), "method": method, "other_methods": other,
            "python_path": python_path}


CONTAINER_MODELS = ("preprocessing", "postprocessing", "tensorrt_llm_bls")


def write_repo(spec: Spec, container_models: str | Path = ERA.all_models,
               python_path: str = "") -> tuple[Path, list[tuple[str, str, bool]]]:
    """Write triton_repo/<name>/ (replacing it whole); returns (path, [(src, dst, copied)])."""
    configs = build_configs(spec, python_path)
    dest = spec.repo_dir
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    copies: list[tuple[str, str, bool]] = []
    try:
        for name, text in configs.items():
            (tmp / name / "1").mkdir(parents=True)
            (tmp / name / "config.pbtxt").write_text(text)
        (tmp / "perf_metrics" / "1" / "model.py").write_text(PERF_MODEL_PY.replace("${era}", ERA.backend_tag))
        for name in CONTAINER_MODELS:
            src = Path(container_models) / name / "1"
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
    script = dest.parent / f"{dest.name}.copy.sh"
    todo = [c for c in copies if not c[2]]
    if todo:
        script.write_text("#!/bin/sh\n# Run inside " + ERA.image + ": NVIDIA's python models for this repository.\n"
                          "set -e\n" + "".join(f"cp -r {s} {d}/\n" for s, d, _ in todo))
        script.chmod(0o755)
    elif script.exists():
        script.unlink()
    return dest, copies


def ensemble_io(spec: Spec | None = None) -> tuple[list[tuple[str, str, list[int]]], list[tuple[str, str, list[int]]]]:
    """The client-visible `ensemble` inputs and outputs as (name, data type, dims)."""
    return ([(n, d, list(dims)) for n, d, dims, *_ in ENSEMBLE_INPUTS],
            [(n, d, list(dims)) for n, d, dims, *_ in ENSEMBLE_OUTPUTS])

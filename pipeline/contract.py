"""The client contract both backends serve: the `ensemble` model's inputs and outputs (DESIGN.md "Client contract").

Written once, as tensorrtllm_backend's ensemble (reference/trtllm.md 4.4), so a client written for one backend works
unchanged on the other. The torch backend's repository (pipeline/triton/repo.py) and the tensorrt_llm engine-era
repository (pipeline/trtllm/engine_repo.py) both declare these tensors; the OpenAI endpoint maps onto them.
"""

from __future__ import annotations

# The pinned era's (tensorrtllm_backend v0.18) names for two request inputs, which later releases renamed seed and
# min_tokens. The contract declares both spellings (below), so a client sends either whichever era serves it; the
# era's tables (pipeline/trtllm/era.py) take these from here.
SEED_INPUT = "random_seed"
MIN_TOKENS_INPUT = "min_length"

# (name, data type, dims, optional, reshape-to-scalar, ragged)
Tensor = tuple[str, str, list[int], bool, bool, bool]


def _t(name: str, dtype: str, dims: list[int], optional: bool = False, scalar: bool = False,
       ragged: bool = False) -> Tensor:
    return (name, dtype, dims, optional, scalar, ragged)


# The client contract: what `ensemble` accepts and returns (DESIGN.md "Client contract").
ENSEMBLE_INPUTS: list[Tensor] = [
    # tensorrtllm_backend v0.18's ensemble inputs (what NVIDIA's clients send; no multimodal, LoRA or
    # prompt tables here), with its names random_seed and min_length ...
    _t("text_input", "TYPE_STRING", [1]),
    _t("decoder_text_input", "TYPE_STRING", [1], True),
    _t("max_tokens", "TYPE_INT32", [1]),
    _t("num_return_sequences", "TYPE_INT32", [1], True),
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
    _t(MIN_TOKENS_INPUT, "TYPE_INT32", [1], True),
    _t("presence_penalty", "TYPE_FP32", [1], True),
    _t("frequency_penalty", "TYPE_FP32", [1], True),
    _t(SEED_INPUT, "TYPE_UINT64", [1], True),
    _t("return_log_probs", "TYPE_BOOL", [1], True),
    _t("return_context_logits", "TYPE_BOOL", [1], True),
    _t("return_generation_logits", "TYPE_BOOL", [1], True),
    _t("return_kv_cache_reuse_stats", "TYPE_BOOL", [1], True),
    _t("beam_width", "TYPE_INT32", [1], True),
    _t("stream", "TYPE_BOOL", [1], True),
    _t("embedding_bias_words", "TYPE_STRING", [-1], True),
    _t("embedding_bias_weights", "TYPE_FP32", [-1], True),
    # ... and the project's contract (DESIGN.md): the later names seed / min_tokens (request_check folds
    # them into the era's), perf metrics, and the speculation inputs request_check answers.
    _t("seed", "TYPE_UINT64", [1], True),
    _t("min_tokens", "TYPE_INT32", [1], True),
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

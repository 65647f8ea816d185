"""Every check in spec.validate(): a bad value is refused with an error that names its key path and says what
is valid, and the value just inside each bound is accepted (so a bound moved by one is caught too).

The table is the contract: one row per check, (YAML fragment merged into a valid spec, key path, words of the
fix). Removing any check makes its row accepted or answered by another check under another path.
"""

from __future__ import annotations

import copy

import pytest
import yaml

from pipeline import spec as specmod

TORCH = {"name": "t", "target": {"source": "x"}}
TRT = {"name": "t", "backend": "tensorrt_llm", "device": "cuda", "target": {"source": "x"}}
DRAFT = {"draft": {"source": "train"}}


def merged(base: dict, *fragments: dict) -> dict:
    """base with each fragment deep-merged in (mappings merge, anything else replaces)."""
    out = copy.deepcopy(base)
    for frag in fragments:
        stack = [(out, frag)]
        while stack:
            dst, src = stack.pop()
            for k, v in src.items():
                if isinstance(v, dict) and isinstance(dst.get(k), dict):
                    stack.append((dst[k], v))
                else:
                    dst[k] = copy.deepcopy(v)
    return out


def budget_rows(section: str) -> list:
    rows = []
    for key in ("steps", "sequences", "seq_len", "batch_size"):
        rows.append((TORCH, {section: {"train": {key: 0}}}, f"{section}.train.{key}", "must be a positive integer"))
    rows += [
        (TORCH, {section: {"train": {"minutes": 0}}}, f"{section}.train.minutes", "positive number of minutes"),
        (TORCH, {section: {"train": {"lr": 0}}}, f"{section}.train.lr", "must be in (0, 1)"),
        (TORCH, {section: {"train": {"lr": 1}}}, f"{section}.train.lr", "must be in (0, 1)"),
    ]
    return rows


# (base, fragment, key path, words of the fix)
REFUSED = [
    (TORCH, {"name": "-lead"}, "name", "use letters, digits"),
    (TORCH, {"name": "a/b"}, "name", "use letters, digits"),
    (TORCH, {"threads": -1}, "threads", "must be 0 (all cores)"),
    (TORCH, {"limits": {"max_batch_size": 0}}, "limits.max_batch_size", "must be a positive integer"),
    (TORCH, {"limits": {"max_input_len": 0}}, "limits.max_input_len", "must be a positive integer"),
    (TORCH, {"limits": {"max_seq_len": 0}}, "limits.max_seq_len", "must be a positive integer"),
    (TORCH, {"limits": {"max_draft_len": -1}}, "limits.max_draft_len", "must be 0 or more"),
    (TORCH, {"limits": {"max_input_len": 512, "max_seq_len": 512}}, "limits.max_input_len",
     "must be below limits.max_seq_len (512)"),
    (TORCH, {"parallel": {"tp": 0}}, "parallel.tp", "must be 1 or more"),
    (TORCH, {"parallel": {"pp": 0}}, "parallel.pp", "must be 1 or more"),
    (TORCH, {"parallel": {"tp": 2}}, "parallel", "the torch backend runs one rank"),
    (TORCH, {"parallel": {"pp": 2}}, "parallel", "the torch backend runs one rank"),
    (TRT, {"device": "cpu"}, "device", "runs on NVIDIA GPUs"),
    (TRT, {"parallel": {"tp": 2, "pp": 2}, "tensorrt_llm": {"gpus": 3}}, "tensorrt_llm.gpus",
     "needs at least tp*pp = 4 GPUs"),
    (TRT, {"speculation": {"disable_at_batch": 2}}, "speculation.disable_at_batch", "in-flight batching"),
    (TRT, {"speculation": {"draft_lookup_min_ngram": 1}}, "speculation.draft_lookup_min_ngram",
     "takes its drafts from the draft engine only"),
    (TRT, {"speculation": {"draft_confidence": 0.5}}, "speculation.draft_confidence", "drafts a fixed number"),
    (TORCH, {"target": {"quantization": "int4_awq"}}, "target.quantization", "the torch backend quantizes"),
    (TORCH, {"target": {"quantization": "fp8"}}, "target.quantization", "the torch backend quantizes"),
    (TORCH, {**DRAFT, "draft": {"source": "train", "quantization": "fp8"}}, "draft.quantization",
     "the torch backend quantizes"),
    (TORCH, {"target": {"quantization": "int4", "group_size": 16}}, "target.group_size", "32, 64 or 128"),
    (TRT, {"dtype": "bfloat16", "target": {"quantization": "int4_awq", "group_size": 256}}, "target.group_size",
     "32, 64 or 128"),
    (TORCH, {"draft": {"source": "train", "quantization": "int4", "group_size": 96}}, "draft.group_size",
     "32, 64 or 128"),
    (TORCH, {"draft": {"quantization": "int8"}}, "draft.quantization", "set draft.source"),
    (TORCH, {"dtype": "float16"}, "dtype", "runs float32 or bfloat16 weights"),
    (TORCH, {"draft": {"source": "train", "dtype": "float16"}}, "draft.dtype", "runs float32 or bfloat16 weights"),
    (TORCH, {"tensorrt_llm": {"kv_cache_dtype": "fp8"}}, "tensorrt_llm.kv_cache_dtype",
     "a quantized KV cache is a tensorrt_llm backend setting"),
    (TORCH, {"draft": {"layers": 0}}, "draft.layers", "must be 1 or more"),
    (TORCH, {"draft": {"vocab": -1}}, "draft.vocab", "must be 0 (full vocabulary)"),
    *budget_rows("draft"),
    *budget_rows("medusa"),
    (TORCH, {"medusa": {"num_heads": 0}}, "medusa.num_heads", "between 1 and 8"),
    (TORCH, {"medusa": {"num_heads": 9}}, "medusa.num_heads", "between 1 and 8"),
    (TORCH, {"medusa": {"num_layers": -1}}, "medusa.num_layers", "between 0 and 4"),
    (TORCH, {"medusa": {"num_layers": 5}}, "medusa.num_layers", "between 0 and 4"),
    (TORCH, {"medusa": {"posterior_threshold": 0}}, "medusa.posterior_threshold", "must be in (0, 1)"),
    (TORCH, {"medusa": {"posterior_threshold": 1}}, "medusa.posterior_threshold", "must be in (0, 1)"),
    (TORCH, {"medusa": {"posterior_alpha": 0}}, "medusa.posterior_alpha", "must be in (0, 1)"),
    (TORCH, {"medusa": {"posterior_alpha": 1}}, "medusa.posterior_alpha", "must be in (0, 1)"),
    (TORCH, {"medusa": {"num_heads": 2, "choices": [[0], [0, 0], [0, 0, 0]]}}, "medusa.choices",
     "only 2 Medusa heads"),
    (TORCH, {"limits": {"max_draft_len": 2}, "speculation": {"num_draft_tokens": 2, "prompt_lookup_num_tokens": 2},
             "medusa": {"choices": [[0], [1], [2]]}}, "medusa.choices", "exceed limits.max_draft_len (2)"),
    (TORCH, {"speculation": {"num_draft_tokens": 0}}, "speculation.num_draft_tokens", "must be 1 or more, or 'auto'"),
    (TORCH, {"speculation": {"num_draft_tokens": 9}}, "speculation.num_draft_tokens",
     "must be between 1 and limits.max_draft_len (8)"),
    (TRT, {**DRAFT, "draft": {"source": "models/d"}, "speculation": {"num_draft_tokens": 9}},
     "speculation.num_draft_tokens", "must be between 1 and limits.max_draft_len (8)"),
    (TORCH, {"speculation": {"disable_at_batch": -1}}, "speculation.disable_at_batch", "must be 0 (never switch"),
    (TORCH, {"speculation": {"prompt_lookup_max_ngram": 0}}, "speculation.prompt_lookup_max_ngram",
     "must be 1 or more"),
    (TORCH, {"speculation": {"draft_confidence": 1.0}}, "speculation.draft_confidence", "a probability below 1"),
    (TORCH, {"speculation": {"draft_confidence": -0.1}}, "speculation.draft_confidence", "a probability below 1"),
    (TORCH, {"speculation": {"draft_confidence": 0.5, "num_draft_tokens": "auto"}}, "speculation.draft_confidence",
     "needs speculation.num_draft_tokens set"),
    (TORCH, {"speculation": {"draft_lookup_min_ngram": 4}}, "speculation.draft_lookup_min_ngram",
     "between 1 and prompt_lookup_max_ngram (3)"),
    (TORCH, {"speculation": {"draft_lookup_min_ngram": -1}}, "speculation.draft_lookup_min_ngram",
     "between 1 and prompt_lookup_max_ngram (3)"),
    (TORCH, {"speculation": {"prompt_lookup_num_tokens": 0}}, "speculation.prompt_lookup_num_tokens",
     "between 1 and limits.max_draft_len (8)"),
    (TORCH, {"speculation": {"prompt_lookup_num_tokens": 9}}, "speculation.prompt_lookup_num_tokens",
     "between 1 and limits.max_draft_len (8)"),
    *[(TORCH, {"triton": {port: bad}}, f"triton.{port}", "between 1 and 65535")
      for port in ("http_port", "grpc_port", "metrics_port") for bad in (0, 65536)],
    (TORCH, {"triton": {"grpc_port": 8000}}, "triton", "must differ"),
    (TORCH, {"triton": {"metrics_port": 8001}}, "triton", "must differ"),
    (TORCH, {"triton": {"instance_count": 0}}, "triton.instance_count", "must be 1 or more"),
    (TORCH, {"triton": {"max_queue_delay_us": -1}}, "triton.max_queue_delay_us", "must be 0 or more"),
    (TORCH, {"triton": {"startup_timeout_s": 0}}, "triton.startup_timeout_s", "must be positive"),
    *[(TORCH, {"triton": {"stream_interval_ms": bad}}, "triton.stream_interval_ms", "from 0 (every step's text")
      for bad in (-1, 10_001)],
    (TORCH, {"triton": {"models": []}}, "triton.models", "must list ensemble, tensorrt_llm_bls or both"),
    (TORCH, {"triton": {"models": ["ensemble", "ensemble"]}}, "triton.models", "each once"),
    (TORCH, {"triton": {"models": ["ensemble", "preprocessing"]}}, "triton.models", "must list ensemble"),
    (TORCH, {"tensorrt_llm": {"gpu_memory_gib": 0}}, "tensorrt_llm.gpu_memory_gib", "must be positive"),
    (TORCH, {"tensorrt_llm": {"gpus": 0}}, "tensorrt_llm.gpus", "must be 1 or more"),
    (TORCH, {"tensorrt_llm": {"draft_tp": 0}}, "tensorrt_llm.draft_tp", "must be 1 or more"),
    (TORCH, {"tensorrt_llm": {"kv_cache_free_gpu_mem_fraction": 1.0}}, "tensorrt_llm.kv_cache_free_gpu_mem_fraction",
     "must be in (0, 1) or 'auto'"),
    (TORCH, {"tensorrt_llm": {"kv_cache_free_gpu_mem_fraction": 0}}, "tensorrt_llm.kv_cache_free_gpu_mem_fraction",
     "must be in (0, 1) or 'auto'"),
    (TORCH, {"validate": {"max_new_tokens": 0}}, "validate.max_new_tokens", "must be 1 or more"),
    (TORCH, {"validate": {"max_prompts": -1}}, "validate.max_prompts", "must be 0 (all) or more"),
    (TORCH, {"validate": {"concurrency": []}}, "validate.concurrency", "non-empty list of positive integers"),
    (TORCH, {"validate": {"concurrency": [1, 0]}}, "validate.concurrency", "non-empty list of positive integers"),
    (TORCH, {"validate": {"temperatures": [0.7, -0.1]}}, "validate.temperatures", "must be 0 or more"),
]

# Values at the edge of each bound, which must pass.
ACCEPTED = [
    (TORCH, {"name": "a.b_c-1"}),
    (TORCH, {"threads": 0, "limits": {"max_draft_len": 0}, "speculation": {"num_draft_tokens": "auto",
                                                                           "prompt_lookup_num_tokens": 1}}),
    (TORCH, {"limits": {"max_batch_size": 1, "max_input_len": 1, "max_seq_len": 2}}),
    (TRT, {"parallel": {"tp": 2, "pp": 2}, "tensorrt_llm": {"gpus": 4}}),
    (TRT, {"device": "auto", "dtype": "bfloat16", "target": {"quantization": "int4_awq", "group_size": 32}}),
    (TRT, {"dtype": "float16", "draft": {"source": "models/d", "dtype": "float16"}}),
    (TORCH, {"device": "cuda", "dtype": "float16", "draft": {"source": "train", "dtype": "float16"}}),
    (TORCH, {"dtype": "bfloat16", "draft": {"source": "train", "dtype": "bfloat16"}}),
    (TORCH, {"target": {"quantization": "int4", "group_size": 64}, "draft": {"source": "train", "quantization": "int8",
                                                                               "group_size": 7}}),
    (TORCH, {"draft": {"layers": 1, "vocab": 0, "train": {"steps": 1, "sequences": 1, "seq_len": 1, "batch_size": 1,
                                                          "minutes": 0.01, "lr": 0.999}}}),
    (TORCH, {"medusa": {"num_heads": 1, "num_layers": 0, "posterior_threshold": 0.999, "posterior_alpha": 0.001,
                        "choices": [[0]]}}),
    (TORCH, {"medusa": {"num_heads": 8, "num_layers": 4, "choices": [[0], [1], [0, 0]]}}),
    (TORCH, {"speculation": {"num_draft_tokens": 8, "prompt_lookup_num_tokens": 8, "disable_at_batch": 0}}),
    (TORCH, {"speculation": {"num_draft_tokens": 1}}),
    (TRT, {"speculation": {"num_draft_tokens": 9}}),  # no draft engine: k is not bounded by max_draft_len here
    (TORCH, {"speculation": {"prompt_lookup_max_ngram": 1, "draft_lookup_min_ngram": 1, "draft_confidence": 0.999}}),
    (TORCH, {"speculation": {"draft_lookup_min_ngram": 3}}),
    (TORCH, {"triton": {"http_port": 1, "grpc_port": 65535, "metrics_port": 2, "instance_count": 1,
                        "max_queue_delay_us": 0, "startup_timeout_s": 0.1}}),
    (TORCH, {"triton": {"models": ["tensorrt_llm_bls"]}}),
    (TORCH, {"triton": {"models": ["ensemble"]}}),
    (TORCH, {"tensorrt_llm": {"gpu_memory_gib": 0.5, "gpus": 1, "draft_tp": 1,
                              "kv_cache_free_gpu_mem_fraction": 0.999}}),
    (TORCH, {"validate": {"max_new_tokens": 1, "max_prompts": 0, "concurrency": [1], "temperatures": [0.0]}}),
]


def _id(row) -> str:
    return f"{row[2]}={yaml.safe_dump(row[1], default_flow_style=True).strip()}"


@pytest.mark.parametrize("base, fragment, path, fix", REFUSED, ids=[_id(r) for r in REFUSED])
def test_each_check_refuses_its_bad_value_and_names_the_key(base, fragment, path, fix):
    with pytest.raises(specmod.SpecError) as e:
        specmod.parse(merged(base, fragment))
    msg = str(e.value)
    assert msg.startswith(f"{path}: "), msg
    assert fix in msg, msg


@pytest.mark.parametrize("base, fragment", ACCEPTED, ids=[str(i) for i in range(len(ACCEPTED))])
def test_values_at_the_bounds_are_accepted(base, fragment):
    specmod.parse(merged(base, fragment))



# ---- checks that depend on the device run on what `device` resolves to ----

# (fragment, key path, words of the fix): refused on the device named in the test below, accepted on the other.
REFUSED_ON_CUDA = [
    ({"target": {"quantization": "int4_a8"}}, "target.quantization", "int8 activations run in the CPU kernels"),
    ({"draft": {"source": "train", "quantization": "int4_a8"}}, "draft.quantization",
     "int8 activations run in the CPU kernels"),
]
REFUSED_ON_CPU = [
    ({"dtype": "float16"}, "dtype", "runs float32 or bfloat16 weights"),
    ({"draft": {"source": "train", "dtype": "float16"}}, "draft.dtype", "runs float32 or bfloat16 weights"),
]


def test_auto_resolves_to_cuda_only_when_torch_sees_a_gpu():
    import torch

    assert specmod.resolve_device("auto", cuda_available=True) == "cuda"
    assert specmod.resolve_device("auto", cuda_available=False) == "cpu"
    assert specmod.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert specmod.resolve_device("cpu", cuda_available=True) == "cpu"  # an explicit device is kept
    assert specmod.resolve_device("cuda", cuda_available=False) == "cuda"  # (engine loading refuses it later)


@pytest.mark.parametrize("fragment, path, fix", REFUSED_ON_CUDA, ids=[r[1] for r in REFUSED_ON_CUDA])
@pytest.mark.parametrize("device, cuda", [("cuda", None), ("auto", True)], ids=["cuda", "auto-on-a-gpu"])
def test_a_cuda_only_refusal_holds_for_auto_on_a_gpu_machine(fragment, path, fix, device, cuda):
    with pytest.raises(specmod.SpecError) as e:
        specmod.parse(merged(TORCH, {"device": device}, fragment), cuda_available=cuda)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and fix in msg, msg
    assert f"device: {device}" in msg, msg
    # the same spec where auto becomes the CPU is fine: the CPU kernels run int8 activations
    specmod.parse(merged(TORCH, {"device": device}, fragment) | {"device": "cpu"})
    specmod.parse(merged(TORCH, {"device": "auto"}, fragment), cuda_available=False)


@pytest.mark.parametrize("fragment, path, fix", REFUSED_ON_CPU, ids=[r[1] for r in REFUSED_ON_CPU])
@pytest.mark.parametrize("device, cuda", [("cpu", None), ("auto", False)], ids=["cpu", "auto-without-a-gpu"])
def test_a_cpu_only_refusal_holds_for_auto_without_a_gpu(fragment, path, fix, device, cuda):
    with pytest.raises(specmod.SpecError) as e:
        specmod.parse(merged(TORCH, {"device": device}, fragment), cuda_available=cuda)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and fix in msg, msg
    assert f"device: {device}" in msg, msg
    specmod.parse(merged(TORCH, {"device": "cuda"}, fragment))
    specmod.parse(merged(TORCH, {"device": "auto"}, fragment), cuda_available=True)


def test_auto_on_this_machine_is_checked_as_what_torch_will_run_on():
    """No availability given: the checks ask torch, as engine loading does (this machine has no GPU in CI)."""
    import torch

    on_gpu = torch.cuda.is_available()
    refused, accepted = (REFUSED_ON_CUDA, REFUSED_ON_CPU) if on_gpu else (REFUSED_ON_CPU, REFUSED_ON_CUDA)
    for fragment, path, _ in refused:
        with pytest.raises(specmod.SpecError, match=f"^{path}: .*device: auto \\(on this machine: "):
            specmod.parse(merged(TORCH, {"device": "auto"}, fragment))
    for fragment, _, _ in accepted:
        specmod.parse(merged(TORCH, {"device": "auto"}, fragment))


def test_the_tensorrt_llm_backend_keeps_auto_as_the_gpu_it_plans_for():
    """Plans for TensorRT-LLM are written on machines without a GPU: auto there is the GPU it will run on."""
    specmod.parse(merged(TRT, {"device": "auto", "dtype": "float16"}), cuda_available=False)

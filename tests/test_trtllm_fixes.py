"""The ten points of the TensorRT-LLM review (issue 17), one test each, checked against v0.18's names; plus the plan's
quantization, Qwen, Gemma, fast-logits and built-engine checks. The CPU harness (test_trtllm_harness.py) runs the
same repositories in tritonserver."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipeline import spec as specmod
from pipeline import trtllm
from pipeline.trtllm import engine_repo, runner
from pipeline.trtllm import memory as trtmem

ROOT = Path(__file__).resolve().parent.parent
DTM = ROOT / "build" / "llama70b_draft1b_tp4.yaml"
MEDUSA = ROOT / "build" / "vicuna7b_medusa.yaml"
QWEN = ROOT / "build" / "qwen_coder_trtllm.yaml"
# v0.18 tensorrt_llm_bls/1/lib/triton_decoder.py: TritonDecoder._preproc_outputs (all requested, always).
V018_PREPROC_OUTPUTS = ["INPUT_ID", "DECODER_INPUT_ID", "REQUEST_INPUT_LEN", "REQUEST_DECODER_INPUT_LEN",
                        "BAD_WORDS_IDS", "STOP_WORDS_IDS", "EMBEDDING_BIAS", "OUT_PAD_ID", "OUT_END_ID",
                        "OUT_PROMPT_TABLE_EXTRA_IDS", "PIXEL_VALUES", "IMAGE_SIZES", "IS_VIDEO_INPUT"]


def load(path: Path, root: Path | None = None, **changes) -> specmod.Spec:
    data = yaml.safe_load(path.read_text())
    data.setdefault("tensorrt_llm", {})["era"] = "engine"  # the engine era's checks (llmapi: test_trtllm_llmapi)
    for key, value in changes.items():
        *parents, last = key.split("__")
        d = data
        for p in parents:
            d = d.setdefault(p, {})
        d[last] = value
    return specmod.parse(data, root or ROOT)


def configs(spec: specmod.Spec) -> dict:
    return {n: engine_repo.parse_config(t) for n, t in engine_repo.build_configs(spec).items()}


def params(cfg) -> dict[str, str]:
    return {k: v.string_value for k, v in cfg.parameters.items()}


def names(tensors) -> set[str]:
    return {t.name for t in tensors}


def flags(argv: list[str]) -> dict[str, str | None]:
    out, i = {}, 0
    while i < len(argv):
        if argv[i].startswith("--"):
            val = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
            out[argv[i]] = val
            i += 2 if val is not None else 1
        else:
            i += 1
    return out


# ------------------------------------------------------------------------------------------------
# The ten points


@pytest.mark.parametrize("path", [DTM, MEDUSA, QWEN], ids=["dtm", "medusa", "qwen"])
def test_1_preprocessing_declares_every_output_the_v018_bls_requests(path):
    pre = configs(load(path))["preprocessing"]
    assert set(V018_PREPROC_OUTPUTS) <= names(pre.output)
    assert {"ASPECT_RATIO_IDS", "ASPECT_RATIO_MASK", "CROSS_ATTENTION_MASK"} <= names(pre.output)


def test_2_bls_and_ensemble_declare_everything_the_projects_client_sends():
    from pipeline.client import make_inputs

    sent = {t.name() for t in make_inputs("hi", 4, method="draft_target", stream=True, temperature=0.5, top_k=2,
                                          top_p=0.9, seed=1, end_id=2, stop_words=["x"], num_draft_tokens=3,
                                          use_draft_logits=True, exclude_input_in_output=True,
                                          disable_at_batch=0)}
    cfg = configs(load(DTM))
    assert sent <= names(cfg["tensorrt_llm_bls"].input), sent - names(cfg["tensorrt_llm_bls"].input)
    assert sent <= names(cfg["ensemble"].input), sent - names(cfg["ensemble"].input)


def test_3_convert_scripts_are_the_containers_examples_paths():
    for path, family in ((DTM, "llama"), (QWEN, "qwen")):
        steps = trtllm.plan(load(path))
        assert steps[0].argv[1] == f"/app/examples/{family}/convert_checkpoint.py"
    med = trtllm.plan(load(MEDUSA))
    assert med[0].argv[1] == "/app/examples/medusa/convert_checkpoint.py"
    assert specmod.TensorRTLLMSpec().examples_dir == "/app/examples"


@pytest.mark.parametrize("path", [DTM, MEDUSA], ids=["orchestrator", "leader"])
def test_4_serve_binds_every_rank_to_triton_host(path):
    spec = load(path, parallel__tp=2, tensorrt_llm__gpus=2)
    argv, _, _ = runner.launch_plan(spec)
    ranks = argv.count(trtllm.ERA.tritonserver)
    for flag in ("--grpc-address", "--http-address", "--metrics-address"):
        assert argv.count(f"{flag}=127.0.0.1") == ranks, flag


def test_5_draft_target_llm_models_do_not_wait_in_the_queue():
    cfg = configs(load(DTM, triton__max_queue_delay_us=2000))
    for m in ("tensorrt_llm", "tensorrt_llm_draft"):
        assert cfg[m].dynamic_batching.max_queue_delay_microseconds == 0, m
    assert configs(load(MEDUSA, triton__max_queue_delay_us=2000))["tensorrt_llm"].dynamic_batching \
        .max_queue_delay_microseconds == 2000


def test_6_gemma_gets_the_gemma_converters_flags():
    spec = load(DTM, target__family="gemma", draft__source="none", parallel__tp=2, dtype="bfloat16",
                target__quantization="int8")
    (conv, _) = trtllm.plan(spec)
    f = flags(conv.argv)
    assert conv.argv[1].endswith("/gemma/convert_checkpoint.py")
    assert (f["--ckpt-type"], f["--world-size"], f["--use-weight-only-with-precision"]) == ("hf", "2", "int8")
    assert "--model-dir" in f and "--output-model-dir" in f and "--model_dir" not in f and "--tp_size" not in f


def test_7_our_draft_target_bls_leaves_the_prompt_out_by_default():
    cfg = configs(load(DTM))
    bls = cfg["tensorrt_llm_bls"]
    assert params(bls)["exclude_input_in_output"] == "true"
    assert "exclude_input_in_output" in names(bls.input)
    # The LLM models still return the prompt, as the BLS loop needs (NVIDIA's and ours).
    assert params(cfg["tensorrt_llm"])["exclude_input_in_output"] == "false"
    assert (engine_repo.MODELS_DIR / "bls.py").read_text().count('"exclude_input_in_output", np.array([[False]])') == 1


def test_8_ensemble_takes_the_era_names_random_seed_and_min_length():
    cfg = configs(load(DTM))
    ens = names(cfg["ensemble"].input)
    assert {"random_seed", "min_length", "seed", "min_tokens", "beam_width", "num_return_sequences"} <= ens
    step = {s.model_name: s for s in cfg["ensemble"].ensemble_scheduling.step}
    assert step["tensorrt_llm"].input_map["random_seed"] == "_RANDOM_SEED"
    assert step["tensorrt_llm"].input_map["min_length"] == "_MIN_LENGTH"
    assert {"seed", "random_seed", "min_tokens", "min_length"} <= set(step["request_check"].input_map)


def test_9_the_draft_target_ensemble_refuses_draft_tokens_before_running():
    cfg = configs(load(DTM))
    step = {s.model_name: s for s in cfg["ensemble"].ensemble_scheduling.step}
    assert {"num_draft_tokens", "use_draft_logits"} <= set(step["request_check"].input_map)
    assert "num_draft_tokens" not in step["tensorrt_llm"].input_map
    assert params(cfg["request_check"])["draft_model"] == "true"
    assert "cannot do draft-target in an ensemble" in (engine_repo.MODELS_DIR / "request_check.py").read_text()


def test_10_decoupled_llm_models_are_refused_with_a_draft():
    with pytest.raises(specmod.SpecError, match="tensorrt_llm.decoupled: got True; draft-target"):
        load(DTM, tensorrt_llm__decoupled=True)
    assert load(MEDUSA, tensorrt_llm__decoupled=True).tensorrt_llm.decoupled


# ------------------------------------------------------------------------------------------------
# Quantization (issue 16 item 4)


@pytest.mark.parametrize("quant,algo", [("int8", "W8A16"), ("int4", "W4A16")])
def test_weight_only_quantization_goes_through_convert_checkpoint(quant, algo):
    want = ["--use_weight_only", "--weight_only_precision", quant]
    spec = load(QWEN, target__quantization=quant, draft__quantization=quant)
    conv = [s for s in trtllm.plan(spec) if s.name.startswith("convert")]
    for s in conv:
        assert s.argv[1].endswith("/qwen/convert_checkpoint.py")
        i = s.argv.index("--use_weight_only")
        assert s.argv[i:i + 3] == want
    cfgs = trtllm.planned_engine_configs(spec)
    assert cfgs["target"]["pretrained_config"]["quantization"]["quant_algo"] == algo
    assert cfgs["target"]["pretrained_config"]["architecture"] == "Qwen2ForCausalLM"


def test_int4_awq_and_fp8_go_through_quantize_py_with_block_size_and_kv_dtype():
    spec = load(QWEN, target__quantization="int4_awq", target__group_size=64, draft__quantization="none",
                draft__source="none", speculation__num_draft_tokens=4)
    (conv, _) = trtllm.plan(spec)
    f = flags(conv.argv)
    assert conv.argv[1] == "/app/examples/quantization/quantize.py"
    assert (f["--qformat"], f["--awq_block_size"], f["--dtype"]) == ("int4_awq", "64", "bfloat16")
    fp8 = load(QWEN, target__quantization="fp8", draft__quantization="fp8", tensorrt_llm__kv_cache_dtype="fp8")
    for s in trtllm.plan(fp8)[:2]:
        f = flags(s.argv)
        assert s.argv[1].endswith("quantization/quantize.py")
        assert (f["--qformat"], f["--kv_cache_dtype"]) == ("fp8", "fp8")
    pre = trtllm.planned_engine_configs(fp8)["target"]["pretrained_config"]["quantization"]
    assert (pre["quant_algo"], pre["kv_cache_quant_algo"]) == ("FP8", "FP8")


def test_int4_a8_plans_tensorrt_llms_w4a8_awq_with_the_block_size():
    """The torch runtime's int4_a8 (int4 weights, int8 activations) is W4A8_AWQ on a GPU (fp8 activations)."""
    spec = load(QWEN, draft__quantization="int4_a8", draft__group_size=64)
    steps = {s.name: s for s in trtllm.plan(spec)}
    f = flags(steps["convert-draft"].argv)
    assert steps["convert-draft"].argv[1].endswith("quantization/quantize.py")
    assert (f["--qformat"], f["--awq_block_size"]) == ("w4a8_awq", "64")
    cfgs = trtllm.planned_engine_configs(spec)
    assert cfgs["draft"]["pretrained_config"]["quantization"]["quant_algo"] == "W4A8_AWQ"
    int4 = trtllm.planned_engine_configs(load(QWEN, draft__quantization="int4", draft__group_size=64))["draft"]
    int8 = trtllm.planned_engine_configs(load(QWEN, draft__quantization="int8"))["draft"]
    a8_bytes = trtmem.weight_bytes(cfgs["draft"]["pretrained_config"], 1, 1)  # the memory plan counts 4-bit weights
    assert a8_bytes == trtmem.weight_bytes(int4["pretrained_config"], 1, 1)
    assert a8_bytes < trtmem.weight_bytes(int8["pretrained_config"], 1, 1)


@pytest.mark.parametrize("changes,key", [
    ({"tensorrt_llm__kv_cache_dtype": "int8"}, "tensorrt_llm.kv_cache_dtype: got 'int8'.*paged context FMHA"),
    ({"tensorrt_llm__kv_cache_dtype": "fp8"}, "tensorrt_llm.kv_cache_dtype: got 'fp8'.*FP8 quantization"),
    ({"target__quantization": "fp8", "draft__quantization": "fp8", "tensorrt_llm__gpu_arch": "ampere"},
     "tensorrt_llm.gpu_arch: got 'ampere'; FP8 .*needs"),
    ({"draft__quantization": "int4_a8", "tensorrt_llm__gpu_arch": "ampere"},
     "tensorrt_llm.gpu_arch: got 'ampere'; FP8 .*int4_a8.*needs"),
    ({"dtype": "float32", "target__quantization": "int8"}, "target.quantization: got 'int8'.*float16 or bfloat16"),
    ({"draft__dtype": "float32", "draft__quantization": "int4"}, "draft.quantization: got 'int4'.*draft.dtype"),
    ({"tensorrt_llm__fast_logits": True, "speculation__use_draft_logits": False}, "tensorrt_llm.fast_logits"),
])
def test_combinations_the_era_rejects_are_refused_with_the_key(changes, key):
    with pytest.raises(specmod.SpecError, match=key):
        load(QWEN, **changes)


def test_memory_plan_counts_quantized_weight_and_kv_bytes():
    def weights(**changes):
        return trtllm.memory_plan(load(DTM, **changes)).models["target"]

    bf16, int8, int4 = weights(), weights(target__quantization="int8"), weights(target__quantization="int4")
    # The 70B's decoder linears dominate: int8 about halves the bytes, int4 about quarters them.
    assert 0.45 < int8.weights_gib / bf16.weights_gib < 0.6
    assert 0.2 < int4.weights_gib / bf16.weights_gib < 0.35
    fp8 = trtllm.memory_plan(load(DTM, target__quantization="fp8", draft__quantization="fp8",
                                  tensorrt_llm__kv_cache_dtype="fp8")).models["target"]
    assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
    pre = trtllm.planned_engine_configs(load(DTM))["target"]["pretrained_config"]
    assert trtmem.weight_bytes(pre, 1, 1) == pytest.approx(70.55e9 * 2, rel=0.01)


# ------------------------------------------------------------------------------------------------
# Qwen pair, fast logits, built-engine checks


def test_qwen_pair_plans_on_one_gpu_from_the_torch_builds_hf_directories():
    spec = load(QWEN, draft__quantization="int8")  # the engine era's W8A16 draft (the shipped spec is llmapi)
    steps = trtllm.plan(spec)
    assert [s.name for s in steps] == ["convert-target", "convert-draft", "build-draft", "build-target"]
    ct, cd = flags(steps[0].argv), flags(steps[1].argv)
    assert ct["--model_dir"] == str(ROOT / "engines" / "qwen_coder" / "target_hf")
    assert cd["--model_dir"] == str(ROOT / "engines" / "qwen_coder" / "draft_hf")
    assert "--use_weight_only" in steps[1].argv and "--use_weight_only" not in steps[0].argv
    assert trtllm.preflight(spec, trtllm.planned_engine_configs(spec)) == []
    mem = trtllm.memory_plan(spec)
    assert mem.models["target"].gpus == mem.models["draft"].gpus == [0]
    assert mem.models["draft"].weights_gib < 0.5 * mem.models["target"].weights_gib


def test_fast_logits_sets_participant_ids_and_launches_without_spawned_processes():
    spec = load(DTM, tensorrt_llm__fast_logits=True)
    cfg = configs(spec)
    t, d = params(cfg["tensorrt_llm"]), params(cfg["tensorrt_llm_draft"])
    assert t["speculative_decoding_fast_logits"] == d["speculative_decoding_fast_logits"] == "1"
    assert (d["participant_ids"], t["participant_ids"]) == ("1", "2,3,4,5")
    argv, env, launcher = runner.launch_plan(spec)
    assert env["TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES"] == "0" and "--disable-spawn-processes" in launcher
    assert argv.count(trtllm.ERA.tritonserver) == 6 and "--world_size=6" in launcher
    assert "participant_ids" not in params(configs(load(DTM))["tensorrt_llm"])


def _engine(spec, role, version, ranks):
    d = trtllm.engine_dir(spec, role)
    d.mkdir(parents=True, exist_ok=True)
    for f in d.glob("rank*.engine"):
        f.unlink()
    cfg = trtllm.planned_engine_configs(spec)[role]
    cfg.pop("planned")
    cfg["version"] = version
    (d / "config.json").write_text(json.dumps(cfg))
    for r in range(ranks):
        (d / f"rank{r}.engine").write_bytes(b"x")


def test_repository_refuses_a_built_engine_of_another_release_or_missing_ranks(tmp_path):
    spec = load(MEDUSA, tmp_path)
    _engine(spec, "medusa", "0.17.0", 1)
    with pytest.raises(trtllm.PlanError, match="built by TensorRT-LLM 0.17.0.*0.18.0"):
        engine_repo.write_repo(spec, container_models_dir=tmp_path / "none")
    _engine(spec, "medusa", "0.18.0", 0)
    with pytest.raises(trtllm.PlanError, match=r"lacks rank0.engine"):
        engine_repo.write_repo(spec, container_models_dir=tmp_path / "none")
    _engine(spec, "medusa", "0.18.0", 1)
    engine_repo.write_repo(spec, container_models_dir=tmp_path / "none")
    assert trtllm.preflight(spec, None) == []
    # Not built at all: the repository is written, serve says what to build.
    dtm = load(DTM, tmp_path)
    engine_repo.write_repo(dtm, container_models_dir=tmp_path / "none")
    assert any("does not exist; build it" in p for p in engine_repo.engine_todo(dtm))


def test_preflight_reads_rejected_quantization_from_an_engine_config():
    spec = load(QWEN)
    cfgs = trtllm.planned_engine_configs(spec)
    assert trtllm.preflight(spec, cfgs) == []
    cfgs["draft"]["pretrained_config"]["quantization"]["kv_cache_quant_algo"] = "INT8"
    cfgs["target"]["pretrained_config"]["quantization"].update(kv_cache_quant_algo="FP8", quant_algo="W8A16")
    cfgs["target"]["pretrained_config"]["dtype"] = "float32"
    problems = trtllm.preflight(spec, cfgs)
    assert any(p.startswith("draft engine: an INT8 KV cache with paged context FMHA") for p in problems), problems
    assert any(p.startswith("target engine: an FP8 KV cache") for p in problems), problems
    assert any("weight-only W8A16 needs float16 or bfloat16" in p for p in problems), problems


def test_engine_era_bls_holds_back_a_utf8_character_split_across_rounds(monkeypatch):
    """Our tensorrt_llm_bls streams a response per round from the text decoded so far: a round that ends inside a
    multi-byte character decodes to U+FFFD, which the next round's text does not start with. The piece is held back
    until the character is whole; nothing sent is sent again, and the pieces join to the final text."""
    import importlib.util
    import sys

    import pytriton

    # The python backend's own utils module (shipped in the nvidia-pytriton wheel), as the stub process imports it.
    monkeypatch.syspath_prepend(str(Path(pytriton.__file__).parent / "tritonserver" / "backends" / "python"))
    spec = importlib.util.spec_from_file_location("bls_under_test", engine_repo.MODELS_DIR / "bls.py")
    bls = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bls_under_test", bls)
    spec.loader.exec_module(bls)

    answer = "naïve café: 雨 falls 🌧 now".encode()
    cuts = sorted({3, 4, 11, 12, 14, 15, 21, 22, 23, len(answer)})  # inside ï, é, 雨 and 🌧, and between
    sent, pieces = "", []
    for i, cut in enumerate(cuts):
        text = answer[:cut].decode("utf-8", errors="replace")  # what the postprocessing model returns
        piece, sent = bls.stream_piece(sent, text, final=i == len(cuts) - 1)
        assert "\ufffd" not in piece, (cut, piece)
        pieces.append(piece)
    assert "".join(pieces) == answer.decode() == sent
    # A request that ends inside a character sends what it has, replacement character included, once.
    piece, sent = bls.stream_piece("na", "naï".encode()[:3].decode("utf-8", errors="replace"), final=True)
    assert piece == "\ufffd" and sent == "na\ufffd"

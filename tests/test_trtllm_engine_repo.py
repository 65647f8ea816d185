"""The tensorrt_llm backend's Triton repository: Triton's schema, ensemble wiring, draft/Medusa settings."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pipeline import spec as specmod
from pipeline.trtllm import engine_repo

ROOT = Path(__file__).resolve().parent.parent
DTM = ROOT / "build" / "llama70b_draft1b_tp4.yaml"
MEDUSA = ROOT / "build" / "vicuna7b_medusa.yaml"
CONTRACT_INPUTS = {"text_input", "max_tokens", "temperature", "top_k", "top_p", "seed", "end_id", "pad_id",
                   "stop_words", "bad_words", "stream", "exclude_input_in_output", "return_perf_metrics",
                   "num_draft_tokens", "use_draft_logits"}
CONTRACT_OUTPUTS = {"text_output", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens",
                    "num_input_tokens", "num_output_tokens"}


def written(path: Path, tmp_path: Path) -> tuple[specmod.Spec, dict[str, model_config_pb2.ModelConfig], Path]:
    """Write the spec's repository under tmp_path and parse every config.pbtxt from disk."""
    spec = specmod.parse(yaml.safe_load(path.read_text()), tmp_path)
    repo, _ = engine_repo.write_repo(spec, container_models_dir=tmp_path / "no-container")
    configs = {}
    for f in sorted(repo.glob("*/config.pbtxt")):
        text = f.read_text()
        assert "${" not in text, f"unfilled placeholder in {f}"
        configs[f.parent.name] = text_format.Parse(text, model_config_pb2.ModelConfig())
        assert configs[f.parent.name].name == f.parent.name
        assert (f.parent / "1").is_dir()
    return spec, configs, repo


def params(cfg: model_config_pb2.ModelConfig) -> dict[str, str]:
    return {k: v.string_value for k, v in cfg.parameters.items()}


@pytest.mark.parametrize("path", [DTM, MEDUSA], ids=["draft_target", "medusa"])
def test_every_config_parses_with_tritons_schema(path, tmp_path):
    spec, configs, repo = written(path, tmp_path)
    want = {"ensemble", "request_check", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls",
            "perf_metrics"}
    assert set(configs) == want | ({"tensorrt_llm_draft"} if spec.has_draft else set())
    assert configs["ensemble"].platform == "ensemble"
    assert configs["tensorrt_llm"].backend == "tensorrtllm"
    assert all(configs[m].backend == "python" for m in ("preprocessing", "postprocessing", "tensorrt_llm_bls"))
    # Our models are the linted module files, copied as they are.
    for model, module in {**engine_repo.OUR_MODELS, "tensorrt_llm_bls": "bls.py"}.items():
        assert (repo / model / "1" / "model.py").read_text() == (engine_repo.MODELS_DIR / module).read_text()
    # NVIDIA's python models come from the container: without it, the cp commands are written out.
    script = (repo.parent / f"{repo.name}.copy.sh").read_text()
    for m in ("preprocessing", "postprocessing"):
        assert f"{engine_repo.ERA.all_models}/{m}/1 {repo}/{m}/" in script
    assert "tensorrt_llm_bls" not in script  # ours by default (tensorrt_llm.bls: pipeline)


def test_container_models_are_copied_when_present(tmp_path):
    container = tmp_path / "all_models"
    for m in engine_repo.CONTAINER_MODELS:
        (container / m / "1").mkdir(parents=True)
        (container / m / "1" / "model.py").write_text(f"# {m}\n")
    data = yaml.safe_load(MEDUSA.read_text())
    data["tensorrt_llm"]["bls"] = "nvidia"
    spec = specmod.parse(data, tmp_path)
    repo, copies = engine_repo.write_repo(spec, container_models_dir=container)
    assert all(done for *_, done in copies) and len(copies) == 3
    assert (repo / "tensorrt_llm_bls" / "1" / "model.py").read_text() == "# tensorrt_llm_bls\n"
    assert not (repo.parent / f"{repo.name}.copy.sh").exists()


@pytest.mark.parametrize("path", [DTM, MEDUSA], ids=["draft_target", "medusa"])
def test_ensemble_steps_map_only_tensors_that_exist(path, tmp_path):
    _, configs, _ = written(path, tmp_path)
    ens = configs["ensemble"]
    ens_in = {t.name: t.data_type for t in ens.input}
    ens_out = {t.name: t.data_type for t in ens.output}
    produced = dict(ens_in)  # ensemble tensor -> data type, growing step by step
    consumed = set()
    for step in ens.ensemble_scheduling.step:
        model = configs[step.model_name]
        m_in = {t.name: t.data_type for t in model.input}
        m_out = {t.name: t.data_type for t in model.output}
        for key, tensor in step.input_map.items():
            assert key in m_in, f"{step.model_name} has no input {key}"
            assert tensor in produced, f"{step.model_name}.{key} reads {tensor} before anything produces it"
            assert produced[tensor] == m_in[key], f"type mismatch on {tensor} -> {step.model_name}.{key}"
            consumed.add(tensor)
        for key, tensor in step.output_map.items():
            assert key in m_out, f"{step.model_name} has no output {key}"
            assert tensor not in produced, f"{tensor} produced twice"
            produced[tensor] = m_out[key]
        required = {t.name for t in model.input if not t.optional}
        assert required <= set(step.input_map), f"{step.model_name} misses {required - set(step.input_map)}"
    for name, dtype in ens_out.items():
        assert produced.get(name) == dtype, f"ensemble output {name} is not produced with type {dtype}"
    assert set(ens_in) <= consumed, f"ensemble inputs nobody reads: {set(ens_in) - consumed}"


def test_draft_target_is_wired_through_the_bls(tmp_path):
    spec, configs, _ = written(DTM, tmp_path)
    bls = params(configs["tensorrt_llm_bls"])
    assert bls["tensorrt_llm_model_name"] == "tensorrt_llm"
    assert bls["tensorrt_llm_draft_model_name"] == "tensorrt_llm_draft"
    target, draft = params(configs["tensorrt_llm"]), params(configs["tensorrt_llm_draft"])
    assert target["gpt_model_path"].endswith("engines/llama70b_draft1b_tp4/target")
    assert draft["gpt_model_path"].endswith("engines/llama70b_draft1b_tp4/draft")
    assert (target["gpu_device_ids"], draft["gpu_device_ids"]) == ("0,1,2,3", "0")
    for p in (target, draft):
        assert p["enable_kv_cache_reuse"] == "true"
        assert 0 < float(p["kv_cache_free_gpu_mem_fraction"]) < 1 and int(p["max_tokens_in_paged_kv_cache"]) > 0
        # The BLS loop slices output_ids assuming they hold the prompt (reference 4.7).
        assert p["exclude_input_in_output"] == "false"
    bls_inputs = {t.name for t in configs["tensorrt_llm_bls"].input}
    # Ours slices the prompt off itself: the project's client may send exclude_input_in_output.
    assert {"num_draft_tokens", "use_draft_logits", "exclude_input_in_output", "return_perf_metrics"} <= bls_inputs
    assert configs["tensorrt_llm_bls"].instance_group[0].count == spec.triton.instance_count
    # Ours follows triton.decoupled (the shipped engine-era specs answer unary infer: false).
    assert configs["tensorrt_llm_bls"].model_transaction_policy.decoupled == spec.triton.decoupled is False


@pytest.mark.parametrize("bls", ["pipeline", "nvidia"])
@pytest.mark.parametrize("decoupled", [True, False])
def test_bls_transaction_policy_follows_the_spec(tmp_path, bls, decoupled):
    """Ours is decoupled as triton.decoupled says (stream rounds, or answer tritonclient's unary infer); NVIDIA's
    follows the LLM models (tensorrt_llm.decoupled, false with a draft), as in tensorrtllm_backend."""
    data = yaml.safe_load(DTM.read_text())
    data["tensorrt_llm"]["bls"] = bls
    data["triton"]["decoupled"] = decoupled
    spec = specmod.parse(data, tmp_path)
    cfg = engine_repo.parse_config(engine_repo.build_configs(spec)["tensorrt_llm_bls"])
    assert cfg.model_transaction_policy.decoupled == (decoupled if bls == "pipeline" else False)


def test_nvidia_bls_leaves_out_exclude_input_with_a_draft(tmp_path):
    data = yaml.safe_load(DTM.read_text())
    data["tensorrt_llm"]["bls"] = "nvidia"
    spec = specmod.parse(data, tmp_path)
    bls = engine_repo.parse_config(engine_repo.build_configs(spec)["tensorrt_llm_bls"])
    names = {t.name for t in bls.input}
    assert "exclude_input_in_output" not in names and "return_perf_metrics" in names
    assert {"method", "seed"}.isdisjoint(names)  # NVIDIA's BLS would ignore them silently


def test_medusa_is_configured_through_decoding_mode_and_brace_choices(tmp_path):
    spec, configs, _ = written(MEDUSA, tmp_path)
    p = params(configs["tensorrt_llm"])
    assert p["decoding_mode"] == "medusa"
    assert p["gpt_model_path"].endswith("engines/vicuna7b_medusa/medusa")
    text = p["medusa_choices"]
    assert text.startswith("{0}, {0, 0}") and "[" not in text
    assert ast.literal_eval("[" + text.replace("{", "[").replace("}", "]") + "]") == spec.medusa.choices
    assert params(configs["tensorrt_llm_bls"])["tensorrt_llm_draft_model_name"] == ""
    # Without the BLS trap, the prompt is left out of text_output by default, as in the torch backend.
    assert p["exclude_input_in_output"] == "true" == params(configs["perf_metrics"])["exclude_input_in_output"]


def test_ensemble_io_is_the_written_ensemble_and_covers_the_client_contract(tmp_path):
    spec, configs, _ = written(DTM, tmp_path)
    ins, outs = engine_repo.ensemble_io(spec)
    ens = configs["ensemble"]
    as_tuples = lambda ts: [(t.name, model_config_pb2.DataType.Name(t.data_type), list(t.dims)) for t in ts]
    assert as_tuples(ens.input) == ins and as_tuples(ens.output) == outs
    assert CONTRACT_INPUTS <= {n for n, *_ in ins} and CONTRACT_OUTPUTS <= {n for n, *_ in outs}
    assert {t.name for t in ens.input if not t.optional} == {"text_input", "max_tokens"}


def _norm(dtype: str) -> str:
    d = dtype.upper().removeprefix("TYPE_")
    return "STRING" if d == "BYTES" else d


def test_ensemble_io_matches_the_torch_backend():
    from pipeline.triton import repo as torch_repo

    torch_in, torch_out = torch_repo.ensemble_io()
    ours_in, ours_out = engine_repo.ensemble_io(None)
    mine = {n: (_norm(t), list(d)) for n, t, d in ours_in + ours_out}
    for name, dtype, dims in list(torch_in) + list(torch_out):
        assert name in mine, f"torch ensemble exposes {name}, the tensorrt_llm ensemble does not"
        assert mine[name] == (_norm(dtype), list(dims)), f"{name}: torch {dtype} {dims} vs ours {mine[name]}"


def test_bad_settings_fail_before_anything_is_written(tmp_path):
    data = yaml.safe_load(DTM.read_text())
    data["draft"]["source"] = "train"
    spec = specmod.parse(data, tmp_path)
    with pytest.raises(engine_repo.PlanError, match="draft.source"):
        engine_repo.write_repo(spec)
    assert not spec.repo_dir.exists()


# What tensorrtllm_backend 0.18's python models exchange by name (read from its tensorrt_llm_bls/1/lib
# triton_decoder.py and preprocessing/1/model.py): our configs must declare all of it or Triton
# rejects the BLS's internal requests ("unexpected inference input") or the model fails to initialize.
BLS_SENDS_TO_LLM = {"input_ids", "decoder_input_ids", "input_lengths", "bad_words_list", "stop_words_list",
                    "embedding_bias", "pad_id", "end_id", "prompt_table_extra_ids", "beam_width", "runtime_top_k",
                    "runtime_top_p", "temperature", "len_penalty", "repetition_penalty", "min_length",
                    "presence_penalty", "frequency_penalty", "random_seed", "return_log_probs", "streaming",
                    "prompt_embedding_table", "prompt_vocab_size", "request_output_len", "draft_input_ids",
                    "draft_logits", "return_context_logits", "return_generation_logits"}
BLS_READS_FROM_LLM = {"output_ids", "sequence_length", "cum_log_probs", "output_log_probs", "context_logits",
                      "generation_logits", "batch_index"}
BLS_READS_FROM_PREPROCESSING = {"INPUT_ID", "DECODER_INPUT_ID", "REQUEST_INPUT_LEN", "REQUEST_DECODER_INPUT_LEN",
                                "BAD_WORDS_IDS", "STOP_WORDS_IDS", "EMBEDDING_BIAS", "OUT_PAD_ID", "OUT_END_ID",
                                "OUT_PROMPT_TABLE_EXTRA_IDS"}
PREPROCESSING_INIT_LOOKS_UP = BLS_READS_FROM_PREPROCESSING | {"EMBEDDING_BIAS_WORDS", "EMBEDDING_BIAS_WEIGHTS"}


def test_configs_declare_what_the_containers_python_models_exchange(tmp_path):
    _, configs, _ = written(DTM, tmp_path)
    for llm in ("tensorrt_llm", "tensorrt_llm_draft"):
        assert BLS_SENDS_TO_LLM <= {t.name for t in configs[llm].input}
        assert BLS_READS_FROM_LLM <= {t.name for t in configs[llm].output}
    pre = configs["preprocessing"]
    assert PREPROCESSING_INIT_LOOKS_UP <= {t.name for t in pre.input} | {t.name for t in pre.output}
    # preprocessing's initialize() indexes these parameters unconditionally (name differs by release).
    assert {"tokenizer_dir", *engine_repo.ERA.preprocessing_model_path_keys} <= set(params(pre))
    assert params(pre)["tokenizer_dir"] == "/models/Llama-3.1-70B-Instruct"
    assert {"OUTPUT"} == {t.name for t in configs["postprocessing"].output}


@pytest.mark.parametrize("path", [DTM, MEDUSA], ids=["draft_target", "medusa"])
def test_request_check_runs_before_every_other_ensemble_step(path, tmp_path):
    """A refused request must leave nothing in flight: an ensemble whose step fails while a parallel
    step still runs crashed tritonserver (segfault on the next request) in the CPU harness."""
    _, configs, _ = written(path, tmp_path)
    steps = configs["ensemble"].ensemble_scheduling.step
    made_by = {tensor: s.model_name for s in steps for tensor in s.output_map.values()}
    first = steps[0].model_name
    assert first == "request_check"

    def upstream(model: str) -> set[str]:
        step = next(s for s in steps if s.model_name == model)
        deps = {made_by[t] for t in step.input_map.values() if t in made_by}
        return deps | {u for d in deps for u in upstream(d)}

    for s in steps[1:]:
        assert first in upstream(s.model_name), f"{s.model_name} can run while request_check is still deciding"

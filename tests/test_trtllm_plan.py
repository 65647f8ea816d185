"""The tensorrt_llm engine plan, launch plan and GPU preflight, checked against the GPU example specs."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline import spec as specmod
from pipeline import trtllm
from pipeline.cli import main
from pipeline.trtllm import KNOWN_ARCHS, PlanError, runner
from pipeline.trtllm import memory as trtmem
from pipeline.trtllm import planning as trtplan

ROOT = Path(__file__).resolve().parent.parent
DTM = ROOT / "build" / "llama70b_draft1b_tp4.yaml"
MEDUSA = ROOT / "build" / "vicuna7b_medusa.yaml"


def load(path: Path, root: Path | None = None, **changes) -> specmod.Spec:
    """Load a spec file with dotted-key overrides, e.g. {"parallel.tp": 1}."""
    data = yaml.safe_load(path.read_text())
    for key, value in changes.items():
        *parents, last = key.split("__")
        d = data
        for p in parents:
            d = d.setdefault(p, {})
        d[last] = value
    return specmod.parse(data, root or ROOT)


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


def test_draft_target_plan_converts_then_builds_with_the_required_flags():
    spec = load(DTM)
    steps = trtllm.plan(spec)
    assert [s.name for s in steps] == ["convert-target", "convert-draft", "build-draft", "build-target"]
    ct, cd, bd, bt = (flags(s.argv) for s in steps)
    assert steps[0].argv[1].endswith("llama/convert_checkpoint.py")
    assert ct["--model_dir"] == "/models/Llama-3.1-70B-Instruct"
    assert cd["--model_dir"] == "/models/Llama-3.2-1B-Instruct"
    assert (ct["--dtype"], ct["--tp_size"], ct["--pp_size"]) == ("bfloat16", "4", "1")
    assert (cd["--dtype"], cd["--tp_size"], cd["--pp_size"]) == ("bfloat16", "1", "1")
    # Each build reads the checkpoint its conversion wrote.
    assert bt["--checkpoint_dir"] == ct["--output_dir"] and bd["--checkpoint_dir"] == cd["--output_dir"]
    assert bt["--speculative_decoding_mode"] == "draft_tokens_external"
    assert bt["--max_draft_len"] == str(spec.limits.max_draft_len)
    assert "--speculative_decoding_mode" not in bd
    for b in (bd, bt):
        assert b["--use_paged_context_fmha"] == "enable"
        assert "--gather_generation_logits" in b  # the spec asks for logits-based acceptance
        assert b["--max_batch_size"] == str(spec.limits.max_batch_size)
        assert b["--max_input_len"] == str(spec.limits.max_input_len)
        assert b["--max_seq_len"] == str(spec.limits.max_seq_len)
        assert b["--max_num_tokens"] == str(spec.tensorrt_llm.max_num_tokens)
        assert b["--kv_cache_type"] == "paged"


def test_token_matching_spec_builds_without_generation_logits():
    spec = load(DTM, speculation__use_draft_logits=False)
    assert all("--gather_generation_logits" not in s.argv for s in trtllm.plan(spec))


def test_medusa_plan_passes_head_count_and_layers_explicitly():
    spec = load(MEDUSA)
    steps = trtllm.plan(spec)
    assert [s.name for s in steps] == ["convert-medusa", "build-medusa"]
    conv, build = flags(steps[0].argv), flags(steps[1].argv)
    assert steps[0].argv[1].endswith("medusa/convert_checkpoint.py")
    assert conv["--medusa_model_dir"] == spec.medusa.source and conv["--model_dir"] == spec.target.source
    assert conv["--num_medusa_heads"] == "4" and conv["--num_medusa_layers"] == "1"
    assert conv["--max_medusa_token_len"] == str(len(spec.medusa.choices))
    assert build["--speculative_decoding_mode"] == "medusa"
    assert build["--max_draft_len"] == str(len(spec.medusa.choices))


def test_plan_refuses_sources_it_cannot_convert():
    with pytest.raises(PlanError, match="draft.source"):
        trtllm.plan(load(DTM, draft__source="train"))
    with pytest.raises(PlanError, match="medusa.source"):
        trtllm.plan(load(DTM, medusa__source="/models/heads"))


def test_spec_refuses_disable_at_batch_that_inflight_batching_cannot_honour():
    with pytest.raises(specmod.SpecError, match="speculation.disable_at_batch.*4.*set it to 0"):
        load(DTM, speculation__disable_at_batch=4)


def test_spec_refuses_draft_lookup_that_the_external_draft_flow_cannot_run():
    with pytest.raises(specmod.SpecError, match="speculation.draft_lookup_min_ngram.*2.*set it to 0"):
        load(DTM, speculation__draft_lookup_min_ngram=2)
    with pytest.raises(specmod.SpecError, match="speculation.draft_confidence.*0.7.*set it to 0"):
        load(DTM, speculation__draft_confidence=0.7)


@pytest.mark.slow
def test_engine_dry_run_prints_the_plan_and_real_run_stops_without_tensorrt_llm(capsys):
    cmd = [sys.executable, "-m", "pipeline", "engine", str(DTM)]
    assert main(["engine", str(DTM), "--dry-run"]) == 0  # in-process: a dry run needs no fresh interpreter
    dry = capsys.readouterr().out
    assert dry.count("trtllm-build") == 2 and "convert_checkpoint.py" in dry
    assert dry.index("convert_checkpoint.py") < dry.index("trtllm-build")
    assert "kv_cache_free_gpu_mem_fraction" in dry
    real = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert real.returncode != 0
    assert "import tensorrt_llm" in real.stderr
    assert not (ROOT / "engines" / "llama70b_draft1b_tp4" / "target").exists()


def test_preflight_accepts_the_planned_engines():
    for path in (DTM, MEDUSA):
        spec = load(path)
        assert trtllm.preflight(spec, trtllm.planned_engine_configs(spec)) == []


def test_preflight_rejects_target_engine_without_draft_room():
    spec = load(DTM)
    cfgs = trtllm.planned_engine_configs(spec)
    cfgs["target"]["build_config"]["max_draft_len"] = 0
    problems = trtllm.preflight(spec, cfgs)
    assert any("--max_draft_len" in p and "target" in p for p in problems), problems


def test_preflight_reads_built_config_json_from_the_engine_dir(tmp_path):
    spec = load(DTM, root=tmp_path)
    cfgs = trtllm.planned_engine_configs(spec)
    cfgs["target"]["build_config"]["max_draft_len"] = 0
    d = trtllm.engine_dir(spec, "target")
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfgs["target"]))
    assert any("--max_draft_len" in p for p in trtllm.preflight(spec, None))


def test_preflight_names_the_build_flag_for_each_wrong_engine_setting():
    spec = load(DTM)
    base = trtllm.planned_engine_configs(spec)
    cases = [
        (("target", "speculative_decoding_mode", 1), "--speculative_decoding_mode draft_tokens_external"),
        (("draft", "plugin_config", {"use_paged_context_fmha": False}), "--use_paged_context_fmha enable"),
        (("draft", "gather_generation_logits", False), "--gather_generation_logits"),
    ]
    for (role, key, value), flag in cases:
        cfgs = copy.deepcopy(base)
        cfgs[role]["build_config"][key] = value
        problems = trtllm.preflight(spec, cfgs)
        assert any(flag in p for p in problems), (flag, problems)
    # The IntFlag value trtllm-build stores for draft_tokens_external is accepted like the name.
    cfgs = copy.deepcopy(base)
    cfgs["target"]["build_config"]["speculative_decoding_mode"] = 2
    assert trtllm.preflight(spec, cfgs) == []


def test_preflight_rejects_a_draft_with_another_vocabulary():
    spec = load(DTM, tensorrt_llm__draft_arch="llama-2-7b")
    problems = trtllm.preflight(spec, None)
    assert any("vocab_size" in p and "draft.source" in p for p in problems), problems


def test_preflight_compares_tokenizer_files_when_checkpoints_are_local(tmp_path):
    for name, text in (("t", '{"a": 1}'), ("d", '{"a": 2}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer.json").write_text(text)
    spec = load(DTM, target__source=str(tmp_path / "t"), draft__source=str(tmp_path / "d"),
                tensorrt_llm__target_arch="llama-3.1-70b", tensorrt_llm__draft_arch="llama-3.2-1b")
    assert any("tokenizer" in p for p in trtllm.preflight(spec, None))


def test_preflight_checks_medusa_heads_against_tree_depth():
    spec = load(MEDUSA)
    cfgs = trtllm.planned_engine_configs(spec)
    cfgs["medusa"]["pretrained_config"]["num_medusa_heads"] = 3
    problems = trtllm.preflight(spec, cfgs)
    assert any("--num_medusa_heads" in p and "4 deep" in p for p in problems), problems
    cfgs = trtllm.planned_engine_configs(spec)
    cfgs["medusa"]["build_config"]["max_draft_len"] = 8
    assert any("max_draft_len" in p for p in trtllm.preflight(spec, cfgs))


def test_parameter_count_matches_published_sizes():
    for key, published in (("llama-3.1-70b", 70.55e9), ("llama-3.1-8b", 8.03e9), ("llama-2-7b", 6.74e9)):
        a = KNOWN_ARCHS[key]
        pre = trtplan._pretrained(a, "bfloat16", 1, 1, "LlamaForCausalLM")
        params, _ = trtmem._param_counts(pre, 1, 1)
        assert abs(params - published) / published < 0.01, (key, params)


def test_memory_plan_accepts_70b_draft_on_four_80gib_gpus():
    spec = load(DTM)
    mem = trtllm.memory_plan(spec)
    assert mem.problems == []
    t, d = mem.models["target"], mem.models["draft"]
    assert 30 < t.weights_gib < 40 and 2 < d.weights_gib < 4
    assert t.gpus == [0, 1, 2, 3] and d.gpus == [0]
    assert t.kv_tokens >= t.tokens_needed == 8 * (8192 + 10)
    assert d.kv_tokens >= d.tokens_needed
    assert 0 < d.kv_fraction < 1 and 0 < t.kv_fraction < 1
    # The two caches together stay inside what is free on the shared GPU.
    used = (t.kv_tokens * t.kv_bytes_per_token + d.kv_tokens * d.kv_bytes_per_token) / trtllm.GIB
    assert used < mem.free_gib[0]


def test_memory_plan_refuses_what_cannot_fit():
    one_gpu = load(DTM, parallel__tp=1, tensorrt_llm__gpus=1, tensorrt_llm__gpu_memory_gib=80)
    problems = trtllm.memory_plan(one_gpu).problems
    assert any("GPU 0" in p and "parallel.tp" in p for p in problems), problems
    assert trtllm.preflight(one_gpu, None)
    too_many = load(DTM, limits__max_batch_size=256)
    problems = trtllm.memory_plan(too_many).problems
    assert any("limits.max_batch_size" in p and "target" in p for p in problems), problems
    fixed = load(DTM, tensorrt_llm__kv_cache_free_gpu_mem_fraction=0.01)
    assert any("kv_cache_free_gpu_mem_fraction" in p for p in trtllm.memory_plan(fixed).problems)


def test_memory_plan_reads_config_json_of_a_local_checkpoint(tmp_path):
    src = tmp_path / "my-model"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                                 "num_key_value_heads": 2, "vocab_size": 320,
                                                 "intermediate_size": 128}))
    spec = load(MEDUSA, target__source=str(src))
    m = trtllm.memory_plan(spec).models["medusa"]
    assert m.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2  # K and V, 2 layers, 2 KV heads, head_dim 16, fp16
    unknown = load(MEDUSA, target__source="/models/some-private-model")
    assert any("tensorrt_llm.target_arch" in p for p in trtllm.preflight(unknown, None))


def test_launch_uses_one_rank_per_gpu_or_orchestrator_mode_for_two_models():
    med = load(MEDUSA, parallel__tp=2, tensorrt_llm__gpus=2, triton__grpc_port=9101)
    argv, env, launcher = runner.launch_plan(med)
    assert argv[:2] == ["mpirun", "--allow-run-as-root"] and argv.count(trtllm.ERA.tritonserver) == 2
    assert argv.count("--load-model=tensorrt_llm") == 1 and "--grpc-port=9101" in argv
    assert env == {} and "--world_size=2" in launcher
    dtm = load(DTM)
    argv, env, launcher = runner.launch_plan(dtm)
    assert argv.count(trtllm.ERA.tritonserver) == 1 and env["TRTLLM_ORCHESTRATOR"] == "1"
    assert "--multi-model" in launcher and "--world_size=1" in launcher
    assert f"--http-port={dtm.triton.http_port}" in argv
    assert runner.serve_command(dtm, dry_run=True) == 0


def test_runner_logs_each_step_skips_unchanged_ones_and_stops_at_a_failure(tmp_path, capsys):
    spec = load(MEDUSA, root=tmp_path)
    ok = trtllm.Step("one", [sys.executable, "-c", "print('converted')"], tmp_path / "out1", tmp_path / "l" / "one.log")
    bad = trtllm.Step("two", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], tmp_path / "out2",
                      tmp_path / "l" / "two.log")
    never = trtllm.Step("three", [sys.executable, "-c", "print('x')"], tmp_path / "out3", tmp_path / "l" / "3.log")
    assert runner.run_plan(spec, [ok, bad, never]) == 3
    assert (tmp_path / "l" / "one.log").read_text() == "converted\n"
    err = capsys.readouterr().err
    assert "two FAILED (exit 3)" in err and "boom" in err
    assert not (tmp_path / "l" / "3.log").exists()
    assert runner.run_plan(spec, [ok]) == 0
    assert "up to date" in capsys.readouterr().out


def test_unknown_arch_name_is_an_error_naming_the_key():
    with pytest.raises(PlanError, match="tensorrt_llm.draft_arch.*llama-3.2-1b"):
        trtllm.planned_engine_configs(load(DTM, tensorrt_llm__draft_arch="llama-9-1b"))

"""The torch backend's Triton model repository: Triton's own schema, tensorrtllm_backend's names and I/O."""

from __future__ import annotations

import pytest

from pipeline import spec as specmod
from pipeline.triton import repo as repomod
from tests.conftest import write_spec


@pytest.fixture(scope="module")
def written(tiny_root, tiny_engine):
    s = specmod.load(tiny_root / "build" / "tiny.yaml")
    return s, repomod.write_repo(s, log=lambda *a: None)


def _configs(path):
    return {p.parent.name: repomod.parse_pbtxt(p.read_text()) for p in sorted(path.glob("*/config.pbtxt"))}


def test_every_config_parses_with_tritons_schema_and_names_match_tensorrtllm_backend(written):
    _, path = written
    cfgs = _configs(path)
    assert set(cfgs) == {"ensemble", "tensorrt_llm_bls"}
    for name, c in cfgs.items():
        assert c.name == name
    for name in ("ensemble", "tensorrt_llm_bls"):  # one python model, served twice
        assert (path / name / "1" / "model.py").read_text() == repomod.MODEL_SOURCE.read_text()
    assert (path / ".step.lock").is_file(), "the file the served models take turns on"


def test_bls_is_decoupled_python_model_with_the_engine_limits_and_an_explicit_batch_dimension(written):
    s, path = written
    c = _configs(path)["tensorrt_llm_bls"]
    assert c.backend == "python"
    assert c.model_transaction_policy.decoupled
    # Triton does not batch (so a batch of 0 reaches the model, which names it); the model takes up to max_rows
    assert c.max_batch_size == 0 and not c.HasField("dynamic_batching")
    assert c.parameters["max_rows"].string_value == str(s.limits.max_batch_size)
    assert all(list(i.dims)[0] == -1 for i in [*c.input, *c.output])
    assert sum(g.count for g in c.instance_group) == s.triton.instance_count
    assert c.parameters["engine_dir"].string_value == str((s.engine_dir).resolve())
    assert c.parameters["default_method"].string_value == "baseline"


def test_the_stream_interval_reaches_each_served_models_parameters(written, tiny_root):
    s, path = written
    assert s.triton.stream_interval_ms == 50
    for c in _configs(path).values():
        assert c.parameters["stream_interval_ms"].string_value == "50"
    every_step = specmod.parse({"name": "x", "triton": {"stream_interval_ms": 0}}, tiny_root)
    assert repomod.bls_config(every_step, tiny_root).parameters["stream_interval_ms"].string_value == "0"
    quarter = specmod.parse({"name": "x", "triton": {"stream_interval_ms": 12.5}}, tiny_root)
    assert repomod.bls_config(quarter, tiny_root).parameters["stream_interval_ms"].string_value == "12.5"


def test_ensemble_and_bls_are_the_same_model_with_the_same_io_and_transaction_policy(written, tiny_root):
    s, path = written
    cfgs = _configs(path)
    c, bls = cfgs["ensemble"], cfgs["tensorrt_llm_bls"]
    assert c.backend == bls.backend == "python"
    assert [(i.name, i.data_type, list(i.dims)) for i in c.input] == [(i.name, i.data_type, list(i.dims))
                                                                      for i in bls.input]
    assert [o.name for o in c.output] == [o.name for o in bls.output]
    assert dict(c.parameters) == dict(bls.parameters) and c.parameters["step_lock"].string_value == "true"
    assert c.max_batch_size == bls.max_batch_size == 0 and c.parameters["max_rows"].string_value == str(
        s.limits.max_batch_size)
    assert c.model_transaction_policy.decoupled and bls.model_transaction_policy.decoupled
    unary = specmod.parse({"name": "x", "triton": {"decoupled": False}}, tiny_root)
    for name in ("ensemble", "tensorrt_llm_bls"):
        assert not repomod.model_config(unary, tiny_root, name).model_transaction_policy.decoupled


def test_triton_models_serves_only_the_models_it_lists(tiny_root, tiny_engine):
    s = specmod.load(write_spec(tiny_root, name="only_bls", triton={"models": ["tensorrt_llm_bls"]}))
    import shutil

    shutil.copytree(tiny_engine, s.engine_dir / "target", dirs_exist_ok=True)
    path = repomod.write_repo(s, log=lambda *a: None)
    assert set(_configs(path)) == {"tensorrt_llm_bls"}
    assert repomod.client_model(s) == "tensorrt_llm_bls" and repomod.client_model(s, "tensorrt_llm_bls") == \
        "tensorrt_llm_bls"
    both = specmod.load(tiny_root / "build" / "tiny.yaml")
    assert both.triton.models == ["ensemble", "tensorrt_llm_bls"] and repomod.client_model(both) == "ensemble"


def test_ensemble_io_matches_the_written_config_and_the_client_contract(written):
    from tritonclient.grpc import model_config_pb2 as mc

    _, path = written
    c = _configs(path)["ensemble"]
    ins, outs = repomod.INPUTS, repomod.OUTPUTS
    contract_in, contract_out = repomod.ensemble_io()
    assert set(n for n, _, _ in contract_in) < set(n for n, _, _ in ins), "the contract is served, and more"
    assert outs == contract_out + repomod.KV_CACHE_OUTPUTS, "the contract's outputs, and the KV-reuse ones"
    got_in = [(i.name, mc.DataType.Name(i.data_type), list(i.dims)) for i in c.input]
    got_out = [(o.name, mc.DataType.Name(o.data_type), list(o.dims)) for o in c.output]
    batch = lambda table: [(n, t, [-1, *d]) for n, t, d in table]  # noqa: E731 - the explicit batch dimension
    assert got_in == batch(ins) and got_out == batch(outs)
    bls = _configs(path)["tensorrt_llm_bls"]
    assert all(i.optional for i in bls.input) and all(i.optional for i in c.input), \
        "a missing input (or a `stop` request, which has no other) must reach the model, which names it"
    types = {n: (t, d) for n, t, d in ins + outs}
    # tensorrtllm_backend's ensemble (reference/trtllm.md 4.4) and the later perf outputs
    assert types["text_input"] == ("TYPE_STRING", [1])
    assert types["max_tokens"] == ("TYPE_INT32", [1])
    assert types["seed"] == ("TYPE_UINT64", [1])
    assert types["stop_words"] == ("TYPE_STRING", [-1]) and types["bad_words"] == ("TYPE_STRING", [-1])
    for b in ("stream", "exclude_input_in_output", "return_perf_metrics", "use_draft_logits"):
        assert types[b] == ("TYPE_BOOL", [1])
    assert types["text_output"] == ("TYPE_STRING", [-1])
    assert types["acceptance_rate"] == ("TYPE_FP32", [1])
    for n in ("total_accepted_draft_tokens", "total_draft_tokens", "num_input_tokens", "num_output_tokens"):
        assert types[n] == ("TYPE_INT32", [1])
    # every input tensorrtllm_backend's ensemble declares is accepted by Triton (the model honours or refuses it)
    for n, t in {"random_seed": "TYPE_UINT64", "min_length": "TYPE_INT32", "beam_width": "TYPE_INT32",
                 "repetition_penalty": "TYPE_FP32", "presence_penalty": "TYPE_FP32", "frequency_penalty": "TYPE_FP32",
                 "length_penalty": "TYPE_FP32", "return_log_probs": "TYPE_BOOL", "num_return_sequences": "TYPE_INT32",
                 "return_context_logits": "TYPE_BOOL", "return_generation_logits": "TYPE_BOOL",
                 "embedding_bias_words": "TYPE_STRING", "stop": "TYPE_BOOL"}.items():
        assert types[n][0] == t, n


def test_default_method_follows_the_spec(tiny_root):
    s = specmod.parse({"name": "x", "draft": {"source": "train"}}, tiny_root)
    assert repomod.default_method(s) == "draft_target"
    s = specmod.parse({"name": "x", "medusa": {"source": "train"}}, tiny_root)
    assert repomod.default_method(s) == "medusa"
    s = specmod.parse({"name": "x", "draft": {"source": "train"}, "medusa": {"source": "train"}}, tiny_root)
    assert repomod.default_methods(s) == ["draft_target", "medusa", "baseline"]
    assert repomod.bls_config(s, tiny_root).parameters["default_method"].string_value == "draft_target,medusa,baseline"


def test_speculation_settings_reach_the_served_model(tiny_root):
    s = specmod.parse({"name": "x", "draft": {"source": "train"},
                       "speculation": {"disable_at_batch": 3, "draft_lookup_min_ngram": 2, "use_draft_logits": False}},
                      tiny_root)
    p = repomod.bls_config(s, tiny_root).parameters
    got = {k: p[k].string_value for k in ("disable_at_batch", "draft_lookup_min_ngram", "use_draft_logits")}
    assert got == {"disable_at_batch": "3", "draft_lookup_min_ngram": "2", "use_draft_logits": "false"}


def test_repo_without_built_engine_says_to_build_it(tmp_path):
    s = specmod.load(write_spec(tmp_path, name="unbuilt"))
    with pytest.raises(FileNotFoundError, match="make engine"):
        repomod.write_repo(s)
    assert not s.repo_dir.exists()


def test_repo_verb_writes_the_repository(tiny_root, tiny_engine, capsys):
    from pipeline.cli import main

    assert main(["repo", str(tiny_root / "build" / "tiny.yaml")]) == 0
    assert (tiny_root / "triton_repo" / "tiny" / "ensemble" / "config.pbtxt").is_file()
    assert "tensorrt_llm_bls" in capsys.readouterr().out

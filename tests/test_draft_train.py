"""Draft building: distillation on tiny models, the engine + Hugging Face outputs, no-op rebuilds, loaded drafts."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline import spec as specmod
from pipeline.engine import build_target
from pipeline.preflight import PreflightError
from pipeline.runtime.decode import decode, load_bundle
from pipeline.runtime.generate import Request
from pipeline.train.draft import build_draft
from tests.conftest import make_model_dir, write_spec

BUDGET = {"steps": 30, "minutes": 1, "sequences": 8, "seq_len": 40, "batch_size": 4, "lr": 0.003}


pytestmark = pytest.mark.usefixtures("one_thread")


def _build(root, name, draft, speculation=None, logs=None):
    p = write_spec(root, name=name, draft=draft, speculation=speculation or {"num_draft_tokens": 3})
    s = specmod.load(p)
    build_target(s, log=lambda *a: None)
    out = build_draft(s, log=(logs.append if logs is not None else lambda *a: None))
    return s, out


@pytest.fixture(scope="module")
def trained(tiny_root):
    logs = []
    s, out = _build(tiny_root, "dfull", {"source": "train", "layers": 1, "vocab": 0, "dtype": "float32",
                                         "train": BUDGET}, logs=logs)
    return s, out, logs


def test_trained_draft_engine_has_target_schema_and_stats(trained):
    s, out, logs = trained
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["build_config"]["speculative_decoding_mode"] == "none"
    assert cfg["pretrained_config"]["num_hidden_layers"] == 1
    sp = cfg["speculation"]
    assert (sp["num_draft_tokens"], sp["chosen_by"]) == (3, "spec")
    # a given k is still measured, for the reports' draft step fraction and the table
    assert 0 < sp["draft_step_fraction"] == sp["costs_s"]["c_draft"] / sp["costs_s"]["c_verify"][0]
    assert sp["expected_speedup"] == sp["table"][2]["speedup"] and len(sp["table"]) >= 3
    st = cfg["draft"]["training"]
    assert st["steps"] == BUDGET["steps"] and st["loss_last"] < st["loss_first"]
    assert any("greedy agreement" in m for m in logs)


def test_draft_hf_checkpoint_loads_in_transformers_with_the_same_logits(trained):
    from transformers import AutoTokenizer, LlamaForCausalLM

    s, out, _ = trained
    hf = LlamaForCausalLM.from_pretrained(str(s.engine_dir / "draft_hf")).eval()
    AutoTokenizer.from_pretrained(str(s.engine_dir / "draft_hf"))
    b = load_bundle(s.engine_dir, methods=("draft_target",))
    ids = torch.tensor([[3, 17, 42, 99, 7, 5]])
    with torch.no_grad():
        ref = hf(ids).logits[0]
    got = b.draft.logits(b.draft(ids, torch.arange(6)[None], b.draft.new_cache(1, 16)))[0]
    assert (got - ref).abs().max() < 1e-2  # bf16 K/V attention against transformers' fp32 (test_runtime_model's TOL)


def test_unchanged_rebuild_is_a_no_op(trained, tiny_root):
    s, out, _ = trained
    before = (out / "config.json").stat().st_mtime_ns
    logs = []
    assert build_draft(s, log=logs.append) == out
    assert "up to date" in logs[-1] and (out / "config.json").stat().st_mtime_ns == before


def test_decode_with_the_trained_draft_equals_baseline(trained, tiny_tokenizer):
    s, _, _ = trained
    b = load_bundle(s.engine_dir)
    assert b.spec.num_draft_tokens == b.measured_k == 3
    reqs = [Request(tiny_tokenizer("Write a short poem about the sea.")["input_ids"], 20),
            Request(tiny_tokenizer("Why is the sky blue?")["input_ids"], 12)]
    base = decode(b, "baseline", reqs)
    spec = decode(b, "draft_target", reqs)
    assert [r.tokens for r in spec] == [r.tokens for r in base]
    assert all(r.draft_proposed > 0 for r in spec)


def test_reduced_vocab_bf16_draft_with_auto_k(tiny_root, tiny_tokenizer):
    logs = []
    s, out = _build(tiny_root, "dvocab", {"source": "train", "layers": 1, "vocab": 96, "dtype": "bfloat16",
                                          "train": {**BUDGET, "steps": 10}},
                    speculation={"num_draft_tokens": "auto"}, logs=logs)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft"]["vocab"] == 96 and (out / "draft_head.safetensors").is_file()
    spec_block = cfg["speculation"]
    assert spec_block["chosen_by"] == "measured" and 1 <= spec_block["num_draft_tokens"] <= 8
    assert len(spec_block["table"]) == 8 and any("auto -> k =" in m for m in logs)
    b = load_bundle(s.engine_dir)
    assert b.draft.vocab_ids.shape == (96,) and b.draft.lm_head.weight.shape[0] == 96
    assert b.spec.num_draft_tokens == spec_block["num_draft_tokens"]
    reqs = [Request(tiny_tokenizer("How do vaccines work?")["input_ids"], 16)]
    assert decode(b, "draft_target", reqs)[0].tokens == decode(b, "baseline", reqs)[0].tokens


def test_hf_directory_draft_with_the_same_tokenizer_builds(tiny_root, tiny_tokenizer):
    make_model_dir(tiny_root / "models" / "smalldraft", layers=1, seed=5, tokenizer=tiny_tokenizer)
    s, out = _build(tiny_root, "dhf", {"source": "models/smalldraft", "dtype": "float32"})
    assert json.loads((out / "config.json").read_text())["pretrained_config"]["num_hidden_layers"] == 1
    assert (s.engine_dir / "draft_hf" / "model.safetensors").is_file()


def test_a_pretrained_int4_draft_is_rounded_weighed_by_its_inputs_on_the_tuning_prompts(tiny_root, tiny_tokenizer):
    """An int4 / W4A8 pretrained draft: its build runs the tuning prompts and what the draft writes for them through
    the draft (model.linear_input_power), weighs int4's scale search by them (quant.quantize_int4) and records how many
    tokens it saw; the engine decodes exactly."""
    make_model_dir(tiny_root / "models" / "q4draft", layers=1, seed=7, tokenizer=tiny_tokenizer)
    s, out = _build(tiny_root, "dq4", {"source": "models/q4draft", "quantization": "int4_a8", "group_size": 32,
                                       "vocab": 96})
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft"]["training"]["int4_calibration_tokens"] > 0 and cfg["draft"]["vocab"] == 96
    b = load_bundle(s.engine_dir)
    assert b.draft.layers[0].w13.act8 and b.draft.lm_head.act8
    reqs = [Request(tiny_tokenizer("How do vaccines work?")["input_ids"], 16)]
    assert decode(b, "draft_target", reqs)[0].tokens == decode(b, "baseline", reqs)[0].tokens


def test_hf_directory_draft_with_another_tokenizer_is_refused(tiny_root):
    from tests.conftest import train_tokenizer

    make_model_dir(tiny_root / "models" / "otherdraft", layers=1, seed=6, tokenizer=train_tokenizer(300))
    with pytest.raises(PreflightError, match="tokenizers differ"):
        _build(tiny_root, "dother", {"source": "models/otherdraft"})
    assert not (tiny_root / "engines" / "dother" / "draft").exists()


def test_pick_k_verb_prints_the_table_and_stores_the_choice(trained, capsys):
    from pipeline.cli import main

    s, out, _ = trained
    spec_path = specmod.Path(s.root) / "build" / "dfull.yaml"
    assert main(["pick-k", str(spec_path), "--max-k", "3", "--write"]) == 0
    printed = capsys.readouterr().out
    assert "E[tok/step]" in printed and "auto -> k =" in printed
    block = json.loads((out / "config.json").read_text())["speculation"]
    assert block["chosen_by"] == "measured" and 1 <= block["num_draft_tokens"] <= 3 and len(block["table"]) == 3
    assert load_bundle(s.engine_dir).spec.num_draft_tokens == block["num_draft_tokens"]


def test_a_longer_max_draft_len_leaves_target_and_draft_weights_and_a_shorter_pick_k_range_rebuilds_the_draft(
        tiny_root, tiny_tokenizer):
    """limits.max_draft_len 8 -> 32 (long suffix drafts; the draft model's k unchanged) rewrites config.json only, also
    for engines built before `built_limits` was recorded; below 8 the draft's pick-k table changes, so it rebuilds."""
    import os

    make_model_dir(tiny_root / "models" / "lendraft", layers=1, seed=6, tokenizer=tiny_tokenizer)
    draft = {"source": "models/lendraft", "dtype": "float32"}
    s, out = _build(tiny_root, "dlen", draft)
    tdir = s.engine_dir / "target"
    mtimes = lambda: (os.stat(tdir / "model.safetensors").st_mtime_ns,  # noqa: E731
                      os.stat(out / "model.safetensors").st_mtime_ns)
    before = mtimes()
    for mdl, legacy in ((32, False), (16, True)):
        if legacy:  # as engines built before built_limits: the hash's limits read from the target's build_config
            for d in (tdir, out):
                cfg = json.loads((d / "config.json").read_text())
                cfg.pop("built_limits")
                if d == tdir:
                    cfg["build_config"]["max_draft_len"] = 8  # what it was built with, as such engines say
                (d / "config.json").write_text(json.dumps(cfg))
        logs = []
        s2 = specmod.load(write_spec(tiny_root, name="dlen", draft=draft, speculation={"num_draft_tokens": 3},
                                     limits={"max_draft_len": mdl}))
        build_target(s2, log=logs.append)
        build_draft(s2, log=logs.append)
        assert mtimes() == before, (mdl, logs)
        assert json.loads((tdir / "config.json").read_text())["build_config"]["max_draft_len"] == mdl
        assert all("up to date" in m for m in logs), logs
        assert load_bundle(s2.engine_dir).max_draft_len == mdl
    s3 = specmod.load(write_spec(tiny_root, name="dlen", draft=draft, speculation={"num_draft_tokens": 3},
                                 limits={"max_draft_len": 4}))
    build_target(s3, log=lambda *a: None)
    build_draft(s3, log=lambda *a: None)
    t_after, d_after = mtimes()
    assert t_after == before[0] and d_after != before[1]  # the target in place, the draft's pick-k table re-measured

"""Engine build: TensorRT-LLM-shaped config.json, no-op rebuilds, atomic writes, the generate verb."""

import json
import os

import pytest

from pipeline import engine as E
from pipeline import spec as specmod
from pipeline.cli import main
from pipeline.runtime.engine_io import EngineError, load_engine, read_config
from tests.conftest import write_spec


def test_config_json_has_tensorrt_llm_shape(tiny_engine):
    cfg = json.loads((tiny_engine / "config.json").read_text())
    assert set(cfg) >= {"version", "pretrained_config", "build_config", "files", "input_hash"}
    bc = cfg["build_config"]
    assert {"max_batch_size", "max_input_len", "max_seq_len", "max_draft_len", "speculative_decoding_mode"} <= set(bc)
    assert bc["max_draft_len"] == 8 and bc["speculative_decoding_mode"] == "draft_tokens_external"
    assert cfg["pretrained_config"]["num_key_value_heads"] == 2
    assert "model.safetensors" in cfg["files"] and (tiny_engine / "tokenizer.json").is_file()


def test_unchanged_rebuild_is_a_no_op(tiny_root, tiny_engine):
    s = specmod.load(tiny_root / "build" / "tiny.yaml")
    before = os.stat(tiny_engine / "model.safetensors").st_mtime_ns
    logs = []
    E.build_target(s, log=logs.append)
    assert os.stat(tiny_engine / "model.safetensors").st_mtime_ns == before
    assert any("up to date" in m for m in logs)


def test_failed_write_leaves_no_engine_and_no_temp_dir(tmp_path):
    dest = tmp_path / "engines" / "x" / "target"

    def write(tmp):
        (tmp / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        E.write_atomic(dest, write)
    assert not dest.exists()
    assert list(dest.parent.iterdir()) == []


def test_stale_temp_dirs_are_never_loaded_as_engines(tmp_path):
    stale = tmp_path / ".target.tmp-abc"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"x")
    with pytest.raises(EngineError, match="not a built engine"):
        read_config(tmp_path / "target")


def test_bf16_engine_stores_bf16_weights_and_generates(tmp_path, tiny_root):
    import yaml

    data = yaml.safe_load((tiny_root / "build" / "tiny.yaml").read_text())
    data.update(name="tiny-bf16", dtype="bfloat16")
    data["target"]["source"] = str(tiny_root / "models" / "target")
    p = tiny_root / "build" / "tiny-bf16.yaml"
    p.write_text(yaml.safe_dump(data))
    s = specmod.load(p)
    d = E.build_target(s, log=lambda *a: None)
    eng = load_engine(d)
    assert eng.model.embed.weight.dtype.is_floating_point and str(eng.model.embed.weight.dtype) == "torch.bfloat16"
    assert main(["generate", str(p), "--prompt", "Why is the sky blue?", "--max-tokens", "5"]) == 0


def test_generate_verb_prints_text_and_speed(tiny_root, tiny_engine, capsys):
    assert main(["generate", str(tiny_root / "build" / "tiny.yaml"), "--prompt", "Describe the water cycle.",
                 "--max-tokens", "8"]) == 0
    out = capsys.readouterr()
    assert "tokens/s" in out.err and out.out.strip()


def test_missing_source_is_a_clear_error(tmp_path):
    from tests.conftest import write_spec

    p = write_spec(tmp_path, name="nosrc", target={"source": "models/absent"})
    assert main(["engine", str(p)]) == 2


def test_a_longer_context_updates_the_config_in_place_without_rebuilding(tmp_path, tiny_root, tiny_engine):
    """limits.max_input_len / max_seq_len / max_batch_size size the runtime's caches, never the weights: changing them
    rewrites config.json and keeps the weights and the input hash (engines built on it stay current)."""
    import shutil

    root = tmp_path / "proj"
    shutil.copytree(tiny_root, root)
    s = specmod.load(root / "build" / "tiny.yaml")
    dest = E.build_target(s, log=lambda *a: None)
    before = os.stat(dest / "model.safetensors").st_mtime_ns
    old = json.loads((dest / "config.json").read_text())
    longer = specmod.load(write_spec(root, limits={"max_input_len": 300, "max_seq_len": 500}))
    logs = []
    E.build_target(longer, log=logs.append)
    cfg = json.loads((dest / "config.json").read_text())
    assert cfg["build_config"]["max_input_len"] == 300 and cfg["build_config"]["max_seq_len"] == 500
    assert cfg["input_hash"] == old["input_hash"] and os.stat(dest / "model.safetensors").st_mtime_ns == before
    assert any("written to its config.json" in m for m in logs)
    with pytest.raises(EngineError, match="max_position_embeddings"):
        E.build_target(specmod.load(write_spec(root, limits={"max_input_len": 300, "max_seq_len": 4096})),
                       log=lambda *a: None)


def test_a_longer_max_draft_len_is_written_in_place_again_and_again_and_speculation_on_or_off_rebuilds(
        tmp_path, tiny_root, tiny_engine):
    """No weight depends on max_draft_len (suffix drafts of 32 on the flagship need only config.json to say so); the
    limits the weights were built from stay recorded, so a second and third change are taken in place too. Whether
    the engine speculates at all (max_draft_len 0) is its build mode: that rebuilds."""
    import shutil

    root = tmp_path / "proj"
    shutil.copytree(tiny_root, root)
    dest = E.build_target(specmod.load(root / "build" / "tiny.yaml"), log=lambda *a: None)
    before = os.stat(dest / "model.safetensors").st_mtime_ns
    old = json.loads((dest / "config.json").read_text())
    for lim in ({"max_draft_len": 32}, {"max_draft_len": 32, "max_seq_len": 200}, {"max_draft_len": 8}):
        logs = []
        E.build_target(specmod.load(write_spec(root, limits=lim)), log=logs.append)
        cfg = json.loads((dest / "config.json").read_text())
        assert cfg["build_config"]["max_draft_len"] == lim["max_draft_len"]
        assert cfg["build_config"]["max_seq_len"] == lim.get("max_seq_len", 256)
        assert cfg["input_hash"] == old["input_hash"] and cfg["built_limits"]["max_draft_len"] == 8
        assert os.stat(dest / "model.safetensors").st_mtime_ns == before, lim
        assert any("written to its config.json" in m for m in logs), logs
    E.build_target(specmod.load(write_spec(root, limits={"max_draft_len": 0}, speculation={
        "num_draft_tokens": "auto", "prompt_lookup_num_tokens": 1})), log=lambda *a: None)
    assert os.stat(dest / "model.safetensors").st_mtime_ns != before  # speculative_decoding_mode none: rebuilt

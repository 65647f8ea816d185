"""Spec validation: the embedded default and the GPU examples load; errors name the key path."""

from pathlib import Path

import pytest
import yaml

from pipeline import spec as specmod
from pipeline.spec import SpecError

ROOT = Path(__file__).resolve().parent.parent


def test_embedded_default_spec_validates():
    s = specmod.load(ROOT / "build" / "smollm2.yaml")
    assert (s.name, s.backend, s.device, s.dtype) == ("smollm2", "torch", "cpu", "float32")
    assert s.target.source == "smollm2"
    assert Path(s.root) == ROOT


@pytest.mark.parametrize("path", sorted((ROOT / "build").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_spec_validates(path):
    specmod.load(path)


def _err(data) -> str:
    with pytest.raises(SpecError) as e:
        specmod.parse(data)
    return str(e.value)


def test_unknown_key_names_its_path_and_the_valid_keys():
    msg = _err({"name": "x", "limits": {"max_batch": 4}})
    assert msg.startswith("limits.max_batch: unknown key")
    assert "max_batch_size" in msg


def test_wrong_type_names_path_value_and_expected_type():
    msg = _err({"name": "x", "limits": {"max_seq_len": "long"}})
    assert "limits.max_seq_len" in msg and "'long'" in msg and "integer" in msg


def test_bad_enum_lists_the_choices():
    msg = _err({"name": "x", "backend": "vllm"})
    assert "backend" in msg and "'torch'" in msg and "'tensorrt_llm'" in msg


def test_missing_name_is_reported():
    assert _err({}).startswith("name: required key is missing")


def test_cross_field_limits_are_checked():
    msg = _err({"name": "x", "limits": {"max_input_len": 4096, "max_seq_len": 2048}})
    assert msg.startswith("limits.max_input_len") and "max_seq_len" in msg


def test_draft_length_above_max_draft_len_names_the_fix():
    msg = _err({"name": "x", "limits": {"max_draft_len": 2}, "speculation": {"num_draft_tokens": 5}})
    assert "speculation.num_draft_tokens" in msg and "max_draft_len" in msg


def test_negative_disable_at_batch_names_the_key_and_the_meaning_of_zero():
    msg = _err({"name": "x", "speculation": {"disable_at_batch": -1}})
    assert msg.startswith("speculation.disable_at_batch") and "0 (never" in msg


def test_torch_backend_refuses_tensor_parallelism():
    assert "parallel" in _err({"name": "x", "parallel": {"tp": 2}})


def test_medusa_choices_with_missing_prefix_name_the_path():
    msg = _err({"name": "x", "medusa": {"source": "train", "num_heads": 3, "choices": [[0], [1, 0], [0, 0]]}})
    assert "medusa.choices" in msg and "[1, 0]" in msg and "prefix [1]" in msg


def test_list_items_are_checked_with_their_index():
    msg = _err({"name": "x", "validate": {"concurrency": [1, "two"]}})
    assert "validate.concurrency[1]" in msg


def test_yaml_syntax_error_is_a_spec_error(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        specmod.load(p)


def test_missing_file_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        specmod.load(tmp_path / "nope.yaml")


def test_check_verb_exits_2_with_the_message(tmp_path, capsys):
    from pipeline.cli import main

    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump({"name": "x", "dtype": "fp8"}))
    assert main(["check", str(p)]) == 2
    assert "dtype" in capsys.readouterr().err


def test_duplicate_keys_are_refused(tmp_path):
    p = tmp_path / "dup.yaml"
    p.write_text("name: a\nlimits:\n  max_seq_len: 512\n  max_seq_len: 1024\n")
    with pytest.raises(SpecError, match="'max_seq_len' appears twice"):
        specmod.load(p)


def test_huge_and_infinite_numbers_are_refused():
    assert "2**31" in _err({"name": "x", "limits": {"max_batch_size": 10**26}})
    assert "triton.startup_timeout_s" in _err({"name": "x", "triton": {"startup_timeout_s": float("inf")}})


def test_unhashable_yaml_key_is_a_spec_error(tmp_path):
    p = tmp_path / "k.yaml"
    p.write_text("? {a: 1}\n: x\nname: y\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        specmod.load(p)


@pytest.mark.parametrize("value", [-1, 4])
def test_draft_lookup_min_ngram_is_bounded_by_the_lookup_ngram(value):
    msg = _err({"name": "x", "speculation": {"draft_lookup_min_ngram": value, "prompt_lookup_max_ngram": 3}})
    assert msg.startswith("speculation.draft_lookup_min_ngram") and "between 1 and prompt_lookup_max_ngram (3)" in msg


def test_draft_confidence_is_a_probability_and_needs_a_maximum_k():
    msg = _err({"name": "x", "speculation": {"draft_confidence": 1.0, "num_draft_tokens": 4}})
    assert msg.startswith("speculation.draft_confidence") and "probability below 1" in msg
    msg = _err({"name": "x", "speculation": {"draft_confidence": 0.7, "num_draft_tokens": "auto"}})
    assert "num_draft_tokens set to the maximum draft length" in msg
    s = specmod.parse({"name": "x", "speculation": {"draft_confidence": 0, "num_draft_tokens": "auto"}})
    assert s.speculation.draft_confidence == 0

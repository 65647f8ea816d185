"""Property tests: malformed YAML and wrong types make the spec loader raise SpecError naming the field, never crash."""

from __future__ import annotations

import copy
import dataclasses
import re
import tempfile
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import spec as specmod

pytestmark = pytest.mark.slow  # 150 generated documents per property
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TMP = Path(tempfile.mkdtemp(prefix="spec-fuzz-"))
BASE = {"name": "fuzz", "target": {"source": "models/target"}}
# An error message starts with the key path it is about (`limits.max_seq_len: ...`) or the file.
LEADING_PATH = re.compile(r"""^(spec file '|[^\s'"]+: |[^\s'"]*['"].*: )""", re.S)


def field_paths(cls=specmod.Spec, prefix: str = "") -> list[str]:
    """Every leaf key path of the schema, e.g. `triton.grpc_port`."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            out += field_paths(hints[f.name], path + ".")
        else:
            out.append(path)
    return out


PATHS = field_paths()
SECTIONS = sorted({p.split(".")[0] for p in PATHS})
MAPPINGS = sorted({p.split(".")[0] for p in PATHS if "." in p})

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["auto", "train", "none", "cpu", "cuda", "float32", "torch", "tensorrt_llm", "", "0", "1e3"]),
)
junk = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                    max_leaves=8)


def set_path(data: dict, path: str, value) -> None:
    keys = path.split(".")
    d = data
    for k in keys[:-1]:
        if not isinstance(d.get(k), dict):
            d[k] = {}
        d = d[k]
    d[keys[-1]] = value


def check(outcome) -> str | None:
    """Run the loader; return the SpecError message, or None when the spec was accepted."""
    try:
        s = outcome()
    except specmod.SpecError as e:
        msg = str(e)
        assert msg and LEADING_PATH.match(msg), f"error does not start with a key path: {msg!r}"
        return msg
    assert isinstance(s, specmod.Spec)
    return None


@SETTINGS
@given(st.dictionaries(st.sampled_from(PATHS), junk, min_size=1, max_size=4))
def test_wrong_types_and_values_at_known_keys_are_spec_errors_naming_a_key(changes):
    data = copy.deepcopy(BASE)
    for path, value in changes.items():
        set_path(data, path, value)
    msg = check(lambda: specmod.parse(data, TMP))
    if msg is not None:
        named = msg.split(":")[0].split(".")[0].split("[")[0]
        assert named in SECTIONS, msg


@SETTINGS
@given(st.sampled_from(MAPPINGS + [""]), st.one_of(st.text(max_size=10), st.integers(), st.booleans()), junk)
def test_unknown_keys_are_named_with_the_valid_ones(section, key, value):
    known = {p.split(".")[-1] for p in PATHS} | set(SECTIONS)
    if key in known:
        return
    data = copy.deepcopy(BASE)
    where = data.setdefault(section, {}) if section else data
    where[key] = value
    msg = check(lambda: specmod.parse(data, TMP))
    shown = key if isinstance(key, str) and key.isidentifier() else repr(key)
    assert msg is not None and msg.startswith(f"{section + '.' if section else ''}{shown}: unknown key"), msg
    assert "valid keys here are" in msg


@SETTINGS
@given(junk)
def test_a_document_that_is_not_a_mapping_is_a_spec_error(value):
    if isinstance(value, dict) or value is None:  # an empty document is an empty mapping
        return
    msg = check(lambda: specmod.parse(value, TMP))
    assert msg is not None and "expected a mapping" in msg


@settings(SETTINGS, max_examples=300)
@given(st.one_of(st.text(max_size=200).map(str.encode), st.binary(max_size=64)))
def test_arbitrary_text_or_bytes_load_or_fail_with_a_spec_error(data):
    p = TMP / "t.yaml"
    p.write_bytes(data)
    check(lambda: specmod.load(p))


@SETTINGS
@given(st.lists(st.sampled_from(["name: x\n", "limits:\n", "  max_seq_len: 8\n", "- a\n", ": :\n", "{", "}", "[",
                                 "]", "&a ", "*a ", "!!binary ", "  ", "\t", "'", '"', "%YAML 1.1\n", "---\n",
                                 "? k\n", "triton: {grpc_port: 70000}\n", "threads: -1\n"]), max_size=12))
def test_malformed_yaml_fragments_are_spec_errors(parts):
    p = TMP / "m.yaml"
    p.write_text("".join(parts))
    check(lambda: specmod.load(p))


def test_pathological_documents_are_spec_errors():
    cases = {
        "deep nesting": "name: " + "[" * 5000 + "]" * 5000,
        "python tag": "name: !!python/object/apply:os.system [echo hi]",
        "alias to a scalar": "name: &a x\ntriton: *a",
        "a set": "name: !!set {a, b}",
        "a date": "name: 2024-01-01",
        "not UTF-8": b"name: \xff\xfe",
    }
    p = TMP / "p.yaml"
    for what, text in cases.items():
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        msg = check(lambda: specmod.load(p))
        assert msg is not None, what
    assert "does not exist" in check(lambda: specmod.load(TMP / "missing.yaml"))


def test_the_shipped_spec_round_trips():
    root = Path(__file__).resolve().parent.parent
    s = specmod.load(root / "build" / "smollm2.yaml")
    again = specmod.parse(yaml.safe_load(yaml.safe_dump(specmod.to_dict(s))), s.root)
    assert specmod.to_dict(again) == specmod.to_dict(s)

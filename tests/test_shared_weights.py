"""One copy of the weights for every process serving an engine (pipeline/runtime/shared.py): models loaded with
PIPELINE_SHARED_WEIGHTS=1 map one file of the laid-out weights, compute the same bits as a private copy, share its
pages across processes, never trust a stale file, and keep a process's in-place writes to itself."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from pipeline.runtime import shared

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_tokenizer):
    """A target engine large enough that its linear layers are shared (hidden 256: 128 KB and more per matrix)."""
    from pipeline import spec as specmod
    from pipeline.engine import build_target
    from tests.conftest import make_model_dir, write_spec

    root = tmp_path_factory.mktemp("shared")
    make_model_dir(root / "models" / "target", hidden=256, heads=4, kv_heads=2, tokenizer=tiny_tokenizer)
    return build_target(specmod.load(write_spec(root, name="shared")), log=lambda *a: None)


def _load(engine_dir: Path, share: bool, monkeypatch):
    from pipeline.runtime.engine_io import load_model_dir

    monkeypatch.setenv("PIPELINE_SHARED_WEIGHTS", "1" if share else "0")
    return load_model_dir(engine_dir, "cpu")[0]


def _logits(model) -> torch.Tensor:
    tokens = torch.tensor([[5, 17, 33, 2, 9, 41]])
    pos = torch.arange(tokens.shape[1])[None]
    with torch.no_grad():
        return model.logits(model(tokens, pos, model.new_cache(1, 16)))


def _files(engine_dir: Path) -> list[Path]:
    return sorted(engine_dir.glob(f"{shared.PREFIX}*.bin"))


def test_shared_models_map_one_file_and_compute_the_private_copys_bits(engine, monkeypatch):
    for f in _files(engine):
        f.unlink()
    private = _load(engine, False, monkeypatch)
    assert not _files(engine)
    a, b = _load(engine, True, monkeypatch), _load(engine, True, monkeypatch)
    (f,) = _files(engine)
    maps = shared.shared_mappings()
    assert str(f) in maps and len(maps) == 1
    assert torch.equal(_logits(a), _logits(private)) and torch.equal(_logits(b), _logits(private))
    big = [t for t in a.state_dict().values() if t.numel() * t.element_size() >= shared.MIN_BYTES]
    assert big and all(
        t.untyped_storage().data_ptr() != p.untyped_storage().data_ptr() for t, p in zip(big, b.state_dict().values()))
    assert f.stat().st_size >= sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in big}.values())


def test_a_stale_file_is_never_used_but_rewritten(engine, monkeypatch):
    """Same name and size, other bytes (an engine rebuilt in place, an older layout): the loader compares the bytes
    with the weights it laid out, rewrites the file and computes the right logits."""
    want = _logits(_load(engine, False, monkeypatch))
    _load(engine, True, monkeypatch)
    (f,) = _files(engine)
    raw = bytearray(f.read_bytes())
    raw[: len(raw) // 2] = bytes(len(raw) // 2)
    f.unlink()  # a new inode: the mapping above keeps the old pages
    f.write_bytes(bytes(raw))
    assert torch.equal(_logits(_load(engine, True, monkeypatch)), want)
    assert f.read_bytes() != bytes(raw)


def test_two_processes_share_the_pages_and_keep_their_writes_to_themselves(engine, monkeypatch):
    """A second process maps the same file: each process's proportional share (Pss) of the mapping is about half its
    resident size, so the pair holds one copy. A process that writes a weight in place gets a private page; the file
    and the other process do not change."""
    _load(engine, True, monkeypatch)
    (f,) = _files(engine)
    before = f.read_bytes()
    code = textwrap.dedent(f"""
        import os, sys, time
        os.environ["PIPELINE_SHARED_WEIGHTS"] = "1"
        from pathlib import Path
        from pipeline.runtime.engine_io import load_model_dir
        model = load_model_dir(Path({str(engine)!r}), "cpu")[0]
        sum(float(t.float().sum()) for t in model.state_dict().values())  # touch every page
        print("loaded", flush=True)
        sys.stdin.readline()
        w = next(t for t in model.state_dict().values() if t.numel() * t.element_size() >= 1 << 16)
        print("sum", float(w.float().sum()), flush=True)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "loaded"
        mine = _load(engine, True, monkeypatch)
        for t in mine.state_dict().values():
            float(t.float().sum())
        time.sleep(0.2)
        theirs = shared.shared_mappings(p.pid)[str(f)]
        assert theirs["Rss"] > 0 and theirs["Pss"] <= 0.6 * theirs["Rss"], theirs
        w = next(t for t in mine.state_dict().values() if t.numel() * t.element_size() >= 1 << 16)
        their_sum = float(w.float().sum())
        w.add_(1.0)  # copy-on-write: this process's page only
        assert float(w.float().sum()) != their_sum
        p.stdin.write("\n")
        p.stdin.flush()
        assert float(p.stdout.readline().split()[1]) == their_sum
        assert f.read_bytes() == before
    finally:
        p.kill()
        p.wait()


def test_without_the_switch_nothing_is_written_or_mapped(engine, monkeypatch):
    for f in _files(engine):
        f.unlink()
    _load(engine, False, monkeypatch)
    assert not _files(engine)

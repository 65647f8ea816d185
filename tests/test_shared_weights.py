"""One copy of the weights for every process serving an engine (pipeline/runtime/shared.py): models loaded with
PIPELINE_SHARED_WEIGHTS=1 map one file of the laid-out weights, compute the same bits as a private copy, share its
pages across processes, never trust a stale file, and keep a process's in-place writes to itself."""

from __future__ import annotations

import shutil
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


_PAGEOUT = textwrap.dedent("""
    import ctypes, os, sys
    os.environ["PIPELINE_SHARED_WEIGHTS"] = "1"
    from pathlib import Path
    from pipeline.runtime import shared
    from pipeline.runtime.engine_io import load_model_dir
    engine = Path(sys.argv[1])
    model = load_model_dir(engine, "cpu")[0]
    sum(float(t.float().sum()) for t in model.state_dict().values())  # touch every page
    (f,) = engine.glob(shared.PREFIX + "*.bin")
    spans = [[int(a, 16) for a in line.split()[0].split("-")] for line in open("/proc/self/maps") if str(f) in line]
    before = shared.shared_mappings()[str(f)]["Rss"]
    libc = ctypes.CDLL(None, use_errno=True)
    refused = [libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), 21) != 0 for a, b in spans]  # MADV_PAGEOUT
    after = shared.shared_mappings()[str(f)]["Rss"]
    print(before, after, shared.locked_bytes(), f.stat().st_size, any(refused), flush=True)
""")


def _pageout(engine: Path, env: dict, prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([*(prefix or []), sys.executable, "-c", _PAGEOUT, str(engine)], cwd=ROOT, text=True,
                          capture_output=True, env={**os.environ, **env}, timeout=300)


def test_served_weights_are_locked_so_the_kernel_cannot_page_them_out(engine):
    """Shared weights are file pages, which memory pressure can evict (a 64-token request after that took 15x as
    long on the flagship). Locked as touched (mlock2 MLOCK_ONFAULT), the whole mapping counts as locked and a request
    to page it out leaves every page resident; with PIPELINE_LOCK_WEIGHTS=0 the same request empties it. (That
    locking copies no page is the two-process test above: it runs locked, and each process's Pss is half its Rss.)"""
    locked = _pageout(engine, {"PIPELINE_LOCK_WEIGHTS": "1"})
    assert locked.returncode == 0, locked.stderr
    before, after, vmlck, size, _ = locked.stdout.split()
    assert int(before) > 0 and int(after) == int(before)
    assert int(vmlck) >= int(size)
    free = _pageout(engine, {"PIPELINE_LOCK_WEIGHTS": "0"})
    assert free.returncode == 0, free.stderr
    before, after, vmlck, _, refused = free.stdout.split()
    assert refused == "False" and int(vmlck) == 0
    assert int(after) < int(before) / 2, free.stdout


@pytest.mark.skipif(not shutil.which("setpriv") or not shutil.which("prlimit"), reason="needs util-linux setpriv")
def test_a_refused_lock_is_said_on_stderr_and_the_model_still_serves(engine):
    """Without CAP_IPC_LOCK and with `ulimit -l` below the file's size, mlock2 fails: the process says why, how big the
    limit must be and how to silence it, and computes as before (unlocked)."""
    r = _pageout(engine, {"PIPELINE_LOCK_WEIGHTS": "1"},
                 ["prlimit", "--memlock=65536:65536", "setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock"])
    if r.returncode != 0 and "setpriv" in r.stderr:
        pytest.skip(f"setpriv cannot drop CAP_IPC_LOCK here: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    assert "weights not locked in memory" in r.stderr and "ulimit -l: 64 KB" in r.stderr, r.stderr
    assert "PIPELINE_LOCK_WEIGHTS=0" in r.stderr
    assert int(r.stdout.split()[2]) == 0

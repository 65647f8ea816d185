"""bench and validate name llama.cpp only for a GGUF target, and say how to install it when it is missing."""

from __future__ import annotations

from pipeline import peers
from pipeline import spec as specmod
from tests.conftest import write_spec


def test_no_llama_cpp_peer_for_a_target_that_is_not_a_gguf(tmp_path):
    (tmp_path / "models" / "target").mkdir(parents=True)
    s = specmod.load(write_spec(tmp_path))
    assert peers.gguf_of(s) is None
    assert peers.gguf_peers(s, [[1, 2]], 4, log=lambda *a: None) == {}


def test_a_gguf_target_without_llama_cpp_gets_a_note_that_says_what_to_run(tmp_path, monkeypatch):
    f = tmp_path / "models" / "t.gguf"
    f.parent.mkdir(parents=True)
    f.write_bytes(b"GGUF" + bytes(60))
    s = specmod.load(write_spec(tmp_path, target={"source": "models/t.gguf"}))
    assert peers.gguf_of(s) == f.resolve() or peers.gguf_of(s) == f
    monkeypatch.setattr(peers, "llama_cpp_available", lambda: False)
    out = peers.gguf_peers(s, [[1, 2]], 4, log=lambda *a: None, lookup=(1, 4))
    assert out == {"llama_cpp": {"tokens_per_s": None, "note": "llama-cpp-python not installed (make peers)"}}

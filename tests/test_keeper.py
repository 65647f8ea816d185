"""The keeper (pipeline/triton/keeper.py) against the real tritonserver: a server that dies of a fatal signal, or
hangs after one, is started again and answers; a stopped server is not."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pipeline import spec as specmod
from pipeline.client import generate
from pipeline.triton import keeper
from pipeline.triton import server as srvmod
from tests.conftest import make_model_dir, train_tokenizer, write_spec

pytestmark = pytest.mark.server
UNUSED_END = 0


def _until(cond, what: str, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.2)


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    from pipeline.cli import main
    from pipeline.engine import build_target

    root = tmp_path_factory.mktemp("keep")
    make_model_dir(root / "models" / "target", tokenizer=train_tokenizer())
    grpc, http, metrics = srvmod.free_ports(3)
    path = write_spec(root, name="keep", triton={"grpc_port": grpc, "http_port": http, "metrics_port": metrics,
                                                 "startup_timeout_s": 240}, openai={"enabled": False},
                      limits={"max_batch_size": 2, "max_input_len": 64, "max_seq_len": 128, "max_draft_len": 4})
    s = specmod.load(path)
    build_target(s, log=lambda *a: None)
    assert main(["serve", str(path)]) == 0
    try:
        yield s, path
    finally:
        main(["stop", str(path)])


def _readies(s) -> int:
    """How many servers the keeper has logged ready so far."""
    return keeper.log_file(s).read_text().count("tritonserver ready in") if keeper.log_file(s).is_file() else 0


def _restarted(s, old: int, readies: int) -> int:
    """The keeper's new server, once it is ready and the keeper watches it (it logged one more server ready than the
    `readies` counted before the old one was killed)."""
    _until(lambda: srvmod.running_pid(s) not in (None, old) and srvmod.is_ready(s) and _readies(s) > readies,
           f"the keeper did not start the server again after pid {old}")
    return srvmod.running_pid(s)


def test_a_server_that_dies_of_a_fatal_signal_is_started_again_and_answers(kept):
    s, _ = kept
    want = generate(srvmod.grpc_url(s), "ensemble", "Tell me about the moon.", 8, end_id=UNUSED_END)["text"]
    assert keeper.running_pid(s), "serve (detached) starts a keeper"
    old, readies = srvmod.running_pid(s), _readies(s)
    os.kill(old, signal.SIGSEGV)  # as tritonserver 2.51's gRPC race does (docs/serving.md)
    new = _restarted(s, old, readies)
    assert generate(srvmod.grpc_url(s), "ensemble", "Tell me about the moon.", 8, end_id=UNUSED_END)["text"] == want
    assert "Signal (11) received." in (s.report_dir / "triton.log.prev").read_text(), "the dead server's log is kept"
    assert f"tritonserver pid {old} died after a fatal signal" in keeper.log_file(s).read_text()
    assert srvmod.running_pid(s) == new


def test_a_server_hung_after_a_fatal_signal_is_killed_and_started_again(kept, monkeypatch):
    """The CI run's case: the crash handler never finished, the process stayed and answered nobody. Here the server
    is frozen (SIGSTOP) and its log says what tritonserver's handler prints first; the keeper waits HUNG_S (15 s)."""
    s, _ = kept
    old, readies = srvmod.running_pid(s), _readies(s)
    os.kill(old, signal.SIGSTOP)
    with open(srvmod.log_file(s), "a") as f:
        f.write("Signal (11) received.\n")
    _restarted(s, old, readies)
    assert "still runs 15 s later (hung in its crash handler); killing it" in keeper.log_file(s).read_text()
    assert generate(srvmod.grpc_url(s), "ensemble", "Tell me about the moon.", 4, end_id=UNUSED_END)["text"]


def test_a_stopped_server_is_not_started_again_and_the_keeper_ends(kept):
    from pipeline.cli import main

    s, path = kept
    kpid = keeper.running_pid(s)
    assert kpid and srvmod.running_pid(s)
    assert main(["stop", str(path)]) == 0
    time.sleep(2 * keeper.POLL_S + 1.0)
    assert srvmod.running_pid(s) is None and keeper.running_pid(s) is None
    assert srvmod.port_free(s.triton.host, s.triton.grpc_port)


def test_the_keeper_leaves_a_server_down_that_keeps_dying(kept):
    """Past max_restarts in the window the server stays down and the keeper says why (no restart loop forever)."""
    import threading

    from pipeline.cli import main

    s, path = kept
    if srvmod.running_pid(s) is None:
        assert main(["serve", str(path), "--no-keep"]) == 0
    assert keeper.running_pid(s) is None
    lines: list[str] = []
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("rc", keeper.keep(s, lines.append, max_restarts=0)))
    t.start()
    _until(lambda: lines, "the keeper never began")
    old = srvmod.running_pid(s)
    os.killpg(old, signal.SIGKILL)
    t.join(30)
    assert out.get("rc") == 1, lines
    assert "died unexpectedly: 1 deaths in 600 s, more than the keeper restarts (0)" in lines[-1]
    assert srvmod.running_pid(s) is None and not srvmod.pid_file(s).is_file()


def test_with_no_server_running_the_keeper_says_so_and_ends(tmp_path):
    s = specmod.load(write_spec(tmp_path, name="gone"))
    s.report_dir.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    assert keeper.keep(s, lines.append) == 1 and "nothing to keep" in lines[0]

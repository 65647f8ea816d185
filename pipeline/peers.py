"""llama.cpp's own server as the peer, on the same GGUF files: what a person running a GGUF model on a CPU would run.

`make peers` (`python -m pipeline peers`) builds `llama-server` and `llama-bench` from the llama.cpp sources vendored
in the pinned llama-cpp-python sdist, once per CPU, into the cache (never the repository): the sdist is a pip
download, cmake and ninja come from PyPI where the system lacks them, and the binaries appear in their final
directory only when the build is complete (built and copied into a `.partial-<pid>` directory, then renamed).

validate and bench run it on the target's GGUF through its HTTP API (OpenAI chat completions, so the GGUF's own
chat template applies), on the prompts they run ours on, greedy, with the same token budget: plain, prompt by prompt
between ours (`PlainPeer`), and then with the draft's GGUF (`--spec-type draft-simple`: with `-md` alone the server
loads the draft and never drafts), the better of `--spec-draft-n-max` 3 and 6. Each mode is its own server process
(the speculative settings are per server in this llama.cpp), bound to 127.0.0.1 on a free port and stopped
afterwards. Where the binary is not built, the
report carries a note saying how to build it, not a figure.

AMX. On a Sapphire Rapids Xeon, a `GGML_NATIVE=ON` build crashes (SIGSEGV in `ggml_backend_amx_mul_mat`) on any
batch of more than one token: the server's warm-up, every prompt, every verification. The two ways out are
`--no-repack` at run time or a build without AMX. We build without AMX (`-mno-amx-tile -mno-amx-int8
-mno-amx-bf16` beside `-march=native`; GCC keeps explicit `-mno-*` whatever their order): the build then still
repacks Q4_K / Q6_K weights for AVX-512 (`--no-repack` would give that up: its plain decode was about 10% slower
there), and AMX only ever ran the batched matmuls that crash. The same flags change nothing on CPUs without AMX.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

LLAMA_CPP_VERSION = "0.3.36"  # llama-cpp-python's sdist, which vendors llama.cpp's sources
BINARIES = ("llama-server", "llama-bench")
NO_AMX = ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]
CMAKE_ARGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
              "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF",
              "-DLLAMA_USE_PREBUILT_UI=OFF",  # ON would download the web UI at configure time
              "-DCMAKE_C_FLAGS=" + " ".join(NO_AMX), "-DCMAKE_CXX_FLAGS=" + " ".join(NO_AMX)]
# cmake's compiler launcher for the llama.cpp build: ggml's sources (every kernel llama-server decodes with) compile as
# configured, -O3 -march=native; the rest (llama, common, server, mtmd, httplib: 90% of the compile's CPU time,
# none of it in the per-token matmuls) at -O1: 4.9 min against 6.5 on a quiet Zen 4, decoding as fast (docs/peers.md,
# "Time").
LAUNCHER = r"""#!/usr/bin/env bash
src= prev=
for a in "$@"; do [[ $prev == -c ]] && src=$a; prev=$a; done
[[ $src == */llama.cpp/ggml/* ]] && exec "$@"
args=()
for a in "$@"; do [[ $a == -O[23s] || $a == -Ofast ]] && a=-O1; args+=("$a"); done
exec "${args[@]}"
"""
DRAFT_N_MAX = (3, 6)
# The draft modes stop after the probe prompts when the fastest runs under this fraction of plain decoding there.
PROBE_LOSES = 0.8
SERVER_CTX = 4096  # llama-server's context (-c): a prompt and its 128 tokens with room to spare
NOT_BUILT = "llama-server not built for this CPU (run `make peers`; 5-7 min on 2 quiet cores)"


# ---- the build --------------------------------------------------------------------------------------------------

def cpu_tag(flags: set[str] | None = None, machine: str | None = None) -> str:
    """The build's key: a native build runs only on CPUs with its instruction sets, so the cache holds one build per
    set of CPU flags (machine, the widest vector ISA for people to read, and a hash of every flag)."""
    if flags is None:
        from pipeline.runtime.kernels import _cpu_flags  # lazy: loads torch (~1.5 s); the CLI imports peers at start

        flags = _cpu_flags()
    machine = machine or platform.machine()
    isa = ("amx" if "amx_tile" in flags else "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags
           else "generic")
    digest = hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:8]
    return f"{machine}-{isa}-{digest}"


def install_dir(tag: str | None = None) -> Path:
    """Where the built binaries live: outside the repository, in the pipeline's cache, one directory per CPU."""
    from pipeline.sources import cache_dir  # lazy: loads torch (~1.5 s); the CLI imports peers at start

    return cache_dir() / f"llama.cpp-{LLAMA_CPP_VERSION}-{tag or cpu_tag()}-{build_digest()}"


def build_digest() -> str:
    """A digest of how llama.cpp is built (cmake arguments, launcher): a change builds anew beside the old."""
    return hashlib.sha256(json.dumps([CMAKE_ARGS, LAUNCHER]).encode()).hexdigest()[:6]


def binary(name: str = "llama-server", tag: str | None = None) -> Path | None:
    """The built binary, or None. The install directory only ever appears complete (see `build`)."""
    p = install_dir(tag) / "bin" / name
    return p if p.is_file() and os.access(p, os.X_OK) else None


def _tool(name: str, log) -> str:
    """cmake / ninja: the system's, else the venv's, else installed into the venv from PyPI."""
    venv_bin = Path(sys.executable).parent
    found = shutil.which(name) or (str(venv_bin / name) if (venv_bin / name).is_file() else None)
    if found:
        return found
    log(f"{name} not found: pip install {name}")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", name], check=True)
    return str(venv_bin / name)


def _sources(work: Path, log) -> Path:
    """The llama.cpp tree of the pinned sdist, downloaded once into the cache and extracted into `work`."""
    from pipeline.sources import cache_dir  # lazy: loads torch (~1.5 s); the CLI imports peers at start

    src = cache_dir() / "src"
    sdist = src / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"
    if not sdist.is_file():
        src.mkdir(parents=True, exist_ok=True)
        log(f"downloading the llama-cpp-python {LLAMA_CPP_VERSION} sdist (76 MB) ...")
        with tempfile.TemporaryDirectory(dir=src) as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps",
                            f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", tmp], check=True)
            os.replace(Path(tmp) / sdist.name, sdist)
    tree = work / f"llama_cpp_python-{LLAMA_CPP_VERSION}" / "vendor" / "llama.cpp"
    if not (tree / "CMakeLists.txt").is_file():
        with tarfile.open(sdist) as tf:
            tf.extractall(work, filter="data")
    return tree


def build(log=print, jobs: int | None = None) -> Path:
    """Build llama-server and llama-bench for this CPU (or reuse the build); returns the install directory.

    The object files stay in `<install>.build` so an interrupted build resumes; the binaries are copied into
    `<install>.partial-<pid>` and that directory renamed into place last, so no interrupted build ever leaves an
    install directory that looks complete."""
    dest = install_dir()
    if all(binary(n) for n in BINARIES):
        log(f"llama.cpp {LLAMA_CPP_VERSION} already built: {dest}")
        return dest
    cmake, ninja = _tool("cmake", log), _tool("ninja", log)
    work = dest.with_name(dest.name + ".build")
    work.mkdir(parents=True, exist_ok=True)
    tree = _sources(work, log)
    bdir = work / "build"
    launcher = work / "o1-outside-ggml.sh"
    launcher.write_text(LAUNCHER)
    launcher.chmod(0o755)
    log(f"building llama.cpp {LLAMA_CPP_VERSION} ({', '.join(BINARIES)}) in {bdir}: 5-7 min on 2 quiet cores")
    subprocess.run([cmake, "-S", str(tree), "-B", str(bdir), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
                    *CMAKE_ARGS, *launcher_args(launcher)], check=True, stdout=subprocess.DEVNULL)
    subprocess.run([*low_priority(), cmake, "--build", str(bdir), "-j", str(jobs or os.cpu_count() or 1), "--target",
                    *BINARIES], check=True)
    return install(bdir, log)


def launcher_args(launcher: Path) -> list[str]:
    """The cmake arguments that put LAUNCHER in front of every C and C++ compile."""
    return [f"-DCMAKE_C_COMPILER_LAUNCHER={launcher}", f"-DCMAKE_CXX_COMPILER_LAUNCHER={launcher}"]


def low_priority() -> list[str]:
    """The compile's command prefix: `nice -n 19`. make all builds llama.cpp beside the engines (make -j2 engine
    peers), and the engine build times draft and verification steps to pick k; at the lowest priority the compile
    takes the cores only while the engine build leaves them idle, so those timings stay the quiet machine's."""
    exe = shutil.which("nice")
    return [exe, "-n", "19"] if exe else []


def install(bdir: Path, log=print) -> Path:
    """Copy the binaries of a finished build (`bdir`/bin) into this CPU's install directory, which appears only
    once complete: they are copied into `<install>.partial-<pid>`, which is then renamed into place."""
    dest = install_dir()
    part = dest.with_name(f"{dest.name}.partial-{os.getpid()}")
    shutil.rmtree(part, ignore_errors=True)
    (part / "bin").mkdir(parents=True)
    for n in BINARIES:
        shutil.copy2(bdir / "bin" / n, part / "bin" / n)
    (part / "build.json").write_text(json.dumps({"llama_cpp_python": LLAMA_CPP_VERSION, "cpu_tag": cpu_tag(),
                                                 "cmake_args": CMAKE_ARGS,
                                                 "launcher": "-O1 outside ggml (pipeline/peers.py LAUNCHER)"},
                                                indent=2))
    if dest.exists():  # an older, incomplete layout: replaced whole
        shutil.rmtree(dest)
    os.rename(part, dest)
    log(f"llama.cpp built: {dest / 'bin'}")
    return dest


# ---- the server -------------------------------------------------------------------------------------------------

@dataclass
class Mode:
    """One way to run the server: plain, or speculative with a draft GGUF and `--spec-draft-n-max`."""

    draft: Path | None = None
    n_max: int = 0

    @property
    def name(self) -> str:
        return f"draft n-max {self.n_max}" if self.draft else "plain"


def server_threads(spec) -> int:
    """llama-server's thread count: the spec's `threads`, else every core (as ours)."""
    return spec.threads or os.cpu_count() or 1


def server_command(exe: Path, gguf: Path, port: int, threads: int, ctx: int = SERVER_CTX,
                   mode: Mode = Mode(), slots: int = 1) -> list[str]:
    """llama-server's command line: one slot, 127.0.0.1, the GGUF's chat template (jinja), no web UI; with a
    draft, `--spec-type draft-simple` (without it the server loads the draft and never drafts) and the draft's
    thread count (its context follows the target's: this llama.cpp has no flag for it). `slots`: `-np`, requests it
    decodes at once (the concurrency curve, pipeline/peer_curve.py; `-c` is shared among them)."""
    cmd = [str(exe), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-c", str(ctx), "-np", str(slots), "--jinja", "--no-webui"]
    if mode.draft is not None:
        cmd += ["-md", str(mode.draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(mode.n_max),
                "-td", str(threads)]
    return cmd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A llama-server process for the duration of a `with` block: started, waited for (`/health`), stopped."""

    def __init__(self, cmd: list[str], port: int, log_path: Path, start_timeout_s: float = 600.0):
        self.cmd, self.port, self.log_path, self.timeout = cmd, port, log_path, start_timeout_s
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LlamaServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log_path, "wb")  # noqa: SIM115 - closed with the process
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            out.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode} while loading; the end of its "
                                   f"log ({self.log_path}):\n{_tail(self.log_path)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"llama-server not ready after {self.timeout:.0f} s; its log: {self.log_path}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def chat(self, prompt: str, new: int, timeout_s: float = 600.0) -> dict:
        """One greedy chat completion of at most `new` tokens, the prompt not cached; the parsed figures."""
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": new, "temperature": 0.0,
                "top_k": 1, "cache_prompt": False, "stream": False}
        req = urllib.request.Request(self.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t = time.perf_counter()
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            data = json.loads(r.read())
        return parse_completion(data, time.perf_counter() - t)


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_bytes()[-n:].decode("utf-8", "replace")
    except OSError:
        return ""


def parse_completion(data: dict, wall_s: float) -> dict:
    """The figures of one chat completion: end-to-end tokens/s (completion tokens over the request's wall time,
    prompt processing included, as ours are measured), decode tokens/s and prompt time from the server's own
    `timings`, and its draft counts (absent from `timings` when nothing was drafted)."""
    tm = data.get("timings")
    if not tm:
        raise ValueError(f"llama-server's response has no `timings`: {json.dumps(data)[:300]}")
    n = int(data.get("usage", {}).get("completion_tokens", tm.get("predicted_n", 0)))
    return {"tokens": n, "tokens_per_s": n / wall_s if wall_s > 0 else 0.0,
            "decode_tokens_per_s": float(tm["predicted_per_second"]), "prompt_ms": float(tm["prompt_ms"]),
            "prompt_tokens": int(tm.get("prompt_n", 0)), "draft_n": int(tm.get("draft_n", 0)),
            "decode_ms": float(tm.get("predicted_ms", 1e3 * n / max(float(tm["predicted_per_second"]), 1e-9))),
            "draft_n_accepted": int(tm.get("draft_n_accepted", 0)),
            "text": data["choices"][0]["message"].get("content") or ""}


@dataclass
class ModeRun:
    mode: Mode
    runs: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        rs = self.runs
        out = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
               "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in rs),
               "per_prompt_tokens_per_s": [r["tokens_per_s"] for r in rs],
               "per_prompt_decode_tokens_per_s": [r["decode_tokens_per_s"] for r in rs],
               "completion_tokens": [r["tokens"] for r in rs]}
        if self.mode.draft is not None:
            drafted = sum(r["draft_n"] for r in rs)
            out.update(spec_draft_n_max=self.mode.n_max, draft_n=drafted,
                       draft_n_accepted=sum(r["draft_n_accepted"] for r in rs),
                       acceptance=sum(r["draft_n_accepted"] for r in rs) / drafted if drafted else None)
        return out


def run_mode(exe: Path, gguf: Path, mode: Mode, prompts: list[str], new: int, threads: int, log_dir: Path,
             log=print, warm: str | None = None, first: int = 0, total: int = 0) -> ModeRun:
    """Start a server in `mode`, warm it with one short request, run every prompt, stop it. `first` and `total`
    number the prompts in the log when these are prompts first + 1.. of total."""
    port = free_port()
    cmd = server_command(exe, gguf, port, threads, mode=mode)
    out = ModeRun(mode)
    part = f"-from-prompt-{first + 1}" if first else ""
    with LlamaServer(cmd, port, log_dir / f"llama-server-{mode.name.replace(' ', '-')}{part}.log") as srv:
        srv.chat(warm or prompts[0], 8)
        for i, p in enumerate(prompts):
            out.runs.append(srv.chat(p, new))
            r = out.runs[-1]
            log(f"  llama-server {mode.name}, prompt {first + i + 1}/{total or len(prompts)}: "
                f"{r['tokens_per_s']:.1f} tokens/s "
                f"(decode {r['decode_tokens_per_s']:.1f})"
                + (f", accepted {r['draft_n_accepted']}/{r['draft_n']}" if r["draft_n"] else ""))
    return out


class PlainPeer:
    """llama-server decoding plainly, started once and asked prompt by prompt between our own requests (validate's
    exactness pass, bench's interleaved prompts), so that its figures and ours come from the same minutes: this
    machine's memory bandwidth drifts by tens of percent within a minute, and run minutes apart the two had read
    1.05-1.18x of each other for the same plain decoding of the same weights in three make alls. Inactive (every
    `ask` returns None) where there is no GGUF target or no built server; a failure (start or request) is kept in
    `failed` and ends its requests, and `llama_server_peer` then runs plain decoding on its own as before. Idle
    between requests, the server took no CPU (0.000 s of CPU time in 5 idle seconds after a request, Zen 4)."""

    def __init__(self, spec, new: int, log=print, warm: str | None = None):
        self.spec, self.new, self.log, self.warm = spec, new, log, warm
        self.run = ModeRun(Mode())
        self.server: LlamaServer | None = None
        self.failed: str | None = None

    def __enter__(self) -> PlainPeer:
        gguf, exe = gguf_of(self.spec), binary()
        if gguf is None or exe is None:
            return self
        port = free_port()
        log_path = self.spec.report_dir / "llama-server" / "llama-server-plain-interleaved.log"
        try:
            self.server = LlamaServer(server_command(exe, gguf, port, server_threads(self.spec)), port,
                                      log_path).__enter__()
            if self.warm:
                self.server.chat(self.warm, 8)
        except (OSError, RuntimeError, ValueError, TimeoutError, subprocess.SubprocessError) as e:
            self._fail(e)
        return self

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.stop()

    @property
    def active(self) -> bool:
        return self.server is not None and self.failed is None

    def _fail(self, e: BaseException) -> None:
        self.failed = f"{type(e).__name__}: {str(e)[:500]}"
        self.log(f"  llama-server (interleaved) failed: {self.failed}; it runs after our prompts instead")
        if self.server is not None:
            self.server.stop()

    def ask(self, prompt: str) -> dict | None:
        """One greedy completion of the prompt (raw text: the server applies the GGUF's chat template); its figures,
        or None when inactive or failed."""
        if not self.active:
            return None
        try:
            r = self.server.chat(prompt, self.new)
        except (OSError, RuntimeError, ValueError, TimeoutError, urllib.error.URLError) as e:
            self._fail(e)
            return None
        self.run.runs.append(r)
        return r


def gguf_of(spec, part: str = "target") -> Path | None:
    """The GGUF file of the spec's target (or draft), when it comes from one."""
    from pipeline import sources  # lazy: loads torch (~1.5 s); the CLI imports peers at start

    source = getattr(spec, part).source
    if part == "draft" and source in ("none", "train"):
        return None
    try:
        src = sources.resolve(source, Path(spec.root), key=f"{part}.source")
    except sources.SourceError:
        return None
    return src.path if src.kind == "gguf" else None


def probe_prompts(n: int) -> int:
    """How many of n prompts pick llama-server's n-max: a quarter, at least 2. n-max 3 and 6 each on all 8 of the
    pair's prompts took 5.3 of a make all's 34 minutes; the faster on the first 2 was the faster on all 8."""
    return min(n, max(2, n // 4))


def best_draft_mode(run, prompts: list[str], n_maxes: tuple[int, ...], plain: list[float] | None = None) -> dict:
    """llama-server with the draft: every n-max on the first `probe_prompts` prompts, then the fastest of them
    (median tokens/s there) on the rest, so the reported mode ran every prompt plain decoding ran. `run(n, prompts,
    first)` starts a server at n-max n for `prompts`, the ones from index `first` on, and returns its ModeRun.

    Unless it cannot be the better of the two: when `plain` (plain decoding's tokens/s per prompt) shows the fastest
    n-max under PROBE_LOSES x plain's median on the same probe prompts, the rest is not run and `stopped` says why
    (on the AVX2 Zen 3 the draft ran at 0.65-0.70x plain; issue 28's Sapphire Rapids figures put it at 0.76-0.97x,
    which would run every prompt)."""
    probe = probe_prompts(len(prompts))
    tried = {n: run(n, prompts[:probe], 0) for n in n_maxes}
    k = max(tried, key=lambda n: tried[n].summary()["tokens_per_s"])
    out: dict = {}
    best = tried[k].summary()["tokens_per_s"]
    plain_probe = statistics.median(plain[:probe]) if plain else None
    if probe < len(prompts) and plain_probe and best < PROBE_LOSES * plain_probe:
        out["stopped"] = (f"after {probe} of {len(prompts)} prompts: the fastest n-max ({k}) ran at {best:.1f} "
                          f"tokens/s against plain's {plain_probe:.1f} on the same prompts (under {PROBE_LOSES}x), "
                          "so it could not be the better mode")
    elif probe < len(prompts):
        tried[k].runs.extend(run(k, prompts[probe:], probe).runs)
    return {**tried[k].summary(), **out, "prompts": len(tried[k].runs),
            "tried": {str(n): {"tokens_per_s": t.summary()["tokens_per_s"], "acceptance": t.summary()["acceptance"],
                               "prompts": len(t.runs)} for n, t in tried.items()}}


def llama_server_peer(spec, prompts: list[str], new: int, log=print, warm: str | None = None,
                      n_maxes: tuple[int, ...] = DRAFT_N_MAX, plain: PlainPeer | None = None) -> dict:
    """`peers.llama_cpp_server`: plain, and with the draft's GGUF at each n-max (the best one reported), on the
    target's GGUF; {} when the target is not a GGUF, a note when the binary is not built. `plain`: a PlainPeer that
    already ran every one of `prompts` between ours (its figures are used and marked `interleaved`); otherwise plain
    decoding runs here, after ours."""
    gguf = gguf_of(spec)
    if gguf is None:
        return {}
    exe = binary()
    if exe is None:
        return {"llama_cpp_server": {"tokens_per_s": None, "note": NOT_BUILT}}
    threads = server_threads(spec)
    log_dir = spec.report_dir / "llama-server"
    entry: dict = {"version": f"llama.cpp vendored in llama-cpp-python {LLAMA_CPP_VERSION}", "binary": str(exe),
                   "gguf": gguf.name, "threads": threads, "prompts": len(prompts), "new_tokens": new,
                   "api": "/v1/chat/completions (the GGUF's chat template), cache_prompt false, temperature 0",
                   "amx": "built without AMX (see pipeline/peers.py)"}
    if plain is not None and plain.failed is None and len(plain.run.runs) == len(prompts):
        entry["plain"] = {**plain.run.summary(), "interleaved": True}
    else:
        entry["plain"] = {**run_mode(exe, gguf, Mode(), prompts, new, threads, log_dir, log, warm).summary(),
                          "interleaved": False}
        if plain is not None and plain.failed:
            entry["plain"]["interleaving_failed"] = plain.failed
    draft = gguf_of(spec, "draft")
    if draft is not None:
        entry["draft_gguf"] = draft.name
        entry["draft"] = best_draft_mode(
            lambda n, ps, first: run_mode(exe, gguf, Mode(draft, n), ps, new, threads, log_dir, log, warm, first,
                                          len(prompts)), prompts, n_maxes, entry["plain"]["per_prompt_tokens_per_s"])
    best = best_mode(entry)
    entry["best"] = best[0]
    entry["tokens_per_s"] = best[1]["tokens_per_s"]  # the best of plain and speculative, end to end
    entry["decode_tokens_per_s"] = best[1]["decode_tokens_per_s"]
    log(f"  llama-server: plain {entry['plain']['tokens_per_s']:.1f} tokens/s"
        + (f", draft {entry['draft']['tokens_per_s']:.1f} (n-max {entry['draft']['spec_draft_n_max']}, acceptance "
           f"{entry['draft']['acceptance'] or 0:.2f})" if "draft" in entry else "")
        + (f"; draft stopped {entry['draft']['stopped']}" if "stopped" in entry.get("draft", {}) else ""))
    return {"llama_cpp_server": entry}


def safe_llama_server_peer(spec, prompts: list[str], new: int, log=print, warm: str | None = None,
                           plain: PlainPeer | None = None) -> dict:
    """`llama_server_peer` for validate and bench: a peer that fails (a crash, a timeout) becomes a note in the
    report naming what happened, and the run goes on."""
    try:
        return llama_server_peer(spec, prompts, new, log, warm, plain=plain)
    except (OSError, RuntimeError, ValueError, TimeoutError, subprocess.SubprocessError) as e:
        log(f"  llama-server failed: {type(e).__name__}: {str(e)[:500]}")
        return {"llama_cpp_server": {"tokens_per_s": None, "note": f"llama-server failed: {type(e).__name__}: "
                                     f"{str(e)[:500]}"}}


# ---- the CLI ----------------------------------------------------------------------------------------------------

def cmd_peers(args) -> int:
    from pipeline import spec as specmod  # lazy: as the verb's other imports

    spec = specmod.load(args.spec)
    if spec.target.quantization != "gguf" and gguf_of(spec) is None:
        print(f"peers: {spec.name}'s target ({spec.target.source}) is not a GGUF, so llama-server has nothing of it to "
              "run: not building llama.cpp (a spec whose target is a GGUF builds it)")
        return 0
    build(jobs=args.jobs)
    return 0


def register(verb) -> None:
    p = verb("peers", cmd_peers, "build llama.cpp's llama-server and llama-bench for this CPU into the cache")
    p.add_argument("--jobs", type=int, default=0, help="parallel compile jobs (0: every core)")


def best_mode(entry: dict) -> tuple[str, dict]:
    """The peer's best mode in a `llama_cpp_server` entry: ("plain", its summary) or ("draft n-max K", the draft's),
    whichever ran more end-to-end tokens/s (plain on a tie: the simpler one)."""
    best = ("plain", entry["plain"])
    d = entry.get("draft")
    if d and d.get("tokens_per_s") is not None and d["tokens_per_s"] > entry["plain"]["tokens_per_s"]:
        best = (f"draft n-max {d['spec_draft_n_max']}", d)
    return best


def ratio(ours_tokens_per_s: float | None, peer: dict | None) -> float | None:
    """Ours over the peer's best tokens/s (the ratio published in validate.md and the README); None where either is
    missing (the peer not built, failed, or a note)."""
    tps = (peer or {}).get("tokens_per_s")
    if not ours_tokens_per_s or not tps:
        return None
    return ours_tokens_per_s / tps

"""Start, health-check and stop the real tritonserver (from the nvidia-pytriton wheel) on a model repository.

The server runs detached in its own process group, bound to the spec's host (127.0.0.1 unless the
spec says otherwise) on its three ports. Its pid and log live in reports/<name>/ so `stop` finds
it from the spec alone. A busy port, a missing repository or a model that fails to load is an
error that says what to do, with the tail of the server log.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

from pipeline import door
from pipeline.common import apply_omp_env
from pipeline.spec import Spec
from pipeline.triton.repo import ENSEMBLE


class ServerError(RuntimeError):
    """The server could not be started, reached or stopped; the message says why and what to do."""


def pytriton_dir() -> Path:
    import pytriton  # lazy: pytriton (~0.7 s) only where the binary is located

    d = Path(pytriton.__file__).resolve().parent / "tritonserver"
    if not (d / "bin" / "tritonserver").is_file():
        raise ServerError(f"no tritonserver binary under {d}; reinstall nvidia-pytriton (`make setup`)")
    return d


def backend_dir(cache: Path) -> Path:
    """A backend directory whose python backend has the stub for this interpreter's Python version."""
    src = pytriton_dir()
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = src / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"no python-backend stub for Python {ver} in {stub.parent}; use Python 3.8-3.12")
    dest = cache / "python"
    dest.mkdir(parents=True, exist_ok=True)
    for f in [*sorted((src / "backends" / "python").glob("*.*")), stub]:
        if not f.is_file():
            continue
        out = dest / f.name
        if not out.is_file() or out.stat().st_size != f.stat().st_size:
            tmp = dest / f".{f.name}.tmp"
            shutil.copy2(f, tmp)
            tmp.rename(out)
    return cache


def server_env() -> dict[str, str]:
    """The stub loads libpython by name: point it at this interpreter's, and at this venv's packages."""
    env = dict(os.environ)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    wheel_libs = str(pytriton_dir().parent.parent / "nvidia_pytriton.libs")  # the stub's bundled libcudart
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, wheel_libs, env.get("LD_LIBRARY_PATH", "")) if p)
    # The stub starts an isolated interpreter that ignores PYTHONPATH but finds its prefix through the
    # first `python3` on PATH: this venv's, so its site-packages (numpy 1.26, torch) come first.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    apply_omp_env(env)  # the stubs' OpenMP waits: spin briefly, then yield the core (pipeline/common.py)
    return env


def pid_file(spec: Spec) -> Path:
    return spec.report_dir / "triton.pid"


def log_file(spec: Spec) -> Path:
    return spec.report_dir / "triton.log"


def ports(spec: Spec) -> dict[str, int]:
    t = spec.triton
    return {"triton.grpc_port": t.grpc_port, "triton.http_port": t.http_port, "triton.metrics_port": t.metrics_port}


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct free ports: each socket stays bound until all are chosen (free_port called n times can return one
    port twice, since the kernel may hand a just-closed port out again; a test's spec then fails its port-clash
    check, as the routing test's 18 ports once did)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def grpc_url(spec: Spec) -> str:
    return f"{door.local_host(spec.triton.host)}:{spec.triton.grpc_port}"


def http_url(spec: Spec) -> str:
    return f"http://{door.local_host(spec.triton.host)}:{spec.triton.http_port}"


def metrics_url(spec: Spec) -> str:
    return f"http://{door.local_host(spec.triton.host)}:{spec.triton.metrics_port}/metrics"


def log_tail(path: Path, lines: int = 40) -> str:
    if not path.is_file():
        return f"(no log at {path})"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


FATAL_LOG = ("error while loading shared libraries", "failed to load", "Traceback (most recent call last)",
             "failed to initialize", "UNAVAILABLE: Internal")


def fatal_line(path: Path) -> str | None:
    """The first log line that means a model will never become ready (so start() fails fast, not at timeout)."""
    if not path.is_file():
        return None
    for line in path.read_text(errors="replace").splitlines()[1:]:
        if any(f in line for f in FATAL_LOG):
            return line
    return None


def _alive(pid: int, repo: Path) -> bool:
    """True when `pid` is a live tritonserver serving `repo` (so a recycled pid is never signalled)."""
    try:
        p = psutil.Process(pid)
        cmd = p.cmdline()
        return (p.status() != psutil.STATUS_ZOMBIE and bool(cmd) and cmd[0].endswith("tritonserver")
                and f"--model-repository={repo.resolve()}" in cmd)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def running_pid(spec: Spec) -> int | None:
    """The pid of this spec's server when it is running, from reports/<name>/triton.pid."""
    f = pid_file(spec)
    if not f.is_file():
        return None
    try:
        pid = int(json.loads(f.read_text())["pid"])
    except (ValueError, KeyError, json.JSONDecodeError):
        return None
    return pid if _alive(pid, spec.repo_dir) else None


def _get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (OSError, ValueError):
        return 0, ""


def is_ready(spec: Spec, models: tuple[str, ...] | None = None) -> bool:
    """The server is live and every model it serves (spec triton.models, unless `models`) is ready."""
    if models is None:
        models = tuple(spec.triton.models) if spec.backend == "torch" else (ENSEMBLE,)
    base = http_url(spec)
    if _get(f"{base}/v2/health/ready")[0] != 200:
        return False
    return all(_get(f"{base}/v2/models/{m}/ready")[0] == 200 for m in models)


@dataclass
class Server:
    spec: Spec
    pid: int
    proc: subprocess.Popen | None = None

    @property
    def grpc_url(self) -> str:
        return grpc_url(self.spec)

    @property
    def metrics_url(self) -> str:
        return metrics_url(self.spec)

    def stop(self, timeout: float = 30.0) -> bool:
        return stop(self.spec, timeout)


def command(spec: Spec, backends: Path) -> list[str]:
    t = spec.triton
    return [
        str(pytriton_dir() / "bin" / "tritonserver"),
        f"--model-repository={spec.repo_dir.resolve()}",
        f"--backend-directory={backends.resolve()}",
        f"--grpc-address={t.host}", f"--grpc-port={t.grpc_port}",
        f"--http-address={t.host}", f"--http-port={t.http_port}",
        f"--metrics-address={t.host}", f"--metrics-port={t.metrics_port}",
        "--allow-metrics=true", "--allow-gpu-metrics=false", "--allow-cpu-metrics=true",
        "--exit-on-error=true", "--strict-readiness=true", "--disable-auto-complete-config",
        "--exit-timeout-secs=10", "--log-verbose=0",
        *door.triton_flags(door.api_key()),  # with a key, gRPC and HTTP ask for it (pipeline/door.py)
    ]


def start(spec: Spec, timeout: float | None = None, log=print) -> Server:
    """Start tritonserver on triton_repo/<name>/ and wait until every model it serves is ready."""
    refused = door.exposure_error(spec)
    if refused:
        raise ServerError(refused)
    pid = running_pid(spec)
    if pid:
        raise ServerError(f"a server for {spec.name!r} is already running (pid {pid}, gRPC {grpc_url(spec)}); "
                          "stop it first with `make stop` (python -m pipeline stop SPEC)")
    for key, port in ports(spec).items():
        if not port_free(spec.triton.host, port):
            raise ServerError(f"{key}: port {port} on {spec.triton.host} is already in use; stop whatever holds it "
                              f"(another server: `make stop`, or `ss -ltnp | grep {port}`) or set {key} in the spec")
    if not any((spec.repo_dir / m / "config.pbtxt").is_file() for m in spec.triton.models):
        raise ServerError(f"{spec.repo_dir} has no model repository; write it first with `make repo` "
                          "(python -m pipeline repo SPEC)")
    spec.report_dir.mkdir(parents=True, exist_ok=True)
    backends = backend_dir(spec.repo_dir.parent / ".backends")
    logp = log_file(spec)
    if logp.is_file():  # keep the previous server's log (a server that died leaves its story there)
        logp.replace(logp.with_name(logp.name + ".prev"))
    cmd = command(spec, backends)
    with open(logp, "w") as lf:
        lf.write("# " + " ".join(door.redact(cmd, door.api_key())) + "\n")
        lf.flush()
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=server_env(), cwd=str(spec.report_dir), start_new_session=True)
    pid_file(spec).write_text(json.dumps({"pid": proc.pid, "grpc": grpc_url(spec), "started": time.time()}))
    server = Server(spec, proc.pid, proc)
    limit = spec.triton.startup_timeout_s if timeout is None else timeout
    log(f"started tritonserver (pid {proc.pid}), loading {spec.repo_dir} ...")
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            pid_file(spec).unlink(missing_ok=True)
            bad = fatal_line(logp)  # the tail may be all status table when several models failed
            raise ServerError(f"tritonserver exited with code {proc.returncode} while loading the models"
                              + (f": {bad.strip()}" if bad else "") + f". Last lines of {logp}:\n{log_tail(logp)}\n"
                              "Fix the error above (often: engines not built -> `make engine`; "
                              "repository stale -> `make repo`) and run `make serve` again")
        if is_ready(spec):
            break
        bad = fatal_line(logp)
        if bad:
            time.sleep(1.0)
            stop(spec, timeout=10)
            raise ServerError(f"a model failed to load: {bad.strip()}\nLast lines of {logp}:\n{log_tail(logp)}\n"
                              "Fix the error above (engines not built -> `make engine`; repository stale -> "
                              "`make repo`) and run `make serve` again")
        if time.monotonic() - t0 > limit:
            stop(spec)
            raise ServerError(f"tritonserver was not ready after {limit:.0f}s (triton.startup_timeout_s). "
                              f"Last lines of {logp}:\n{log_tail(logp)}\n"
                              "Raise triton.startup_timeout_s on a slow machine, or fix the error above")
        time.sleep(0.1)  # each look is a refused connection or a few local GETs; ready is seen within 0.1 s
    log(f"tritonserver ready in {time.monotonic() - t0:.1f}s: gRPC {grpc_url(spec)}, HTTP {http_url(spec)}, "
        f"metrics {metrics_url(spec)} (log {logp})")
    return server


def stop(spec: Spec, timeout: float = 30.0, log=lambda *a: None) -> bool:
    """Stop this spec's server (SIGTERM, then SIGKILL after `timeout`); True when one was running."""
    pid = running_pid(spec)
    if pid is None:
        pid_file(spec).unlink(missing_ok=True)
        return False
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    pid_file(spec).unlink(missing_ok=True)  # first: the keeper (pipeline/triton/keeper.py) starts no stopped server
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    except PermissionError:
        os.kill(pid, signal.SIGTERM)
    _, left = psutil.wait_procs(procs, timeout=timeout)
    for p in left:
        log(f"pid {p.pid} did not exit after {timeout:.0f}s; killing it")
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=5)
    pid_file(spec).unlink(missing_ok=True)
    return True


def server_rss_mb(pid: int) -> float:
    """Resident memory of the server and its children (the python-backend stubs), in MB."""
    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20

"""The keeper: starts again a served tritonserver that died, so one client cannot leave the deployment down.

tritonserver 2.51 (the newest nvidia-pytriton's) can die of a segmentation fault when a client drops its connection
in the moment its stream's final response is sent (docs/serving.md, "Known upstream issue"); one CI run's server
crashed and then hung in its crash handler, and every later request waited out its timeout. `serve` (detached) starts
this keeper next to the server: it polls the server's process, and when the process is gone, or its log says it took
a fatal signal and it still runs `HUNG_S` later (killed then), it starts the server again with `server.start` (the
dead server's log is kept as triton.log.prev), at most `MAX_RESTARTS` times in `WINDOW_S`. `stop` removes the pid
file before it signals the server, so the keeper never starts a server that was stopped on purpose, and then ends
the keeper. `serve --foreground` starts none: there the supervisor that runs it (Kubernetes, from the liveness probe
of the manifests) restarts the server.

Run as `python -m pipeline.triton.keeper SPEC [PID]`; its log is reports/<name>/keeper.log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from pipeline import spec as specmod
from pipeline.spec import Spec
from pipeline.triton import server
from pipeline.triton.repo import PACKAGE_ROOT

MAX_RESTARTS = 5  # in WINDOW_S; beyond that the server stays down (something other than a rare race kills it)
WINDOW_S = 600.0
HUNG_S = 15.0  # a server whose log says it took a fatal signal and that still runs this long after is killed
POLL_S = 0.5
FATAL_SIGNAL = ("Signal (11) received.", "Signal (6) received.")  # tritonserver's ErrorSignalHandler (SIGSEGV, ABRT)


def pid_file(spec: Spec) -> Path:
    return spec.report_dir / "keeper.pid"


def log_file(spec: Spec) -> Path:
    return spec.report_dir / "keeper.log"


def running_pid(spec: Spec) -> int | None:
    """The keeper's pid while it runs for this spec."""
    try:
        pid = int(json.loads(pid_file(spec).read_text())["pid"])
        p = psutil.Process(pid)
        alive = p.status() != psutil.STATUS_ZOMBIE and __name__ in p.cmdline()
    except (OSError, ValueError, KeyError, json.JSONDecodeError, psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return pid if alive else None


def fatal_signal_seen(log: Path) -> bool:
    """Has the server whose log is `log` reported a fatal signal? (`server.start` begins a new log each time.)"""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return False
    return any(s in text for s in FATAL_SIGNAL)


def _kill(pid: int) -> None:
    """SIGKILL a server hung after its crash, and the stubs of its process group."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def keep(spec: Spec, log: Callable[[str], None] = print, pid: int | None = None, max_restarts: int = MAX_RESTARTS,
         window_s: float = WINDOW_S, hung_s: float = HUNG_S, poll_s: float = POLL_S) -> int:
    """Watch this spec's server (`pid`, as `serve` started it; default the running one) until it is stopped (its pid
    file removed): 0; or until it died `max_restarts` times in `window_s`: 1, the server left down and the reason
    logged. Given `pid`, a server that died before the keeper got going (its import takes a moment) is started again."""
    pid = pid or server.running_pid(spec)
    if pid is None:
        log(f"no {spec.name} server is running; nothing to keep")
        return 1
    proc: subprocess.Popen | None = None  # the server this keeper started (reaped here), None for serve's own
    restarts: list[float] = []
    signalled_at: float | None = None
    log(f"keeping tritonserver pid {pid} (log {server.log_file(spec)})")
    def stopped() -> bool:
        if server.pid_file(spec).is_file():
            return False
        log("the server was stopped; the keeper ends")
        return True

    while True:
        time.sleep(poll_s)
        if proc is not None:
            proc.poll()  # reap a dead child, so it reads as gone
        if stopped():
            return 0
        alive = server.running_pid(spec) == pid
        if alive and fatal_signal_seen(server.log_file(spec)):
            signalled_at = signalled_at or time.monotonic()
            if time.monotonic() - signalled_at < hung_s:
                continue  # a crash handler prints its trace, then the process dies
            log(f"tritonserver pid {pid} took a fatal signal and still runs {hung_s:.0f} s later (hung in its crash "
                "handler); killing it")
            _kill(pid)
            alive = False
        if alive:
            continue
        time.sleep(poll_s)  # `stop` removes the pid file before it signals: a stop is seen by now
        if stopped():
            return 0
        how = "after a fatal signal" if fatal_signal_seen(server.log_file(spec)) else "unexpectedly"
        while True:  # a start that fails (a server that dies or hangs while it loads) counts as one more death
            now = time.monotonic()
            restarts = [t for t in restarts if now - t < window_s] + [now]
            if len(restarts) > max_restarts:
                server.pid_file(spec).unlink(missing_ok=True)
                log(f"tritonserver pid {pid} died {how}: {len(restarts)} deaths in {window_s:.0f} s, more than the "
                    f"keeper restarts ({max_restarts}); leaving it down. Its log: {server.log_file(spec)}; start it "
                    "again with `make serve`")
                return 1
            log(f"tritonserver pid {pid} died {how} (its log is kept as {server.log_file(spec)}.prev); starting it "
                f"again ({len(restarts)} of {max_restarts} in {window_s:.0f} s)")
            server.pid_file(spec).unlink(missing_ok=True)
            _wait_ports(spec)
            try:
                srv = server.start(spec, log=log)
                break
            except server.ServerError as e:
                log(f"could not start tritonserver again: {e}")
                how = "while it started"
        pid, proc, signalled_at = srv.pid, srv.proc, None


def _wait_ports(spec: Spec, timeout: float = 30.0) -> None:
    """Give the dead server's stubs and sockets a moment to let go of its ports."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if all(server.port_free(spec.triton.host, p) for p in server.ports(spec).values()):
            return
        time.sleep(0.25)


def start(spec_path: Path, spec: Spec, pid: int) -> int:
    """Start the keeper for this spec's server `pid`, detached; the keeper's pid."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
    with open(log_file(spec), "a") as lf:
        proc = subprocess.Popen([sys.executable, "-m", __name__, str(Path(spec_path).resolve()), str(pid)], stdout=lf,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=str(spec.report_dir),
                                start_new_session=True)
    pid_file(spec).write_text(json.dumps({"pid": proc.pid, "started": time.time()}))
    return proc.pid


def stop(spec: Spec, timeout: float = 5.0) -> bool:
    """End this spec's keeper; True when one was running."""
    pid = running_pid(spec)
    pid_file(spec).unlink(missing_ok=True)
    if pid is None:
        return False
    try:
        p = psutil.Process(pid)
        p.terminate()
        p.wait(timeout)
    except psutil.TimeoutExpired:
        p.kill()
    except psutil.NoSuchProcess:
        pass
    return True


def main(argv: list[str]) -> int:
    spec = specmod.load(argv[0])
    pid = int(argv[1]) if len(argv) > 1 else None

    def log(msg: str) -> None:
        print(time.strftime("%Y-%m-%d %H:%M:%S ") + msg, flush=True)

    try:
        return keep(spec, log, pid)
    finally:
        pid_file(spec).unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

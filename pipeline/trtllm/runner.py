"""Running the plan, writing the repository and launching: the commands `python -m pipeline` calls."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from pipeline.spec import Spec
from pipeline.trtllm import llmapi
from pipeline.trtllm.engine_repo import write_repo
from pipeline.trtllm.era import ERA, LLMAPI_ERA, PlanError
from pipeline.trtllm.llmapi_repo import LLMAPI_COPY, write_llmapi_repo
from pipeline.trtllm.memory import memory_plan
from pipeline.trtllm.planning import (
    Step,
    format_plan,
    gpu_placement,
    participant_ids,
    plan,
    planned_engine_configs,
    roles,
    source,
)
from pipeline.trtllm.preflight import built_engine_problems, preflight

# ------------------------------------------------------------------------------------------------
# Running the plan


def tensorrt_llm_available() -> str | None:
    """None when the engine flow can run here, else the reason it cannot."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        return (f"`import tensorrt_llm` fails in {sys.executable}; run this inside {ERA.image} "
                f"(TensorRT-LLM {ERA.tensorrt_llm}) or an environment with that wheel")
    if shutil.which(ERA.build_cli) is None:
        return f"`{ERA.build_cli}` is not on PATH; install TensorRT-LLM {ERA.tensorrt_llm}"
    return None


def _stamp(step: Step) -> str:
    return hashlib.sha256(json.dumps(step.argv).encode()).hexdigest()


def run_plan(spec: Spec, steps: list[Step], force: bool = False) -> int:
    """Run each step with its output in a log file; skip steps whose output came from the same argv."""
    for i, s in enumerate(steps, 1):
        stamp = s.output / ".pipeline-step.json"
        if not force and stamp.is_file() and json.loads(stamp.read_text()).get("argv_sha256") == _stamp(s):
            print(f"[{i}/{len(steps)}] {s.name}: up to date ({s.output})")
            continue
        s.log.parent.mkdir(parents=True, exist_ok=True)
        print(f"[{i}/{len(steps)}] {s.name}: {s.why}\n    {s.shell()}\n    log: {s.log}", flush=True)
        t0 = time.time()
        with open(s.log, "w") as log:
            proc = subprocess.Popen(s.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env={**os.environ, **s.env})
            assert proc.stdout is not None
            last = t0
            for line in proc.stdout:
                log.write(line)
                if time.time() - last > 30:
                    print(f"    ... {s.name} running {time.time() - t0:.0f}s: {line.strip()[:100]}", flush=True)
                    last = time.time()
            rc = proc.wait()
        if rc != 0:
            tail = s.log.read_text().splitlines()[-20:]
            print(f"[{i}/{len(steps)}] {s.name} FAILED (exit {rc}) after {time.time() - t0:.0f}s; last lines of "
                  f"{s.log}:\n" + "\n".join("    " + t for t in tail), file=sys.stderr)
            return rc
        s.output.mkdir(parents=True, exist_ok=True)
        stamp.write_text(json.dumps({"argv_sha256": _stamp(s), "argv": s.argv}))
        print(f"[{i}/{len(steps)}] {s.name}: done in {time.time() - t0:.0f}s", flush=True)
    return 0


def llmapi_engine_command(spec: Spec, dry_run: bool) -> int:
    """`python -m pipeline engine SPEC` in the llmapi era: the plan (no build), its checks, trtllm-serve's YAML."""
    try:
        print(llmapi.format_plan(spec))
        mem = memory_plan(spec, planned_engine_configs(spec))
        problems = llmapi.preflight(spec)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n" + mem.summary())
    if problems:
        print("\npreflight found problems; fix them before serving:", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 2
    if dry_run:
        print("\n# dry run: nothing was written. Next: make repo SPEC=... (Triton) or run the trtllm-serve line above")
        return 0
    missing = [f"{r}.source {source(spec, r)}" for r in (["target"] + (["draft"] if llmapi.method(spec) ==
               "draft_target" else [])) if not Path(source(spec, r)).is_dir()]
    if missing:
        print(f"error: checkpoint directories not found: {', '.join(missing)} (engines/<name>/*_hf directories are "
              "written by the torch build of the same pair: `make engine SPEC=build/qwen_coder.yaml`)", file=sys.stderr)
        return 2
    path = llmapi.serve_config_path(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(llmapi.dump_yaml(llmapi.serve_config(spec)))
    print(f"\nwrote {path} (trtllm-serve --extra_llm_api_options); nothing to build in the llmapi era")
    return 0


def engine_command(spec: Spec, dry_run: bool, force: bool = False) -> int:
    """`python -m pipeline engine SPEC [--dry-run]` for backend tensorrt_llm."""
    if spec.tensorrt_llm.era == "llmapi":
        return llmapi_engine_command(spec, dry_run)
    try:
        steps = plan(spec)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_plan(spec, steps))
    mem = memory_plan(spec, planned_engine_configs(spec))
    print("\n" + mem.summary())
    problems = preflight(spec, planned_engine_configs(spec))
    if problems:
        print("\npreflight found problems; fix them before building:", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 2
    if dry_run:
        print(f"\n# dry run: nothing was executed. Next: make repo SPEC=... ; make serve SPEC=... "
              f"(inside {ERA.image})")
        return 0
    why = tensorrt_llm_available()
    if why:
        print(f"\nerror: cannot build here: {why}. Use --dry-run to print the plan.", file=sys.stderr)
        return 3
    wanted = ["target"] + (["draft"] if spec.has_draft else []) + (["medusa"] if spec.has_medusa else [])
    missing = [f"{r}.source {source(spec, r)}" for r in wanted if not Path(source(spec, r)).is_dir()]
    if missing:
        hint = (" (engines/<name>/*_hf directories are written by the torch build of the same pair: "
                "`make engine SPEC=build/qwen_coder.yaml`)" if any("_hf" in m for m in missing) else "")
        print(f"error: checkpoint directories not found: {', '.join(missing)}{hint}", file=sys.stderr)
        return 2
    rc = run_plan(spec, steps, force=force)
    if rc == 0:
        problems = preflight(spec, None)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 2 if problems else 0
    return rc


# ------------------------------------------------------------------------------------------------
# Repository and launch


def repo_command(spec: Spec) -> int:
    """`python -m pipeline repo SPEC` for backend tensorrt_llm: write triton_repo/<name>/."""
    if spec.tensorrt_llm.era == "llmapi":
        try:
            out, copies = write_llmapi_repo(spec)
        except PlanError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {out} (llmapi era: tensorrt_llm = Triton's llmapi model, model.yaml from the spec)")
        for src, dst, done in copies:
            print(f"  copied {src} -> {dst}" if done else f"  to do inside {LLMAPI_COPY}: cp {src} {dst}")
        if not all(done for *_, done in copies):
            print(f"  (the same commands are in {out.parent / (out.name + '.copy.sh')})")
        return 0
    try:
        out, copies = write_repo(spec)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    for src, dst, done in copies:
        print(f"  copied {src} -> {dst}/1" if done else f"  to do inside {ERA.image}: cp -r {src} {dst}/")
    if not all(done for *_, done in copies):
        print(f"  (the same commands are in {out.parent / (out.name + '.copy.sh')})")
    return 0


def launch_plan(spec: Spec) -> tuple[list[str], dict[str, str], str]:
    """(argv, env, equivalent launch_triton_server.py line) for the spec's repository.

    One model: leader mode, one tritonserver rank per GPU under mpirun (world size tp*pp); ranks
    above 0 only load tensorrt_llm. Draft-target: two TensorRT-LLM models, which the era's launcher
    serves in orchestrator mode (--multi-model): one tritonserver process (its launcher asserts
    --world_size=1) that spawns each model's tp*pp workers on that model's gpu_device_ids. With
    tensorrt_llm.fast_logits, orchestrator mode without spawned processes: rank 0 orchestrates,
    the draft's ranks and the target's ranks follow (participant_ids in their configs).
    Every rank binds the spec's triton.host (launch_triton_server.py has no address flags and
    listens on every interface: the argv here is what runs).
    """
    tr = spec.triton
    repo = str(spec.repo_dir.resolve())
    world = spec.parallel.tp * spec.parallel.pp
    common = [f"--model-repository={repo}", f"--grpc-address={tr.host}", f"--grpc-port={tr.grpc_port}",
              f"--http-address={tr.host}", f"--http-port={tr.http_port}", f"--metrics-address={tr.host}",
              f"--metrics-port={tr.metrics_port}", "--disable-auto-complete-config"]
    ports = f"--grpc_port={tr.grpc_port} --http_port={tr.http_port} --metrics_port={tr.metrics_port}"
    env: dict[str, str] = {}
    argv = ["mpirun", "--allow-run-as-root"]
    if spec.has_draft and spec.tensorrt_llm.fast_logits:
        env = {"TRTLLM_ORCHESTRATOR": "1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "0"}
        world = 1 + len(participant_ids(spec)["draft"]) + len(participant_ids(spec)["target"])
        for rank in range(world):
            if rank:
                argv.append(":")
            rank_args = [] if rank == 0 else ["--model-control-mode=explicit", "--load-model=tensorrt_llm",
                                              "--load-model=tensorrt_llm_draft"]
            argv += ["-n", "1", ERA.tritonserver, *common, *rank_args,
                     f"--backend-config=python,shm-region-prefix-name=prefix{rank}_"]
        launcher = (f"python3 {ERA.launch_script} --model_repo={repo} --multi-model --disable-spawn-processes "
                    f"--world_size={world} --tensorrt_llm_model_name=tensorrt_llm,tensorrt_llm_draft {ports} --log")
    elif spec.has_draft:
        env = {"TRTLLM_ORCHESTRATOR": "1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "1"}
        extra = []
        if ERA.orchestrator_extra_flags:
            gpus = sorted({g for r in ("target", "draft") for g in gpu_placement(spec)[r]})
            extra = ["--pinned-memory-pool-byte-size=0", "--enable-peer-access=false"]
            extra += [f"--cuda-memory-pool-byte-size={g}:0" for g in gpus]
        argv += ["-n", "1", ERA.tritonserver, *common, "--backend-config=python,shm-region-prefix-name=prefix0_",
                 *extra]
        launcher = f"python3 {ERA.launch_script} --model_repo={repo} --multi-model --world_size=1 {ports} --log"
    else:
        for rank in range(world):
            if rank:
                argv.append(":")
            rank_args = [] if rank == 0 else ["--model-control-mode=explicit", "--load-model=tensorrt_llm"]
            argv += ["-n", "1", ERA.tritonserver, *common, *rank_args,
                     f"--backend-config=python,shm-region-prefix-name=prefix{rank}_"]
        launcher = f"python3 {ERA.launch_script} --model_repo={repo} --world_size={world} {ports} --log"
    return argv, env, launcher


def serve_command(spec: Spec, dry_run: bool) -> int:
    """`python -m pipeline serve SPEC [--dry-run]` for backend tensorrt_llm."""
    if spec.tensorrt_llm.era == "llmapi":
        return llmapi_serve_command(spec, dry_run)
    try:
        argv, env, launcher = launch_plan(spec)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    envs = " ".join(f"{k}={v}" for k, v in env.items())
    print(f"# {ERA.image}: serve {spec.repo_dir}" + (" (orchestrator mode, two TensorRT-LLM models)"
                                                     if spec.has_draft else ""))
    print(f"# equivalent: {launcher}")
    lines, cur = [], []
    for a in argv:
        if a in (":", "-n") or a.startswith("--model-repository") or (a.startswith("--") and cur and cur[0] != "-n"):
            if cur:
                lines.append(" ".join(cur))
            cur = []
        cur.append(shlex.quote(a))
    lines.append(" ".join(cur))
    print((envs + " " if envs else "") + " \\\n    ".join(lines))
    if dry_run:
        return 0
    if not (spec.repo_dir / "tensorrt_llm" / "config.pbtxt").is_file():
        print(f"error: {spec.repo_dir} has no repository; run `make repo SPEC=...` first", file=sys.stderr)
        return 2
    unbuilt = [p for r in roles(spec) for p in built_engine_problems(spec, r)]
    if unbuilt:
        for p in unbuilt:
            print(f"error: {p}", file=sys.stderr)
        return 2
    for tool in ("mpirun", ERA.tritonserver):
        if shutil.which(tool) is None:
            print(f"error: {tool} not found; serve inside {ERA.image} (or use --dry-run)", file=sys.stderr)
            return 3
    problems = preflight(spec, None)
    if problems:
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 2
    return subprocess.call(argv, env={**os.environ, **env})



def llmapi_serve_command(spec: Spec, dry_run: bool) -> int:
    """The llmapi era's launch: tritonserver through the container's launcher, and the trtllm-serve alternative."""
    repo = spec.repo_dir.resolve()
    tr = spec.triton
    world = spec.parallel.tp * spec.parallel.pp
    launcher = [sys.executable if not dry_run else "python3", LLMAPI_ERA.launch_script, f"--model_repo={repo}",
                f"--world_size={world}", f"--grpc_port={tr.grpc_port}", f"--http_port={tr.http_port}",
                f"--metrics_port={tr.metrics_port}"]
    print(f"# {LLMAPI_ERA.image}: serve {repo} (Triton, llmapi tensorrt_llm model + our ensemble)")
    print(" ".join(shlex.quote(a) for a in launcher))
    print(f"# or the OpenAI-compatible server (base URL {llmapi.openai_base_url(spec)}):")
    print(" ".join(shlex.quote(a) for a in llmapi.serve_argv(spec)))
    if dry_run:
        return 0
    if not (spec.repo_dir / "tensorrt_llm" / "1" / "model.yaml").is_file():
        print(f"error: {spec.repo_dir} has no llmapi repository; run `make repo SPEC=...` first", file=sys.stderr)
        return 2
    if not Path(LLMAPI_ERA.launch_script).is_file():
        print(f"error: {LLMAPI_ERA.launch_script} not found; serve inside {LLMAPI_ERA.image} (or use --dry-run)",
              file=sys.stderr)
        return 3
    return subprocess.call(launcher)

"""`python -m pipeline deploy`: every spec under build/ renders with the real `kubectl kustomize` and validates
against the Kubernetes schemas (kubernetes-validate, strict, the pinned version) with no error and no warning; the
proxy's configuration passes the real `haproxy -c`; broken values are refused at `check` with the key named."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pipeline import spec as specmod
from pipeline.cli import main
from pipeline.deploy import manifests, validate_k8s
from tests.conftest import write_spec

ROOT = Path(__file__).resolve().parent.parent
BUILD_SPECS = sorted((ROOT / "build").glob("*.yaml"))


def _need(tool: str) -> str:
    exe = shutil.which(tool) or (Path(f"/usr/sbin/{tool}").is_file() and f"/usr/sbin/{tool}")
    if not exe:
        pytest.fail(f"{tool} is not installed: run scripts/deploy_tools.sh (make deploy-tools; docs/deploy.md)")
    return exe


def _rendered(spec: specmod.Spec, out: Path) -> dict[str, list[dict]]:
    _need("kubectl")
    manifests.write(spec, out)
    return {o.name: validate_k8s.render(o) for o in sorted((out / "overlays").iterdir())}


def _one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name}: {[o['metadata']['name'] for o in found]}"
    return found[0]


@pytest.mark.parametrize("path", BUILD_SPECS, ids=[p.stem for p in BUILD_SPECS])
def test_every_build_spec_renders_and_validates_with_no_error_and_no_warning(path, tmp_path):
    s = specmod.load(path)
    rendered = _rendered(s, tmp_path / s.name)
    assert list(rendered) == (["gpu"] if s.backend == "tensorrt_llm" else ["cpu"])
    for objs in rendered.values():
        errors, warnings = validate_k8s.validate(objs)
        assert (errors, warnings) == ([], []), (errors, warnings)
        n = manifests.object_name(s.name)
        ports = {"http": s.triton.http_port, "grpc": s.triton.grpc_port, "metrics": s.triton.metrics_port,
                 "openai": s.openai.port}
        for port_name, port in ports.items():  # a Service for every port the spec opens
            svc = _one(objs, "Service", f"{n}-{port_name}")
            assert svc["spec"]["ports"][0]["port"] == port and svc["metadata"]["namespace"] == s.deploy.namespace
        serving = _one(objs, "Deployment", n)
        pod = serving["spec"]["template"]
        assert serving["spec"]["replicas"] == s.deploy.replicas
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(s.triton.metrics_port)
        containers = {c["name"]: c for c in pod["spec"]["containers"]}
        front = containers["serve" if s.backend == "torch" else "openai"]
        assert front["readinessProbe"]["httpGet"] == {"path": "/health", "port": "openai"}
        key = next(e for e in front["env"] if e["name"] == "PIPELINE_API_KEY")
        assert key["valueFrom"]["secretKeyRef"]["name"] == f"{n}-api-key"  # from a Secret, never the spec
        if s.backend == "tensorrt_llm":
            triton = containers["triton"]
            assert triton["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
            assert triton["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
            assert triton["resources"]["limits"]["nvidia.com/gpu"] == str(s.parallel.tp * s.parallel.pp)
        deployed = yaml.safe_load(_one(objs, "ConfigMap", f"{n}-spec")["data"]["spec.yaml"])
        assert deployed["triton"]["host"] == "0.0.0.0" and deployed["name"] == s.name
        assert specmod.parse(deployed).triton.http_port == s.triton.http_port  # the pods' spec passes check
        proxy_cfg = _one(objs, "ConfigMap", f"{n}-proxy")["data"]["haproxy.cfg"]
        assert f"{n}-replicas.{s.deploy.namespace}.svc.cluster.local:{s.openai.port}" in proxy_cfg
        assert "hash-type consistent" in proxy_cfg and "balance leastconn" in proxy_cfg


def test_a_plan_that_spans_nodes_becomes_a_leaderworkerset_of_whole_nodes(tmp_path):
    data = yaml.safe_load((ROOT / "build" / "llama70b_draft1b_tp4.yaml").read_text())
    data["deploy"] = {"gpus_per_node": 2, "replicas": 3}
    s = specmod.parse(data, ROOT)
    objs = _rendered(s, tmp_path / "lws")["gpu"]
    assert validate_k8s.validate(objs) == ([], [])
    lws = _one(objs, "LeaderWorkerSet")
    tmpl = lws["spec"]["leaderWorkerTemplate"]
    assert lws["spec"]["replicas"] == 3 and tmpl["size"] == 2  # tp 4 over nodes of 2 GPUs
    leader = {c["name"]: c for c in tmpl["leaderTemplate"]["spec"]["containers"]}
    assert leader["triton"]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert "mpirun" in leader["triton"]["command"][-1] and "-np 4" in leader["triton"]["command"][-1]
    assert tmpl["workerTemplate"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert not [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "llama70b-draft1b-tp4"]


def test_validation_finds_a_wrong_field_a_wrong_type_and_a_bad_leaderworkerset_field(tmp_path):
    """The validator can fail: strict schemas refuse an unknown field and a mistyped one."""
    s = specmod.load(ROOT / "build" / "smollm2.yaml")
    objs = _rendered(s, tmp_path / "x")["cpu"]
    bad = copy.deepcopy(objs)
    dep = _one(bad, "Deployment", "smollm2")
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/health"
    _one(bad, "Service", "smollm2-grpc")["spec"]["ports"][0]["port"] = "eight thousand"
    errors, _ = validate_k8s.validate(bad)
    assert len(errors) == 2 and any("paht" in e for e in errors) and any("smollm2-grpc" in e for e in errors)
    data = yaml.safe_load((ROOT / "build" / "llama70b_draft1b_tp4.yaml").read_text())
    data["deploy"] = {"gpus_per_node": 2}
    lws_objs = _rendered(specmod.parse(data, ROOT), tmp_path / "y")["gpu"]
    lws = _one(lws_objs, "LeaderWorkerSet")
    lws["spec"]["leaderWorkerTemplate"]["sise"] = 2
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["imagePullPolicy"] = 3
    errors, _ = validate_k8s.validate(lws_objs)
    assert any("sise" in e for e in errors) and any("imagePullPolicy" in e for e in errors), errors


@pytest.mark.parametrize("sections, key", [
    ({"deploy": {"proxy_port": 8003}}, "deploy.proxy_port"),  # the OpenAI endpoint's port
    ({"deploy": {"proxy_port": 8001}}, "deploy.proxy_port"),  # Triton's gRPC port
    ({"triton": {"http_port": 8001}}, "triton"),  # two of Triton's own ports
    ({"deploy": {"session_header": "X Session"}}, "deploy.session_header"),
    ({"deploy": {"namespace": "Spec_Pipeline"}}, "deploy.namespace"),
    ({"deploy": {"replicas": 0}}, "deploy.replicas"),
])
def test_broken_deploy_values_are_refused_at_check_with_the_key_named(tiny_root, capsys, sections, key):
    path = write_spec(tiny_root, name="broken", **sections)
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {key}: got"), err


def test_deploy_refuses_a_spec_without_the_openai_endpoint_that_check_accepts(tiny_root, capsys, tmp_path):
    path = write_spec(tiny_root, name="noapi", openai={"enabled": False})
    assert main(["check", str(path)]) == 0
    capsys.readouterr()
    assert main(["deploy", str(path), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("error: openai.enabled: got False"), "deploy needs the endpoint"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, key", [
    ({"tensorrt_llm": {"gpus": 2}}, "tensorrt_llm.gpus"),  # the plan's tp 4 needs 4 GPUs
    ({"deploy": {"gpus_per_node": 3}}, "deploy.gpus_per_node"),  # 4 ranks do not fill nodes of 3
])
def test_a_missing_gpu_count_is_refused_at_check_with_the_key_named(tmp_path, capsys, change, key):
    data = yaml.safe_load((ROOT / "build" / "llama70b_draft1b_tp4.yaml").read_text())
    for section, values in change.items():
        data[section] = {**data.get(section, {}), **values}
    (tmp_path / "build").mkdir()
    path = tmp_path / "build" / "gpu.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["check", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {key}: got")


def test_make_deploy_writes_the_tree_and_haproxy_accepts_every_config_it_writes(tiny_root, tmp_path):
    exe = _need("haproxy")
    path = write_spec(tiny_root, name="tree")
    assert main(["deploy", str(path)]) == 0
    out = tiny_root / "deploy" / "tree"
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "base/kustomization.yaml", "base/namespace.yaml", "base/proxy.yaml", "base/services.yaml", "base/spec.yaml",
        "base/storage.yaml", "haproxy.cfg", "overlays/cpu/build-job.yaml", "overlays/cpu/kustomization.yaml",
        "overlays/cpu/serving.yaml"]
    local = tmp_path / "local.cfg"
    rr = tmp_path / "rr.cfg"
    assert main(["deploy", str(path), "--out", str(local), "--replica", "127.0.0.1:9001",
                 "--replica", "127.0.0.1:9002"]) == 0
    assert main(["deploy", str(path), "--out", str(rr), "--replica", "127.0.0.1:9001", "--round-robin"]) == 0
    for cfg in (out / "haproxy.cfg", local, rr):
        r = subprocess.run([exe, "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "[WARNING]" not in r.stdout + r.stderr, (cfg, r.stdout + r.stderr)

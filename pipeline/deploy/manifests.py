"""Kubernetes manifests for a spec: a kustomize base and the overlay its backend runs on (docs/deploy.md).

deploy/<name>/
  base/            namespace, the spec as deployed (ConfigMap), the engines' volume, a Service per port the spec
                   opens, the replicas' headless Service, the session-affine HAProxy (ConfigMap, Deployment, Service)
  overlays/cpu/    torch specs: the build Job (fetch + engine into the volume) and the serving Deployment
                   (`serve --foreground`: Triton and the OpenAI endpoint in one container)
  overlays/gpu/    tensorrt_llm specs: the build Job and the serving Deployment on `nvidia.com/gpu` from the parallel
                   plan, or a LeaderWorkerSet (TensorRT-LLM's ranks under mpirun) where the plan spans nodes
  haproxy.cfg      the proxy's configuration, as the base's ConfigMap carries it

Everything is derived from the spec: ports, health endpoints, model names, the build verbs, resources (memory from
the server's measured memory when `make load` measured it, else the engines on disk and the cache budgets)."""

from __future__ import annotations

import copy
import json
import math
import shlex
import shutil
from pathlib import Path
from typing import Any

import yaml

from pipeline import spec as specmod
from pipeline.deploy import haproxy
from pipeline.deploy.checks import gpus_per_pod, nodes, object_name
from pipeline.spec import Spec

APP = "/app"  # the repository inside the pipeline's image (Dockerfile)
PROXY_IMAGE = "haproxy:2.6"  # the official image of the HAProxy release Debian 12 ships (what the tests run)
LWS_API = "leaderworkerset.x-k8s.io/v1"
MiB = 2**20
GiB = 2**30


def spec_path_in_pod(spec: Spec) -> str:
    """Where the deployed spec is mounted: under build/, so its relative paths resolve against the repository."""
    return f"{APP}/build/{spec.name}.deploy.yaml"


def deployed_spec(spec: Spec) -> dict:
    """The spec as the pods run it: bound to the pod's address (0.0.0.0: the Services reach it there), the rest as
    written. Loopback is the rule on one machine; in a pod the Service is the only way in."""
    d = specmod.to_dict(spec)
    d["triton"]["host"] = "0.0.0.0"
    return d


def _labels(spec: Spec, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": object_name(spec.name), "app.kubernetes.io/component": component,
            "app.kubernetes.io/part-of": "spec-pipeline"}


def _meta(spec: Spec, name: str, component: str, **extra) -> dict:
    return {"name": name, "labels": _labels(spec, component), **extra}


def _ports(spec: Spec) -> dict[str, int]:
    """Every port the serving pod opens, by the name its Service and probes use."""
    tr = spec.triton
    return {"http": tr.http_port, "grpc": tr.grpc_port, "metrics": tr.metrics_port, "openai": spec.openai.port}


def measured_memory(spec: Spec) -> tuple[int, str]:
    """Bytes a serving pod needs and where the figure comes from: the server's resident memory `make load`
    measured (reports/<name>/load.json), else the engines' files plus both caches' budgets per served model."""
    load = spec.report_dir / "load.json"
    models = len(spec.triton.models)
    caches = (spec.prompt_cache.bytes + spec.kv_cache.bytes) * models
    if load.is_file():
        try:
            rss = float(json.loads(load.read_text())["rss_mb"]["after"]) * MiB
        except (KeyError, ValueError, TypeError, json.JSONDecodeError):
            rss = 0.0
        if rss > 0:
            return int(rss) + caches, f"{load} rss_mb.after ({rss / GiB:.1f} GiB) + prompt/kv cache budgets"
    files = [f for sub in ("target", "draft", "medusa") for f in (spec.engine_dir / sub).glob("**/*") if f.is_file()]
    weights = sum(f.stat().st_size for f in files)
    if weights:
        return (weights + caches + 2 * GiB,
                f"engines/{spec.name} on disk ({weights / GiB:.1f} GiB, one copy: the served models share it) "
                "+ cache budgets + 2 GiB runtime")
    return caches + 4 * GiB, "no engines built here: cache budgets + 4 GiB (build once and rerun `make deploy`)"


def _quantity(nbytes: int) -> str:
    return f"{max(1, math.ceil(nbytes / MiB))}Mi"


def _volumes(spec: Spec) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts) of every pipeline container: the spec, the engines' volume and scratch for what `repo`
    and `serve` write (the repository, reports, the C kernel's build cache)."""
    n = object_name(spec.name)
    vols = [{"name": "spec", "configMap": {"name": f"{n}-spec"}},
            {"name": "engines", "persistentVolumeClaim": {"claimName": f"{n}-engines"}},
            {"name": "scratch", "emptyDir": {}},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}}]  # the python backend's shared memory
    mounts = [{"name": "spec", "mountPath": spec_path_in_pod(spec), "subPath": "spec.yaml", "readOnly": True},
              {"name": "engines", "mountPath": f"{APP}/engines"},
              {"name": "scratch", "mountPath": f"{APP}/triton_repo", "subPath": "triton_repo"},
              {"name": "scratch", "mountPath": f"{APP}/reports", "subPath": "reports"},
              {"name": "scratch", "mountPath": "/cache", "subPath": "cache"},
              {"name": "dshm", "mountPath": "/dev/shm"}]
    return vols, mounts


def _env(spec: Spec) -> list[dict]:
    return [{"name": "PIPELINE_CACHE", "value": "/cache/spec-pipeline"},
            {"name": "HF_HUB_OFFLINE", "value": "1"},
            # the OpenAI endpoint's key: from the Secret, never the spec (docs/deploy.md creates it)
            {"name": "PIPELINE_API_KEY",
             "valueFrom": {"secretKeyRef": {"name": f"{object_name(spec.name)}-api-key", "key": "api-key"}}}]


def _cmd(*verbs: str) -> list[str]:
    return ["/bin/sh", "-c", " && ".join(verbs)]


def _verb(spec: Spec, verb: str, *args: str) -> str:
    return " ".join(["python", "-m", "pipeline", verb, shlex.quote(spec_path_in_pod(spec)), *args])


def _probe(path: str, port: str, period: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "timeoutSeconds": 5,
            "failureThreshold": failures}


def _serving_probes(spec: Spec, container: str) -> dict:
    """Probes on the real health endpoints: Triton's /v2/health/live (liveness) and /v2/health/ready, the OpenAI
    endpoint's /health (ready once Triton and the served model are, which is what the proxy routes on)."""
    start_failures = max(3, math.ceil(spec.triton.startup_timeout_s / 10) + 6)
    if container == "triton":
        return {"startupProbe": _probe("/v2/health/live", "http", 10, start_failures),
                "livenessProbe": _probe("/v2/health/live", "http", 15, 4),
                "readinessProbe": _probe("/v2/health/ready", "http", 5, 3)}
    return {"startupProbe": _probe("/health", "openai", 10, start_failures),
            "livenessProbe": _probe("/health", "openai", 30, 6),
            "readinessProbe": _probe("/health", "openai", 5, 3)}


def _container_ports(spec: Spec, names: tuple[str, ...]) -> list[dict]:
    return [{"name": k, "containerPort": v, "protocol": "TCP"} for k, v in _ports(spec).items() if k in names]


def _pod_annotations(spec: Spec, memory_source: str) -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(spec.triton.metrics_port),
            "prometheus.io/path": "/metrics", "spec-pipeline/memory-from": memory_source}


# --- base -----------------------------------------------------------------------------------------------------------


def base(spec: Spec) -> dict[str, Any]:
    """The base's files: name -> list of objects (or, for kustomization.yaml, the mapping)."""
    n = object_name(spec.name)
    ns = spec.deploy.namespace
    files: dict[str, Any] = {}
    files["namespace.yaml"] = [{"apiVersion": "v1", "kind": "Namespace",
                                "metadata": {"name": ns, "labels": {"app.kubernetes.io/part-of": "spec-pipeline"}}}]
    files["spec.yaml"] = [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(spec, f"{n}-spec", "spec"),
                           "data": {"spec.yaml": yaml.safe_dump(deployed_spec(spec), sort_keys=False)}}]
    files["storage.yaml"] = [{
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": _meta(spec, f"{n}-engines", "engines"),
        # ReadWriteMany: the build Job writes once, every replica (on any node) reads
        "spec": {"accessModes": ["ReadWriteMany"],
                 "resources": {"requests": {"storage": f"{spec.deploy.storage // GiB}Gi"}}}}]
    services = []
    selector = _labels(spec, "server")
    for port_name, port in _ports(spec).items():
        meta = _meta(spec, f"{n}-{port_name}", "server")
        if port_name == "metrics":
            meta["annotations"] = {"prometheus.io/scrape": "true", "prometheus.io/port": str(port)}
        services.append({"apiVersion": "v1", "kind": "Service", "metadata": meta,
                         "spec": {"selector": selector, "ports": [{"name": port_name, "port": port,
                                                                   "targetPort": port_name, "protocol": "TCP"}]}})
    # The proxy finds each replica's address through this headless Service (one DNS record per ready pod).
    services.append({"apiVersion": "v1", "kind": "Service", "metadata": _meta(spec, f"{n}-replicas", "server"),
                     "spec": {"clusterIP": "None", "selector": selector,
                              "ports": [{"name": "openai", "port": spec.openai.port, "targetPort": "openai",
                                         "protocol": "TCP"}]}})
    files["services.yaml"] = services
    files["proxy.yaml"] = proxy_objects(spec)
    files["kustomization.yaml"] = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                                   "namespace": ns,
                                   "resources": [f for f in files if f != "kustomization.yaml"]}
    return files


def proxy_config(spec: Spec) -> str:
    """The in-cluster haproxy.cfg: the replicas from their headless Service's DNS records."""
    n = object_name(spec.name)
    servers = haproxy.Servers(dns_name=f"{n}-replicas.{spec.deploy.namespace}.svc.cluster.local",
                              dns_port=spec.openai.port, slots=spec.deploy.replicas)
    return haproxy.render(spec, servers, bind=f":{spec.deploy.proxy_port}")


def proxy_objects(spec: Spec) -> list[dict]:
    """HAProxy in the cluster: its configuration, two replicas of it (each hashes alike: consistent hashing on the
    same servers needs no shared state) and the Service clients use."""
    n = object_name(spec.name)
    labels = _labels(spec, "proxy")
    port = spec.deploy.proxy_port
    pod = {"metadata": {"labels": labels},
           "spec": {"containers": [{
               "name": "haproxy", "image": PROXY_IMAGE,
               "args": ["-f", "/usr/local/etc/haproxy/haproxy.cfg"],
               "ports": [{"name": "proxy", "containerPort": port, "protocol": "TCP"}],
               "readinessProbe": {"tcpSocket": {"port": "proxy"}, "periodSeconds": 5},
               "livenessProbe": {"tcpSocket": {"port": "proxy"}, "periodSeconds": 15},
               "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
               "volumeMounts": [{"name": "config", "mountPath": "/usr/local/etc/haproxy", "readOnly": True}]}],
               "volumes": [{"name": "config", "configMap": {"name": f"{n}-proxy"}}]}}
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(spec, f"{n}-proxy", "proxy"),
         "data": {"haproxy.cfg": proxy_config(spec)}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(spec, f"{n}-proxy", "proxy"),
         "spec": {"replicas": 2, "selector": {"matchLabels": labels}, "template": pod}},
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta(spec, f"{n}-proxy", "proxy"),
         "spec": {"selector": labels, "ports": [{"name": "proxy", "port": port, "targetPort": "proxy",
                                                 "protocol": "TCP"}]}},
    ]


# --- overlays -------------------------------------------------------------------------------------------------------


def gpu_image(spec: Spec) -> str:
    """The serving image of the gpu overlay: the pipeline installed on Triton's TensorRT-LLM container."""
    repo, _, tag = spec.deploy.image.rpartition(":") if ":" in spec.deploy.image.split("/")[-1] else (
        spec.deploy.image, "", "latest")
    return f"{repo}-trtllm:{tag}"


def _build_job(spec: Spec, image: str, gpus: int, memory: int) -> dict:
    """The build Job: the spec's build stages (fetch, engine) into the engines' volume, once; the serving pods
    wait for what it writes."""
    n = object_name(spec.name)
    vols, mounts = _volumes(spec)
    verbs = [_verb(spec, "engine")] if spec.backend == "tensorrt_llm" else [_verb(spec, "fetch"), _verb(spec, "engine")]
    res: dict[str, dict] = {"requests": {"cpu": "2", "memory": _quantity(memory)},
                            "limits": {"memory": _quantity(memory * 2)}}
    if gpus:
        res["limits"]["nvidia.com/gpu"] = str(gpus)
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(spec, f"{n}-build", "build"),
            "spec": {"backoffLimit": 2, "template": {
                "metadata": {"labels": _labels(spec, "build")},
                "spec": {"restartPolicy": "OnFailure",
                         "containers": [{"name": "build", "image": image, "workingDir": APP,
                                         "command": _cmd(*verbs), "env": _env(spec)[:2],
                                         "resources": res, "volumeMounts": mounts}],
                         "volumes": vols}}}}


def _wait_for_engines(spec: Spec, image: str) -> dict:
    """Init container: the serving pod starts once the build Job's engines are in the volume, then writes the
    model repository (`repo`, cheap) into its scratch space."""
    _, mounts = _volumes(spec)
    marker = f"{APP}/engines/{spec.name}/target/config.json"
    if spec.backend == "tensorrt_llm" and spec.tensorrt_llm.era == "llmapi":
        wait = "true"  # the LLM API loads the Hugging Face checkpoints directly: nothing to wait for
    else:
        wait = f"until test -f {shlex.quote(marker)}; do echo waiting for the build Job; sleep 10; done"
    return {"name": "repo", "image": image, "workingDir": APP, "command": _cmd(wait, _verb(spec, "repo")),
            "env": _env(spec)[:2], "volumeMounts": mounts}


def cpu_overlay(spec: Spec) -> dict[str, Any]:
    """torch specs: `serve --foreground` runs Triton and the OpenAI endpoint in one container."""
    n = object_name(spec.name)
    memory, source = measured_memory(spec)
    image = spec.deploy.image
    vols, mounts = _volumes(spec)
    cpus = str(spec.threads or 2)
    container = {"name": "serve", "image": image, "workingDir": APP,
                 "command": _cmd(_verb(spec, "serve", "--foreground")),
                 "env": _env(spec), "ports": _container_ports(spec, ("http", "grpc", "metrics", "openai")),
                 **_serving_probes(spec, "openai"),
                 "resources": {"requests": {"cpu": cpus, "memory": _quantity(memory)},
                               "limits": {"memory": _quantity(int(memory * 1.25))}},
                 "volumeMounts": mounts}
    labels = _labels(spec, "server")
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(spec, n, "server"),
                  "spec": {"replicas": spec.deploy.replicas, "selector": {"matchLabels": labels},
                           "template": {"metadata": {"labels": labels,
                                                     "annotations": _pod_annotations(spec, source)},
                                        "spec": {"initContainers": [_wait_for_engines(spec, image)],
                                                 "containers": [container], "volumes": vols,
                                                 "terminationGracePeriodSeconds": 30}}}}
    files: dict[str, Any] = {"build-job.yaml": [_build_job(spec, image, 0, memory)],
                             "serving.yaml": [deployment]}
    files["kustomization.yaml"] = _overlay_kustomization(files)
    return files


def _overlay_kustomization(files: dict) -> dict:
    # `resources` naming the base directory: kustomize 2.1+ (kubectl 1.21+, the kustomize the tests render with)
    return {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": ["../../base", *files]}


def _gpu_memory(spec: Spec) -> tuple[int, str]:
    """Host memory of a GPU pod: the weights it loads (its share of the plan's), which pass through host memory."""
    from pipeline.trtllm.memory import memory_plan  # lazy: only tensorrt_llm specs need the plan
    from pipeline.trtllm.planning import planned_engine_configs  # lazy: as memory_plan

    try:
        plan = memory_plan(spec, planned_engine_configs(spec))
        weights = sum(m.weights_gib * len(m.gpus) for m in plan.models.values()) * GiB / nodes(spec)
    except Exception:  # noqa: BLE001 - a shape the plan cannot read: the floor below, said in the annotation
        return 32 * GiB, "memory plan unavailable: 32 GiB floor"
    return int(weights) + 16 * GiB, f"memory plan: {weights / GiB:.1f} GiB of weights per pod + 16 GiB"


def _triton_command(spec: Spec, multi_node: bool) -> str:
    """The leader's launch: `serve` (the era's launcher) on one node; across nodes, mpirun over the group's pods
    (LWS_LEADER_ADDRESS and its workers' addresses; TensorRT-LLM's MPI world of tp*pp ranks)."""
    if not multi_node:
        return _verb(spec, "serve")
    world = spec.parallel.tp * spec.parallel.pp
    gpn = spec.deploy.gpus_per_node
    tr = spec.triton
    repo = f"{APP}/triton_repo/{spec.name}"
    hosts = ('echo "$LWS_LEADER_ADDRESS slots=' + str(gpn) + '" > /tmp/hostfile; '
             'i=1; while [ "$i" -lt "$LWS_GROUP_SIZE" ]; do '
             'echo "${LWS_LEADER_ADDRESS%%.*}-$i.${LWS_LEADER_ADDRESS#*.} slots=' + str(gpn) + '" >> /tmp/hostfile; '
             'i=$((i+1)); done')
    launch = "trtllm-llmapi-launch " if spec.tensorrt_llm.era == "llmapi" else ""
    mpi = (f"mpirun --allow-run-as-root --hostfile /tmp/hostfile -np {world} --map-by ppr:{gpn}:node "
           f"{launch}tritonserver --model-repository={repo} --http-port={tr.http_port} --grpc-port={tr.grpc_port} "
           f"--metrics-port={tr.metrics_port} --disable-auto-complete-config")
    return f"{hosts}; {mpi}"


def gpu_overlay(spec: Spec) -> dict[str, Any]:
    """tensorrt_llm specs: Triton's TensorRT-LLM container with the pipeline on it, `nvidia.com/gpu` from the
    parallel plan; a LeaderWorkerSet where the plan spans nodes."""
    n = object_name(spec.name)
    image = gpu_image(spec)
    memory, source = _gpu_memory(spec)
    vols, mounts = _volumes(spec)
    gpus = gpus_per_pod(spec)
    span = nodes(spec)
    res = {"requests": {"cpu": "8", "memory": _quantity(memory)},
           "limits": {"memory": _quantity(int(memory * 1.25)), "nvidia.com/gpu": str(gpus)}}
    triton = {"name": "triton", "image": image, "workingDir": APP, "command": _cmd(_triton_command(spec, span > 1)),
              "env": _env(spec)[:2], "ports": _container_ports(spec, ("http", "grpc", "metrics")),
              **_serving_probes(spec, "triton"), "resources": res, "volumeMounts": mounts}
    front = {"name": "openai", "image": image, "workingDir": APP, "command": _cmd(_verb(spec, "openai")),
             "env": _env(spec), "ports": _container_ports(spec, ("openai",)), **_serving_probes(spec, "openai"),
             "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
             "volumeMounts": mounts}
    labels = _labels(spec, "server")
    pod_spec = {"initContainers": [_wait_for_engines(spec, image)], "containers": [triton, front], "volumes": vols}
    annotations = _pod_annotations(spec, source)
    files: dict[str, Any] = {"build-job.yaml": [_build_job(spec, image, gpus, memory)]}
    if span == 1:
        files["serving.yaml"] = [{
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(spec, n, "server"),
            "spec": {"replicas": spec.deploy.replicas, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod_spec}}}]
    else:
        # Only the leader serves (and carries the server label the Services select); workers hold their ranks.
        worker = {"containers": [{"name": "worker", "image": image, "workingDir": APP,
                                  "command": _cmd("mkdir -p /run/sshd", "/usr/sbin/sshd -D"),
                                  "env": _env(spec)[:2], "resources": copy.deepcopy(res), "volumeMounts": mounts}],
                  "volumes": vols}
        files["serving.yaml"] = [{
            "apiVersion": LWS_API, "kind": "LeaderWorkerSet", "metadata": _meta(spec, n, "server"),
            "spec": {"replicas": spec.deploy.replicas, "leaderWorkerTemplate": {
                "size": span, "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod_spec},
                "workerTemplate": {"metadata": {"labels": _labels(spec, "worker")}, "spec": worker}}}}]
    files["kustomization.yaml"] = _overlay_kustomization(files)
    return files


def overlays(spec: Spec) -> dict[str, dict[str, Any]]:
    """The overlays a spec runs on: cpu for the torch backend, gpu for tensorrt_llm."""
    return {"gpu": gpu_overlay(spec)} if spec.backend == "tensorrt_llm" else {"cpu": cpu_overlay(spec)}


def _dump(content: Any) -> str:
    if isinstance(content, list):
        return "---\n".join(yaml.safe_dump(o, sort_keys=False) for o in content)
    return yaml.safe_dump(content, sort_keys=False)


def write(spec: Spec, out: Path | None = None) -> Path:
    """Write deploy/<name>/ (replacing what a previous run wrote there); return the directory."""
    out = out or Path(spec.root) / "deploy" / spec.name
    if out.exists():
        shutil.rmtree(out)
    header = f"# Generated by `python -m pipeline deploy` from the spec {spec.name!r}; edits are lost.\n"
    for sub, files in [("base", base(spec)), *((f"overlays/{k}", v) for k, v in overlays(spec).items())]:
        (out / sub).mkdir(parents=True, exist_ok=True)
        for name, content in files.items():
            (out / sub / name).write_text(header + _dump(content))
    (out / "haproxy.cfg").write_text(proxy_config(spec))
    return out

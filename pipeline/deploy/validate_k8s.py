"""Render a deploy/<name>/ overlay with `kubectl kustomize` and validate every object against the Kubernetes
schemas (`kubernetes-validate`, strict: an unknown field is an error), the Kubernetes version pinned.

The LeaderWorkerSet is a custom resource with no schema in kubernetes-validate: its pod templates are validated as
PodTemplates (the Kubernetes schema of what they hold) and its own fields against LWS_FIELDS below, written from the
LeaderWorkerSet v1 API reference (docs/deploy.md says what only a cluster with LWS installed checks)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

K8S_VERSION = "1.32.0"  # what the manifests are validated against (kubectl 1.32's kustomize renders them)

# LeaderWorkerSet v1 (leaderworkerset.x-k8s.io/v1): the fields the manifests may set and their types.
LWS_FIELDS = {
    "spec": {"replicas": int, "leaderWorkerTemplate": dict, "startupPolicy": str, "rolloutStrategy": dict,
             "networkConfig": dict},
    "spec.leaderWorkerTemplate": {"size": int, "restartPolicy": str, "leaderTemplate": dict, "workerTemplate": dict,
                                  "subGroupPolicy": dict},
}
LWS_RESTART = ("RecreateGroupOnPodRestart", "None", "Default")


def kubectl() -> str | None:
    """The kubectl on PATH (1.21 or later: scripts/deploy_tools.sh says where it comes from)."""
    return shutil.which("kubectl")


def render(overlay: Path) -> list[dict]:
    """`kubectl kustomize <overlay>`: the objects as `kubectl apply -k` would send them. Anything kustomize says on
    stderr (a deprecation included) is an error here: the manifests must render cleanly."""
    exe = kubectl()
    if exe is None:
        raise RuntimeError("kubectl not found: install it (Debian: apt-get install kubernetes-client; README "
                           "Prerequisites)")
    r = subprocess.run([exe, "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    if r.returncode != 0 or r.stderr.strip():
        raise RuntimeError(f"kubectl kustomize {overlay} failed (rc {r.returncode}): {r.stderr.strip()}")
    return [o for o in yaml.safe_load_all(r.stdout) if o]


def _lws_problems(obj: dict) -> list[str]:
    out: list[str] = []
    name = obj.get("metadata", {}).get("name", "?")
    for path, fields in LWS_FIELDS.items():
        node: object = obj
        for part in path.split("."):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        if not isinstance(node, dict):
            out.append(f"leaderworkerset/{name}: {path} is not a mapping")
            continue
        for k, v in node.items():
            if k not in fields:
                out.append(f"leaderworkerset/{name}: {path}.{k} is not a LeaderWorkerSet v1 field")
            elif not isinstance(v, fields[k]):
                out.append(f"leaderworkerset/{name}: {path}.{k} must be {fields[k].__name__}, got {v!r}")
    tmpl = obj.get("spec", {}).get("leaderWorkerTemplate", {})
    if not isinstance(tmpl.get("size"), int) or tmpl.get("size", 0) < 1:
        out.append(f"leaderworkerset/{name}: spec.leaderWorkerTemplate.size must be 1 or more")
    if tmpl.get("restartPolicy", "Default") not in LWS_RESTART:
        out.append(f"leaderworkerset/{name}: restartPolicy must be one of {LWS_RESTART}")
    if "workerTemplate" not in tmpl:
        out.append(f"leaderworkerset/{name}: spec.leaderWorkerTemplate.workerTemplate is required")
    return out


def _as_pod_templates(obj: dict) -> list[dict]:
    tmpl = obj.get("spec", {}).get("leaderWorkerTemplate", {})
    name = obj.get("metadata", {}).get("name", "lws")
    return [{"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"{name}-{role}"},
             "template": tmpl[key]} for role, key in (("leader", "leaderTemplate"), ("worker", "workerTemplate"))
            if key in tmpl]


def validate(objects: list[dict], version: str = K8S_VERSION) -> tuple[list[str], list[str]]:
    """(errors, warnings) of the rendered objects; both empty is what CI requires."""
    import kubernetes_validate as kv  # lazy: jsonschema and the schemas load only where manifests are checked

    errors: list[str] = []
    warnings: list[str] = []
    todo = []
    for o in objects:
        if o.get("kind") == "LeaderWorkerSet" and str(o.get("apiVersion", "")).startswith("leaderworkerset."):
            errors += _lws_problems(o)
            todo += _as_pod_templates(o)
        else:
            todo.append(o)
    for o in todo:
        what = f"{o.get('kind', '?').lower()}/{o.get('metadata', {}).get('name', '?')}"
        try:
            kv.validate(o, version, strict=True)
        except kv.ValidationError as e:
            errors.append(f"{what}: {'.'.join(str(p) for p in e.path)}: {e.message}")
        except (kv.SchemaNotFoundError, kv.InvalidSchemaError) as e:
            warnings.append(f"{what}: {e}")
    return errors, warnings

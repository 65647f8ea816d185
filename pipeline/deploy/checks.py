"""The deploy section's checks, run by `check` with the rest of the spec (light: no kubectl, no file writing).

A value that would render manifests a cluster refuses, or a proxy that cannot bind, is refused here with the key
named, so `make deploy` never writes what `kubectl apply` would reject."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

Check = Callable[[bool, str, Any, str], None]

# RFC 7230 token: what an HTTP header name may be (HAProxy's req.hdr() takes it as is).
HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")
# RFC 1123 label: a Kubernetes namespace, and the prefix of every object name the manifests give.
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def object_name(spec_name: str) -> str:
    """The spec's name as Kubernetes object names take it (lower case, '-' for '_' and '.')."""
    return re.sub(r"[^a-z0-9-]", "-", spec_name.lower()).strip("-") or "spec"


def nodes(spec) -> int:
    """How many nodes the parallel plan spans (1 for the torch backend and plans that fit one node's GPUs)."""
    if spec.backend != "tensorrt_llm":
        return 1
    world = spec.parallel.tp * spec.parallel.pp
    return -(-world // spec.deploy.gpus_per_node)


def gpus_per_pod(spec) -> int:
    """GPUs each serving pod asks for: the whole plan on one node, else one node's share of it."""
    if spec.backend != "tensorrt_llm":
        return 0
    world = spec.parallel.tp * spec.parallel.pp
    return world if nodes(spec) == 1 else spec.deploy.gpus_per_node


def check_deployable(spec, check: Check) -> None:
    """What only `deploy` needs of a spec: a spec that serves without the OpenAI endpoint is valid elsewhere."""
    check(spec.openai.enabled, "openai.enabled", spec.openai.enabled,
          "the proxy routes sessions to the replicas' OpenAI endpoints: set openai.enabled: true to deploy")


def check_deploy(spec, check: Check) -> None:
    """deploy: replicas, names, the proxy's port (a port of its own) and how the parallel plan lands on nodes."""
    d = spec.deploy
    check(d.replicas >= 1, "deploy.replicas", d.replicas, "must be 1 or more serving pods")
    check(bool(d.image.strip()) and not any(c.isspace() for c in d.image), "deploy.image", d.image,
          "name the pipeline's image, e.g. registry.example.com/spec-pipeline:1 (docs/deploy.md builds it)")
    check(bool(DNS_LABEL.fullmatch(d.namespace)) and len(d.namespace) <= 63, "deploy.namespace", d.namespace,
          "must be a DNS label: lower-case letters, digits and '-', at most 63 characters")
    check(bool(HEADER_NAME.fullmatch(d.session_header)), "deploy.session_header", d.session_header,
          "must be an HTTP header name such as X-Session-Id (letters, digits, '-')")
    check(1 <= d.proxy_port <= 65535, "deploy.proxy_port", d.proxy_port, "must be a TCP port between 1 and 65535")
    tr = spec.triton
    taken = {"triton.http_port": tr.http_port, "triton.grpc_port": tr.grpc_port,
             "triton.metrics_port": tr.metrics_port}
    if spec.openai.enabled:
        taken["openai.port"] = spec.openai.port
    clash = next((k for k, v in taken.items() if v == d.proxy_port), None)
    check(clash is None, "deploy.proxy_port", d.proxy_port,
          f"is also {clash}: give the proxy a port of its own (it runs beside the replicas on one host too)")
    check(d.gpus_per_node >= 1, "deploy.gpus_per_node", d.gpus_per_node, "must be 1 or more GPUs per node")
    check(d.storage >= 2**30, "deploy.storage", d.storage, "must be at least 1GiB for the engines' volume")
    if spec.backend == "tensorrt_llm":
        world = spec.parallel.tp * spec.parallel.pp
        check(world <= d.gpus_per_node or world % d.gpus_per_node == 0, "deploy.gpus_per_node", d.gpus_per_node,
              f"the parallel plan's tp*pp = {world} GPUs must fill whole nodes when it spans several: set "
              f"gpus_per_node to a divisor of {world} (or at least {world} for one node)")

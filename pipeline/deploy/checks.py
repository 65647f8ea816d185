"""What `deploy` needs of a spec beyond the deploy section's own keys, and how the plan lands on nodes.

The section's keys are checked with the rest of the spec (`pipeline.spec._validate_deploy`): a value that would
render manifests a cluster refuses, or a proxy that cannot bind, is refused with the key named, so `make deploy`
never writes what `kubectl apply` would reject. Here: the names the manifests give, the nodes and GPUs a pod takes,
and `check_deployable`, which only `deploy` asks (light: no kubectl, no file writing)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

Check = Callable[[bool, str, Any, str], None]


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

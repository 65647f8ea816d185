"""Who may reach which port: the API key, loopback, and Triton's own doors (docs/openai.md, "Exposure").

The deployment has four ports: the OpenAI front (`openai.host`, `openai.port`) and Triton's gRPC, HTTP and metrics
(`triton.host`). Each binds to loopback unless the spec names another address. The rules:
- a port bound beyond loopback needs an API key in the environment (PIPELINE_API_KEY): `check` and `serve` refuse
  such a spec without one, naming the keys to change;
- with a key set, every door that can run the model asks for it: the front wants `Authorization: Bearer <key>`, and
  tritonserver is started with `--grpc-restricted-protocol` / `--http-restricted-api` for everything but health, so
  its gRPC and HTTP answer an inference (or metadata, repository, statistics...) request only with the header
  `pipeline-api-key: <key>` (gRPC metadata `triton-grpc-protocol-pipeline-api-key: <key>`), on loopback too
  (another local user is a client like any other). Health stays open: it says ready or not ready, nothing else (a
  load balancer's probe carries no key);
- the metrics port serves counters only (no inference); it follows `triton.host` like the others.
Our own clients (pipeline.client, the front) send the header when the key is in their environment.
"""

from __future__ import annotations

import ipaddress
import os

API_KEY_ENV = "PIPELINE_API_KEY"
KEY_HEADER = "pipeline-api-key"  # Triton's HTTP checks this header
GRPC_KEY_HEADER = "triton-grpc-protocol-" + KEY_HEADER  # its gRPC expects the restricted key under this prefix
# Everything Triton restricts except `health`: a request of any of these without the header is refused.
RESTRICTED = ("metadata", "inference", "shared-memory", "model-config", "model-repository", "statistics", "trace",
              "logging")


def api_key(env: dict | None = None) -> str | None:
    """The deployment's API key (None when unset or empty)."""
    return (os.environ if env is None else env).get(API_KEY_ENV) or None


def local_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to `host`."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)


def is_loopback(host: str) -> bool:
    """True for addresses only this machine reaches: 127.0.0.0/8, ::1, localhost."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def open_ports(spec) -> dict[str, str]:
    """The spec's ports bound beyond loopback: {key path: host}."""
    out = {}
    t = spec.triton
    if not is_loopback(t.host):
        out.update({f"triton.{p}": t.host for p in ("grpc_port", "http_port", "metrics_port")})
    if spec.openai.enabled and not is_loopback(spec.openai.host):
        out["openai.port"] = spec.openai.host
    return out


def exposure_error(spec, env: dict | None = None) -> str | None:
    """Why this spec must not be served as it stands (ports beyond loopback with no API key), or None."""
    opened = open_ports(spec)
    if not opened or api_key(env):
        return None
    where = ", ".join(f"{k} on {h}" for k, h in opened.items())
    hosts = sorted({k.split(".")[0] + ".host" for k in opened})
    return (f"{' and '.join(hosts)}: {where} would be reachable from other machines with no authentication. Set "
            f"{API_KEY_ENV} in the environment of `serve` (and of your clients), or bind to 127.0.0.1 "
            f"({' / '.join(hosts)}: 127.0.0.1)")


def triton_flags(key: str | None) -> list[str]:
    """tritonserver's arguments that make its gRPC and HTTP ask for the key (none without a key)."""
    if not key:
        return []
    if any(c in key for c in ",:= \t\n"):
        raise ValueError(f"{API_KEY_ENV}: the key must not contain ',', ':', '=' or whitespace (tritonserver's "
                         "restricted-protocol flags split on them); choose another key")
    value = f"{','.join(RESTRICTED)}:{KEY_HEADER}={key}"
    return [f"--grpc-restricted-protocol={value}", f"--http-restricted-api={value}"]


def redact(args: list[str], key: str | None) -> list[str]:
    """The command line as it may be written to a log: the key replaced."""
    return [a.replace(key, "***") for a in args] if key else list(args)


def grpc_headers(env: dict | None = None) -> dict[str, str] | None:
    """The metadata our gRPC clients send to Triton: the key header when a key is set."""
    key = api_key(env)
    return {GRPC_KEY_HEADER: key} if key else None

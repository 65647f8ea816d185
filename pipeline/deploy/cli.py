"""Verb `deploy` for `python -m pipeline` (registered by pipeline.cli): manifests, and the proxy for loopback."""

from __future__ import annotations

from pathlib import Path

from pipeline import spec as specmod
from pipeline.deploy import haproxy, manifests
from pipeline.deploy.checks import check_deployable


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"--replica: got {text!r}; give HOST:PORT of a replica's OpenAI endpoint, e.g. "
                         "127.0.0.1:8003")
    return host, int(port)


def cmd_deploy(args) -> int:
    s = specmod.load(args.spec)
    check_deployable(s, specmod._check)  # deploy's own needs; `check` accepts a spec without the endpoint
    if args.replica:
        # One host: the replicas' OpenAI endpoints given here, the proxy on loopback at deploy.proxy_port.
        out = Path(args.out) if args.out else s.report_dir / "haproxy.cfg"
        out.parent.mkdir(parents=True, exist_ok=True)
        servers = haproxy.Servers(static=[_host_port(r) for r in args.replica])
        out.write_text(haproxy.render(s, servers, bind=f"127.0.0.1:{s.deploy.proxy_port}",
                                      affinity=not args.round_robin))
        print(f"wrote {out}; run it with `haproxy -f {out}`")
        return 0
    out = manifests.write(s, Path(args.out) if args.out else None)
    kinds = ", ".join(f"overlays/{k}" for k in manifests.overlays(s))
    print(f"wrote {out}/ (base, {kinds}, haproxy.cfg); render with `kubectl kustomize {out}/overlays/...`, "
          "apply per docs/deploy.md")
    return 0


def register(verb) -> None:
    sp = verb("deploy", cmd_deploy, "write deploy/<name>/: Kubernetes manifests (kustomize base + overlays) and the "
                                    "session-affine HAProxy config (docs/deploy.md)")
    sp.add_argument("--out", default="", help="directory (default deploy/<name>/), or the file with --replica")
    sp.add_argument("--replica", action="append", default=[],
                    help="HOST:PORT of a replica's OpenAI endpoint (repeat): write only haproxy.cfg for one host")
    sp.add_argument("--round-robin", action="store_true",
                    help="with --replica: plain round-robin (the baseline the routing measurement compares)")

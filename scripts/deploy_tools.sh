#!/usr/bin/env bash
# What `make deploy`'s tests need beyond the venv (docs/deploy.md): HAProxy (Debian's haproxy package, 2.6 on
# Debian 12) and a kubectl whose kustomize reads `resources: [../../base]` (kubectl 1.21 or later). Debian 12's own
# kubectl (package kubernetes-client) is 1.20, too old: then kubectl comes from the Kubernetes project's apt
# repository (pkgs.k8s.io, package kubectl, pinned minor below). Idempotent; needs root (or sudo) and apt.
set -euo pipefail
KUBE_MINOR="${KUBE_MINOR:-v1.32}"
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

need_apt=()
command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] || need_apt+=(haproxy)

kubectl_ok() {
  command -v kubectl >/dev/null || return 1
  local minor
  minor=$(kubectl version --client -o json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["clientVersion"]["minor"].rstrip("+"))') || return 1
  [ "${minor:-0}" -ge 21 ]
}

if ! kubectl_ok; then
  need_apt+=(kubectl)
  if [ ! -f /etc/apt/sources.list.d/kubernetes.list ]; then
    $SUDO apt-get update -q
    $SUDO apt-get install -y -q ca-certificates curl gpg
    $SUDO mkdir -p /etc/apt/keyrings
    curl -fsSL "https://pkgs.k8s.io/core:/stable:/${KUBE_MINOR}/deb/Release.key" \
      | $SUDO gpg --dearmor -o /etc/apt/keyrings/kubernetes-apt-keyring.gpg
    echo "deb [signed-by=/etc/apt/keyrings/kubernetes-apt-keyring.gpg] https://pkgs.k8s.io/core:/stable:/${KUBE_MINOR}/deb/ /" \
      | $SUDO tee /etc/apt/sources.list.d/kubernetes.list >/dev/null
  fi
fi

if [ "${#need_apt[@]}" -gt 0 ]; then
  $SUDO apt-get update -q
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need_apt[@]}"
fi
echo "deploy tools: $(PATH="$PATH:/usr/sbin" haproxy -v | sed -n 1p); kubectl $(kubectl version --client | sed -n 1p)"

#!/usr/bin/env bash
# What `make deploy`'s tests need beyond the venv (docs/deploy.md): HAProxy (Debian's haproxy package, 2.6 on
# Debian 12) and a kubectl whose kustomize reads `resources: [../../base]` (kubectl 1.21 or later). Debian 12's own
# kubectl (package kubernetes-client) is 1.20, too old: the machine's own kubectl is used (this project's machines
# ship 1.32 with their image) and the script stops with a message where none is found. Idempotent; needs root (or
# sudo) and apt for HAProxy.
set -euo pipefail
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
  # Debian's own kubectl (kubernetes-client) is 1.20: too old for `resources: [../../base]`. These machines' image
  # ships a current one (google-cloud-sdk's); elsewhere install kubectl 1.21+ by hand.
  echo "deploy tools: kubectl 1.21 or later is needed for the deploy tests (kubectl kustomize); install it and rerun" >&2
  exit 1
fi

if [ "${#need_apt[@]}" -gt 0 ]; then
  $SUDO apt-get update -q
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need_apt[@]}"
fi
echo "deploy tools: $(PATH="$PATH:/usr/sbin" haproxy -v | sed -n 1p); kubectl $(kubectl version --client | sed -n 1p)"

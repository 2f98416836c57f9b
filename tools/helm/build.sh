#!/usr/bin/env bash
# Builds the helm CLI from its Go module (this directory's go.mod) with the machine's Go toolchain,
# into a cache outside the repo, so scripts/render-manifests works without a system helm.
# Rebuilds only when the pinned version changes. Prints the binary's path on its last line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
version=$(awk '/^require helm.sh\/helm\/v3 /{print $3}' "$here/go.mod")
cache="${HELM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/istio-cni-rs/helm}/${version}"
mkdir -p "$cache"
export GOFLAGS=-mod=mod CGO_ENABLED=0

if [ -x "$cache/helm" ]; then
  echo "helm: cached at $cache/helm" >&2
else
  echo "helm: building helm $version — a few minutes on 2 cores the first time" >&2
  start=$SECONDS
  (cd "$here" && go build -trimpath -ldflags='-s -w' -o "$cache/helm.tmp" helm.sh/helm/v3/cmd/helm)
  mv "$cache/helm.tmp" "$cache/helm"
  echo "helm: built in $((SECONDS - start))s" >&2
fi
echo "$cache/helm"

#!/usr/bin/env bash
# Builds CNCF distribution's `registry` from its Go module (this directory's go.mod) with the
# machine's Go toolchain, into a cache outside the repo: the OCI registry that
# `scripts/release --push` pushes to in tests and the real node pulls from.
# Rebuilds only when the pinned version changes. Prints the binary's path on its last line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
version=$(awk '/^require github.com\/distribution\/distribution\/v3 /{print $3}' "$here/go.mod")
cache="${REGISTRY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/istio-cni-rs/registry}/${version}"
mkdir -p "$cache"
export GOFLAGS=-mod=mod CGO_ENABLED=0
# One build at a time: scripts/test builds the tools in the background while its steps and
# tests call this for the path; a caller waits here for a build under way instead of racing it.
exec 9>"$cache.lock"
flock 9

if [ -x "$cache/registry" ]; then
  echo "registry: cached at $cache/registry" >&2
else
  echo "registry: building distribution $version — a few minutes on 2 cores the first time" >&2
  start=$SECONDS
  (cd "$here" && go build -trimpath -ldflags='-s -w' -o "$cache/registry.tmp" \
    github.com/distribution/distribution/v3/cmd/registry)
  mv "$cache/registry.tmp" "$cache/registry"
  echo "registry: built in $((SECONDS - start))s" >&2
fi
echo "$cache/registry"

#!/usr/bin/env bash
# Builds kube-apiserver and etcd from their Go modules (this directory's go.mod files) with the
# machine's Go toolchain, into a cache outside the repo. Rebuilds only when the pinned versions change.
# Prints the cache directory on its last line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
k8s_version=$(awk '/^require k8s.io\/kubernetes /{print $3}' "$here/apiserver/go.mod")
etcd_version=$(awk '/^require go.etcd.io\/etcd\/server\/v3 /{print $3}' "$here/etcd/go.mod")
cache="${K8S_TESTENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/istio-cni-rs/k8s}/${k8s_version}-etcd-${etcd_version}"
mkdir -p "$cache"
export GOFLAGS=-mod=mod CGO_ENABLED=0
# One build at a time: scripts/test builds the tools in the background while its steps and
# tests call this for the path; a caller waits here for a build under way instead of racing it.
exec 9>"$cache.lock"
flock 9

build() { # name module-dir package
  local name=$1 dir=$2 pkg=$3
  if [ -x "$cache/$name" ]; then
    echo "k8s-testenv: $name cached at $cache/$name" >&2
    return
  fi
  echo "k8s-testenv: building $name ($pkg) — several minutes on 2 cores the first time" >&2
  local start=$SECONDS
  (cd "$dir" && go build -trimpath -ldflags='-s -w' -o "$cache/$name.tmp" "$pkg")
  mv "$cache/$name.tmp" "$cache/$name"
  echo "k8s-testenv: $name built in $((SECONDS - start))s" >&2
}

build etcd "$here/etcd" .
build kube-apiserver "$here/apiserver" k8s.io/kubernetes/cmd/kube-apiserver
echo "$cache"

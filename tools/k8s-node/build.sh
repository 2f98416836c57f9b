#!/usr/bin/env bash
# Builds the real node's Kubernetes binaries (kube-apiserver, kubelet, kube-controller-manager,
# kube-scheduler, kube-proxy) and kubectl from the same Go module as the test API server
# (tools/k8s-testenv/apiserver), in one `go build` so they share the compiled packages, into a cache
# outside the repo. Builds only the binaries the cache lacks (a binary added to the list later costs
# only its own packages), and everything again when the pinned version changes. The version is stamped in as a
# release build does: kubectl and helm refuse the unstamped `v0.0.0-master+$Format:%H$`.
# Another Kubernetes minor (the real node's version cells, issue #41) is chosen by its argument,
# e.g. `build.sh 1.33`, which builds from that minor's pin (tools/k8s-testenv/apiserver-1.33, written
# by tools/k8s-testenv/pin.sh); no argument, or the default's minor, is tools/k8s-testenv/apiserver.
# Prints the cache directory on its last line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
module="$here/../k8s-testenv/apiserver"
want=${1:-}
if [ -n "$want" ] && ! grep -q "^require k8s.io/kubernetes v$want\." "$module/go.mod"; then
  module+="-$want"
  [ -f "$module/go.mod" ] || {
    echo "k8s-node: no pinned Kubernetes '$want' ($module/go.mod; pin one with tools/k8s-testenv/pin.sh v$want.<patch>)" >&2
    exit 2
  }
fi
k8s_version=$(awk '/^require k8s.io\/kubernetes /{print $3}' "$module/go.mod")
cache="${K8S_NODE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/istio-cni-rs/k8s}/node-${k8s_version}"
bins=(kube-apiserver kubelet kube-controller-manager kube-scheduler kube-proxy kubectl)

# One build at a time: parallel test processes and scripts all call this.
mkdir -p "$(dirname "$cache")"
exec 9>"$cache.lock"
flock 9
missing=()
for b in "${bins[@]}"; do [ -x "$cache/$b" ] || missing+=("$b"); done
if [ "${#missing[@]}" = 0 ]; then
  echo "k8s-node: ${bins[*]} cached at $cache" >&2
  echo "$cache"
  exit 0
fi

command -v go >/dev/null || { echo "k8s-node: the Go toolchain (go) is not on PATH" >&2; exit 1; }
echo "k8s-node: building ${missing[*]} ${k8s_version} — many minutes on 2 cores the first time" >&2
start=$SECONDS
tmp="$cache.tmp"
rm -rf "$tmp" && mkdir -p "$tmp"
pkgs=()
for b in "${missing[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
minor=${k8s_version#v1.}
minor=${minor%%.*}
ldflags="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $p.gitVersion=$k8s_version -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
done
(cd "$module" && GOFLAGS=-mod=mod CGO_ENABLED=0 go build -trimpath -ldflags="$ldflags" -o "$tmp/" "${pkgs[@]}")
mkdir -p "$cache"
for b in "${missing[@]}"; do mv "$tmp/$b" "$cache/$b"; done
rmdir "$tmp"
echo "k8s-node: built in $((SECONDS - start))s" >&2
echo "$cache"

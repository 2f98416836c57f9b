#!/usr/bin/env bash
# Builds flannel for the real node's flannel cell (scripts/real-node, REAL_NODE_PRIMARY=flannel)
# into a cache outside the repo: `flanneld` (the pin in this directory's go.mod) and the `flannel`
# CNI plugin. Rebuilds only when a pin changes. Prints the cache directory on its last line.
#
# flanneld: flannel's main.go is built as the main package of a module made in the cache from
# this directory's go.mod and go.sum. Two of its backend imports are dropped on the way: tencentvpc
# (its SDK, github.com/tencentcloud/tencentcloud-sdk-go/tencentcloud/vpc, is refused by the Go
# module proxy: 403) and udp (cgo only on amd64). The node runs the vxlan backend.
#
# The CNI plugin: github.com/flannel-io/cni-plugin is refused by the module proxy here (403 for
# every version), so it is built from its previous home, plugins/meta/flannel of
# github.com/containernetworking/plugins (the last release that has it), in that module's own
# directory with its own go.mod and go.sum. It reads flanneld's /run/flannel/subnet.env and
# delegates to bridge + host-local as flannel-io/cni-plugin does.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
version=$(awk '$1 == "github.com/flannel-io/flannel" {print $2}' "$here/go.mod")
cni_module=github.com/containernetworking/plugins
cni_version=v0.9.1
cache="${FLANNEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/istio-cni-rs/flannel}/$version-cni-$cni_version"

mkdir -p "$(dirname "$cache")"
exec 9>"$cache.lock"
flock 9
if [ -x "$cache/flanneld" ] && [ -x "$cache/flannel" ]; then
  echo "flannel: $version (CNI plugin $cni_module@$cni_version) cached at $cache" >&2
  echo "$cache"
  exit 0
fi
command -v go >/dev/null || { echo "flannel: the Go toolchain (go) is not on PATH" >&2; exit 1; }
moddir() { # module@version: its directory in the Go module cache
  (cd "$here" && GOFLAGS=-mod=mod go mod download -json "$1" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
}
echo "flannel: building $version and the CNI plugin — a few minutes on 2 cores the first time" >&2
start=$SECONDS
rm -rf "$cache" && mkdir -p "$cache/src"
flannel_dir=$(moddir "github.com/flannel-io/flannel@$version")
[ -f "$flannel_dir/main.go" ] || { echo "flannel: github.com/flannel-io/flannel@$version did not download" >&2; exit 1; }
cp "$here/go.mod" "$here/go.sum" "$cache/src/"
sed -e '/flannel\/pkg\/backend\/tencentvpc"$/d' -e '/flannel\/pkg\/backend\/udp"$/d' \
  "$flannel_dir/main.go" >"$cache/src/main.go"
(cd "$cache/src" && GOFLAGS="-mod=readonly -buildvcs=false" CGO_ENABLED=0 go build -trimpath \
  -ldflags="-s -w -X github.com/flannel-io/flannel/pkg/version.Version=$version" -o "$cache/flanneld.tmp" .)
cni_dir=$(moddir "$cni_module@$cni_version")
[ -d "$cni_dir/plugins/meta/flannel" ] || { echo "flannel: $cni_module@$cni_version did not download" >&2; exit 1; }
(cd "$cni_dir" && GOFLAGS="-mod=mod -buildvcs=false" CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' \
  -o "$cache/flannel.tmp" ./plugins/meta/flannel)
rm -rf "$cache/src"
mv "$cache/flanneld.tmp" "$cache/flanneld"
mv "$cache/flannel.tmp" "$cache/flannel"
echo "flannel: built in $((SECONDS - start))s" >&2
echo "$cache"

#!/usr/bin/env bash
# Builds CoreDNS (the real node's cluster DNS) from the version pinned in this directory's go.mod,
# in the module's own directory in the Go module cache (its go.mod and go.sum decide every
# dependency), into a cache outside the repo. Rebuilds only when the pin changes. Prints the cache
# directory on its last line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
version=$(awk '/^require github.com\/coredns\/coredns /{print $3}' "$here/go.mod")
cache="${COREDNS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/istio-cni-rs/coredns}/$version"

mkdir -p "$(dirname "$cache")"
exec 9>"$cache.lock"
flock 9
if [ -x "$cache/coredns" ]; then
  echo "coredns: $version cached at $cache" >&2
  echo "$cache"
  exit 0
fi
command -v go >/dev/null || { echo "coredns: the Go toolchain (go) is not on PATH" >&2; exit 1; }
moddir=$(cd "$here" && GOFLAGS=-mod=mod go mod download -json "github.com/coredns/coredns@$version" \
  | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[ -d "$moddir" ] || { echo "coredns: github.com/coredns/coredns@$version did not download" >&2; exit 1; }
echo "coredns: building $version — a few minutes on 2 cores the first time" >&2
start=$SECONDS
mkdir -p "$cache"
(cd "$moddir" && GOFLAGS="-mod=readonly -buildvcs=false" CGO_ENABLED=0 go build -trimpath \
  -ldflags="-s -w -X github.com/coredns/coredns/coremain.GitCommit=$version" -o "$cache/coredns.tmp" .)
mv "$cache/coredns.tmp" "$cache/coredns"
echo "coredns: built in $((SECONDS - start))s" >&2
echo "$cache"

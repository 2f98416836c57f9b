#!/usr/bin/env bash
# Builds CRI-O for the real node's CRI-O cell (scripts/real-node, REAL_NODE_RUNTIME=crio) into a
# cache outside the repo: `crio` (cmd/crio of the pin in this directory's go.mod, built in that
# module's own directory, whose go.mod and go.sum pin its dependencies) and `pinns` (C, in the same
# module: CRI-O's helper that creates and pins a pod's namespaces). Not in scripts/setup's default
# list: a cold build takes about 20 minutes on two cores, paid when the cell is first run.
#
# crio needs cgo and Debian's libseccomp-dev, libgpgme-dev and libbtrfs-dev; its build tags are
# the Makefile's for a host without ostree, AppArmor, SELinux or libsubid, with btrfs left out (the
# node stores images in vfs) and OpenPGP signatures checked in Go.
# Prints the cache directory on its last line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
module=github.com/cri-o/cri-o
version=$(awk -v m="$module" '$1 == "require" && $2 == m {print $3}' "$here/go.mod")
cache="${CRIO_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/istio-cni-rs/crio}/$version"
tags="containers_image_ostree_stub exclude_graphdriver_btrfs containers_image_openpgp seccomp"

mkdir -p "$(dirname "$cache")"
exec 9>"$cache.lock"
flock 9
# Debian's packages the cell needs, installed here rather than by scripts/setup: the libraries
# the build links against, and what the node runs beside crio (conmon, the container monitor;
# skopeo, which copies the node's images into containers-storage).
missing=()
for p in libseccomp-dev libgpgme-dev libbtrfs-dev conmon skopeo; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "crio: installing ${missing[*]}" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2
fi
if [ -x "$cache/crio" ] && [ -x "$cache/pinns" ]; then
  echo "crio: $version cached at $cache" >&2
  echo "$cache"
  exit 0
fi
command -v go >/dev/null || { echo "crio: the Go toolchain (go) is not on PATH" >&2; exit 1; }
src=$(cd "$here" && go mod download -json "$module@$version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[ -f "$src/cmd/crio/main.go" ] || { echo "crio: $module@$version did not download" >&2; exit 1; }
echo "crio: building $version — about 20 minutes on 2 cores the first time" >&2
start=$SECONDS
rm -rf "$cache" && mkdir -p "$cache"
(cd "$src" && GOFLAGS="-mod=readonly -buildvcs=false" CGO_ENABLED=1 go build -trimpath -tags "$tags" \
  -ldflags="-s -w" -o "$cache/crio.tmp" ./cmd/crio)
gcc -std=c99 -Os -Wall -Wextra -static -o "$cache/pinns.tmp" "$src"/pinns/src/*.c
mv "$cache/crio.tmp" "$cache/crio"
mv "$cache/pinns.tmp" "$cache/pinns"
echo "crio: built in $((SECONDS - start))s" >&2
echo "$cache"

#!/usr/bin/env bash
# Builds named binaries of the pinned Istio (tools/istio/go.mod) from its module in the Go module
# cache, as Istio's release does (CGO_ENABLED=0, -trimpath, tags vtprotobuf,disable_pgv, stripped),
# into a cache outside the repo keyed by the pinned version. Rebuilds only what is missing. The build
# runs in the module's own directory so Istio's go.mod and go.sum (its exact dependency versions and
# replaces) apply, and nothing in the repo is written.
#
#   tools/istio/build.sh [BINARY...]     # default: pilot-discovery
#
# Known binaries: pilot-discovery (istiod), pilot-agent, istioctl, install-cni, istio-cni, and
# log-golden: our tools/istio/log-golden/main.go, built as a module whose go.mod is Istio's own
# (every requirement and replace, so Istio's exact dependency versions) plus Istio itself. Prints
# the cache directory on its last line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
version=$(awk '/^require istio.io\/istio /{print $3}' "$here/go.mod")
cache="${ISTIO_BIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/istio-cni-rs/istio}/$version"
[ "$#" -gt 0 ] || set -- pilot-discovery

pkg_of() { # binary name -> package path inside istio.io/istio
  case "$1" in
    pilot-discovery) echo ./pilot/cmd/pilot-discovery ;;
    pilot-agent) echo ./pilot/cmd/pilot-agent ;;
    istioctl) echo ./istioctl/cmd/istioctl ;;
    install-cni) echo ./cni/cmd/install-cni ;;
    istio-cni) echo ./cni/cmd/istio-cni ;;
    log-golden) echo log-golden ;;
    *) echo "tools/istio/build.sh: unknown Istio binary '$1' (known: pilot-discovery pilot-agent istioctl install-cni istio-cni log-golden)" >&2
       return 1 ;;
  esac
}
# A cached log-golden is kept only while it was built from the current source.
golden_src="$here/log-golden/main.go"
golden_sum=$(sha256sum "$golden_src" | cut -d' ' -f1)
if [ "$(cat "$cache/log-golden.sum" 2>/dev/null)" != "$golden_sum" ]; then rm -f "$cache/log-golden"; fi
pkgs=() names=()
for b in "$@"; do
  p=$(pkg_of "$b")
  [ -x "$cache/$b" ] && continue
  pkgs+=("$p") names+=("$b")
done

if [ "${#names[@]}" = 0 ]; then
  echo "tools/istio: $* cached at $cache" >&2
  echo "$cache"
  exit 0
fi

# One build at a time: parallel test processes and scripts all call this.
mkdir -p "$cache"
exec 9>"$cache.lock"
flock 9
todo=() todo_names=()
for i in "${!names[@]}"; do
  [ -x "$cache/${names[$i]}" ] || { todo+=("${pkgs[$i]}"); todo_names+=("${names[$i]}"); }
done
if [ "${#todo[@]}" = 0 ]; then
  echo "tools/istio: $* cached at $cache" >&2
  echo "$cache"
  exit 0
fi

command -v go >/dev/null || { echo "tools/istio: the Go toolchain (go) is not on PATH" >&2; exit 1; }
moddir=$("$here/moddir.sh")
echo "tools/istio: building ${todo_names[*]} ($version) — many minutes on 2 cores the first time" >&2
start=$SECONDS
tmp="$cache/.tmp"
rm -rf "$tmp" && mkdir -p "$tmp"
build() { # dir, packages...: Istio's release flags
  (cd "$1" && shift && GOFLAGS="-mod=readonly -buildvcs=false" CGO_ENABLED=0 \
    go build -trimpath -tags vtprotobuf,disable_pgv -ldflags='-s -w' -o "$tmp/" "$@")
}
istio_pkgs=()
for p in "${todo[@]}"; do [ "$p" = log-golden ] || istio_pkgs+=("$p"); done
# One `go build` for all: they share most compiled packages.
if [ "${#istio_pkgs[@]}" -gt 0 ]; then build "$moddir" "${istio_pkgs[@]}"; fi
if [ "${#istio_pkgs[@]}" != "${#todo[@]}" ]; then
  gmod="$tmp/log-golden-module"
  mkdir -p "$gmod"
  cp "$golden_src" "$gmod/main.go"
  { sed 's|^module istio.io/istio$|module istio-cni-rs/log-golden|' "$moddir/go.mod"
    echo "require istio.io/istio $version"; } >"$gmod/go.mod"
  cat "$moddir/go.sum" "$here/go.sum" >"$gmod/go.sum"
  build "$gmod" .
  rm -r "$gmod"
  echo "$golden_sum" >"$cache/log-golden.sum"
fi
for b in "${todo_names[@]}"; do mv "$tmp/$b" "$cache/$b"; done
rmdir "$tmp"
echo "tools/istio: built ${todo_names[*]} in $((SECONDS - start))s" >&2
echo "$cache"

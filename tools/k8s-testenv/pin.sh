#!/usr/bin/env bash
# Pins another Kubernetes minor for the real node's version cells (issue #41): writes
# tools/k8s-testenv/apiserver-<major.minor>/go.mod the way apiserver/go.mod is written for the
# default version: require k8s.io/kubernetes at the given release, and replace each of its staging
# modules (which it requires at v0.0.0) with the matching k8s.io/* v0.<minor>.<patch> release, read
# from its own go.mod's replace block so a module added or dropped in that minor is followed.
# tools.go is apiserver/'s (a symlink), so every version pins the same commands; `go mod tidy`
# then writes the dependencies and go.sum. Run again with a newer patch to move the pin.
# Usage: tools/k8s-testenv/pin.sh v1.33.13
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
version=${1:-}
[[ "$version" =~ ^v1\.([0-9]+)\.([0-9]+)$ ]] || {
  echo "pin.sh: '$version' is not a Kubernetes release like v1.33.13" >&2
  exit 2
}
minor=${BASH_REMATCH[1]} patch=${BASH_REMATCH[2]}
dir="$here/apiserver-1.$minor"
export GOFLAGS=-mod=mod
upstream=$(go mod download -json "k8s.io/kubernetes@$version" | awk -F'"' '/"GoMod":/{print $4}')
[ -s "$upstream" ] || { echo "pin.sh: no go.mod for k8s.io/kubernetes@$version from the module proxy" >&2; exit 1; }
staging=$(sed -n '/^replace (/,/^)/p' "$upstream" | awk '$2 == "=>" && $3 ~ /^\.\/staging\//{print $1}')
[ -n "$staging" ] || { echo "pin.sh: $upstream has no staging replace block" >&2; exit 1; }
go_line=$(awk '/^go /{print; exit}' "$upstream")

mkdir -p "$dir"
{
  echo "// Kubernetes $version for the real node's version cells; written by ../pin.sh $version."
  echo "module istio-cni-rs/tools/k8s-testenv/apiserver-1.$minor"
  echo
  echo "$go_line"
  echo
  echo "require k8s.io/kubernetes $version"
  echo
  echo "replace ("
  for m in $staging; do printf '\t%s => %s v0.%s.%s\n' "$m" "$m" "$minor" "$patch"; done
  echo ")"
} >"$dir/go.mod"
ln -sfn ../apiserver/tools.go "$dir/tools.go"
(cd "$dir" && go mod tidy)
echo "pin.sh: pinned $version in $dir" >&2

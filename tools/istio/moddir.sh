#!/usr/bin/env bash
# Prints the directory of the pinned Istio module (this directory's go.mod) in the Go module cache,
# downloading it on first use. Conformance tests and image builds read Istio's test vectors, charts
# and sources from there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
version=$(awk '/^require istio.io\/istio /{print $3}' "$here/go.mod")
dir=$(cd "$here" && GOFLAGS=-mod=mod go mod download -json "istio.io/istio@$version" \
  | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[ -d "$dir" ] || { echo "tools/istio: istio.io/istio@$version did not download" >&2; exit 1; }
echo "$dir"

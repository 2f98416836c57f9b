#!/usr/bin/env bash
# Builds Anchore's syft from its Go module (this directory's go.mod) with the machine's Go
# toolchain, into a cache outside the repo: the SBOM tool scripts/release runs over the release's
# images (it reads their Debian packages from /var/lib/dpkg/status.d, as in distroless images).
# Rebuilds only when the pinned version changes. Prints the binary's path on its last line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
version=$(awk '/^require github.com\/anchore\/syft /{print $3}' "$here/go.mod")
[ -n "$version" ] || { echo "syft: no github.com/anchore/syft version in $here/go.mod" >&2; exit 1; }
cache="${SYFT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/istio-cni-rs/syft}/${version}"
mkdir -p "$cache"
export GOFLAGS=-mod=mod CGO_ENABLED=0
# One build at a time: scripts/test builds the tools in the background while its steps and
# tests call this for the path; a caller waits here for a build under way instead of racing it.
exec 9>"$cache.lock"
flock 9

if [ -x "$cache/syft" ]; then
  echo "syft: cached at $cache/syft" >&2
else
  echo "syft: building syft $version — several minutes on 2 cores the first time" >&2
  start=$SECONDS
  # The version syft prints and writes into each SBOM's tool metadata.
  ldflags="-s -w -X main.version=${version#v}"
  (cd "$here" && go build -trimpath -ldflags="$ldflags" -o "$cache/syft.tmp" github.com/anchore/syft/cmd/syft)
  mv "$cache/syft.tmp" "$cache/syft"
  echo "syft: built in $((SECONDS - start))s" >&2
fi
echo "$cache/syft"

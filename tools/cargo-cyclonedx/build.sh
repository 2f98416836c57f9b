#!/usr/bin/env bash
# Installs CycloneDX's cargo-cyclonedx (the version pinned below) from crates.io with the machine's
# cargo, into a cache outside the repo: scripts/release runs it for the SBOM of the crates built
# into each release binary. Reinstalls only when the pinned version changes. Prints the binary's
# path on its last line.
set -euo pipefail
version=0.5.9
cache="${CARGO_CYCLONEDX_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/istio-cni-rs/cargo-cyclonedx}/${version}"
mkdir -p "$(dirname "$cache")"
# One build at a time: scripts/test builds the tools in the background while its steps and
# tests call this for the path; a caller waits here for a build under way instead of racing it.
exec 9>"$cache.lock"
flock 9

if [ -x "$cache/bin/cargo-cyclonedx" ]; then
  echo "cargo-cyclonedx: cached at $cache/bin/cargo-cyclonedx" >&2
else
  echo "cargo-cyclonedx: building $version — a few minutes on 2 cores the first time" >&2
  start=$SECONDS
  # Its own temporary target dir, not the workspace's (nor a CARGO_TARGET_DIR of the caller).
  env -u CARGO_TARGET_DIR -u CARGO_BUILD_TARGET_DIR cargo install --quiet --locked \
    --version "$version" --root "$cache" cargo-cyclonedx >&2
  echo "cargo-cyclonedx: built in $((SECONDS - start))s" >&2
fi
echo "$cache/bin/cargo-cyclonedx"

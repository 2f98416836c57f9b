# shellcheck shell=bash
# Sourced by the scripts that run what cargo built. Cargo builds into CARGO_TARGET_DIR, a cargo
# config's build.target-dir, or ./target; only cargo knows which, so it is asked.
# Sets $target_dir (absolute).
target_dir=$(cargo metadata --format-version 1 --no-deps --offline 2>/dev/null |
  sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
[ -n "$target_dir" ] || { echo "${0##*/}: cargo metadata did not name a target directory" >&2; exit 1; }

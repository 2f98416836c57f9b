# shellcheck shell=bash disable=SC2154 # $me and $target_dir are the sourcing script's
# What the agent image holds, for every script that builds it (scripts/node-images for the real
# node, scripts/release for each platform of a release): sourced, not run. `$root` is the tree
# the netfilter tools come from: empty for this machine's, or a directory with Debian's packages
# of another architecture unpacked in it (`dpkg-deb -x`); `$triplet` is its multiarch directory
# name (x86_64-linux-gnu, aarch64-linux-gnu). The caller sets `$me` (its name, for errors).

need() {
  command -v "$1" >/dev/null || { echo "$me: $1 not found (apt-get install $2, or scripts/setup)" >&2; exit 1; }
}

# Our images carry no libraries: refuse a binary that asks for a dynamic loader.
static() {
  if readelf -lW "$1" | grep -q 'program interpreter'; then
    echo "$me: $1 is dynamically linked" >&2
    exit 1
  fi
}

# Our own binaries pack their relative relocations (.cargo/config.toml): unpacked, the agent maps
# 455 KiB of them for good at every start. A static executable that is not position-independent
# (aarch64's musl target) has none to pack.
packed() {
  local rela
  rela=$(readelf -SW "$1" | sed -n 's/^ *\[ *[0-9]*\] //p' | awk '$1 == ".rela.dyn" { print $5 }')
  if [ -n "$rela" ] && [ $((16#$rela)) -gt 0 ] && ! readelf -SW "$1" | grep -q '\.relr\.dyn'; then
    echo "$me: $1 has unpacked relocations (-z pack-relative-relocs needs GNU ld >= 2.38 or lld)" >&2
    exit 1
  fi
}

# Builds install-cni and istio-cni statically for the Rust target `$1` (a musl one) with cargo
# profile `$2` and sets $bindir. The machine's own target links with musl-gcc and packs its
# relocations by .cargo/config.toml; another architecture's links with the toolchain's own
# rust-lld (self-contained musl) and clang compiles ring's C: no cross C toolchain.
build_agent() {
  local target=$1 profile=$2
  rustup target list --installed | grep -qx "$target" || rustup target add "$target" >&2
  local -a env=()
  if [ "$target" = "$(uname -m)-unknown-linux-musl" ]; then
    need musl-gcc musl-tools
  else
    need clang clang
    # Replaces the config's `-Wl,` flags, which only a C compiler driver takes; aarch64's static
    # musl executables are not position-independent and have no relative relocations to pack.
    env=("CC_${target//-/_}=clang" "RUSTFLAGS=-C linker=rust-lld")
  fi
  env "${env[@]}" cargo build --locked --profile "$profile" --target "$target" \
    -p cni-agent -p cni-plugin --bin install-cni --bin istio-cni >&2
  bindir="$target_dir/$target/$profile"
  [ "$profile" != dev ] || bindir="$target_dir/$target/debug"
}

# `--file` arguments for the dynamic loader and every library the ELF files $3... load, found in
# `$1` (root, empty for this machine) the way the loader looks without a cache (the multiarch
# directories of `$2`, then /lib and /usr/lib), each at its path under that root.
libraries() {
  need readelf binutils
  local root=$1 triplet=$2
  shift 2
  local -a queue=("$@") dirs=("/lib/$triplet" "/usr/lib/$triplet" /lib /usr/lib /usr/local/lib)
  local -A seen=()
  local f interp soname dir path
  while [ ${#queue[@]} -gt 0 ]; do
    f=${queue[0]}
    queue=("${queue[@]:1}")
    interp=$(readelf -lW "$f" | sed -n 's/.*Requesting program interpreter: \(.*\)\]$/\1/p')
    if [ -n "$interp" ] && [ -z "${seen[$interp]:-}" ]; then
      [ -e "$root$interp" ] || { echo "$me: $f needs the loader $interp, not in ${root:-/}" >&2; exit 1; }
      # Libraries name the loader by its soname too: it is loaded once, at its own path.
      seen[$interp]=1
      seen[${interp##*/}]=1
      printf -- '--file\n%s=%s\n' "$interp" "$root$interp"
    fi
    while read -r soname; do
      [ -z "${seen[$soname]:-}" ] || continue
      path=""
      for dir in "${dirs[@]}"; do
        if [ -e "$root$dir/$soname" ]; then path="$dir/$soname"; break; fi
      done
      [ -n "$path" ] || { echo "$me: $f needs $soname, in none of ${dirs[*]} under ${root:-/}" >&2; exit 1; }
      seen[$soname]=1
      printf -- '--file\n%s=%s\n' "$path" "$root$path"
      queue+=("$root$path")
    done < <(readelf -dW "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]$/\1/p')
  done
}

# `--file`/`--symlink` arguments, one a line, for Debian's netfilter tools as Istio's images carry
# them: iptables and ip6tables in both variants (`*-legacy*` and `*-nft*`, the links to their
# xtables multi-binaries), the plain names on the nft variant (Debian's default), ipset and nft,
# with the xtables extension modules and every shared library all of these load. The agent that
# programs the iptables backend (ours or Istio's) runs them inside the image against the node.
netfilter_tools() {
  local root=$1 triplet=$2
  local sbin=/usr/sbin f name variant target
  local xtdir=/usr/lib/$triplet/xtables
  local -a bins=("$sbin/xtables-legacy-multi" "$sbin/xtables-nft-multi" "$sbin/ipset" "$sbin/nft")
  for f in "${bins[@]}"; do
    [[ -f $root$f && -x $root$f ]] || {
      echo "$me: $root$f not found (apt-get install iptables ipset nftables, or scripts/setup)" >&2
      exit 1
    }
  done
  local -a mods=("$root$xtdir"/*.so)
  [ -e "${mods[0]}" ] || { echo "$me: no xtables modules in $root$xtdir (apt-get install iptables)" >&2; exit 1; }
  for f in "${bins[@]}"; do printf -- '--file\n%s=%s\n' "$f" "$root$f"; done
  for f in "${mods[@]}"; do printf -- '--file\n%s=%s\n' "${f#"$root"}" "$f"; done
  for name in iptables ip6tables; do
    for variant in legacy nft; do
      for f in "$name-$variant" "$name-$variant-save" "$name-$variant-restore"; do
        target=$(readlink "$root$sbin/$f" || true)
        [ "$target" = "xtables-$variant-multi" ] || {
          echo "$me: $root$sbin/$f is not a link to xtables-$variant-multi (apt-get install iptables)" >&2
          exit 1
        }
        printf -- '--symlink\n%s=%s\n' "$sbin/$f" "$target"
      done
    done
    for f in "$name" "$name-save" "$name-restore"; do
      printf -- '--symlink\n%s=%s\n' "$sbin/$f" xtables-nft-multi
    done
  done
  # Every library the binaries and modules load (one `--file` each, the loader included).
  local found
  found=$(libraries "$root" "$triplet" "${bins[@]/#/$root}" "${mods[@]}") || exit 1
  paste - - <<<"$found" | sort -u | tr '\t' '\n'
  # Legacy iptables takes its lock in /run (`/run/xtables.lock`).
  printf -- '--dir\n/run=755\n'
}

# The `oci-archive` arguments, one a line, of the agent image as the Dockerfile lays it out: our
# static binaries from `$1` (checked static and packed), the netfilter tools of `$2`/`$3` and the
# os-release of their distribution. The
# installer copies every regular file of /opt/cni/bin to the host.
agent_image_args() {
  local bindir=$1 root=$2 triplet=$3 found
  need readelf binutils
  for f in install-cni istio-cni; do
    static "$bindir/$f"
    packed "$bindir/$f"
  done
  found=$(netfilter_tools "$root" "$triplet") || exit 1
  printf -- '--file\n/usr/local/bin/install-cni=%s\n--file\n/opt/cni/bin/istio-cni=%s\n' \
    "$bindir/install-cni" "$bindir/istio-cni"
  printf '%s\n' "$found"
  # Which distribution the netfilter tools are from (base-files' os-release): what an SBOM or
  # vulnerability scanner names their packages by.
  [ -e "$root/etc/os-release" ] || { echo "$me: no $root/etc/os-release (Debian's base-files)" >&2; exit 1; }
  printf -- '--file\n/etc/os-release=%s\n' "$root/etc/os-release"
  printf -- '--dir\n/tmp=1777\n--env\nPATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/opt/cni/bin\n'
  printf -- '--workdir\n/opt/cni/bin\n--entrypoint\n["install-cni"]\n'
}

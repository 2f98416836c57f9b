# shellcheck shell=bash disable=SC2154,SC2034 # state shared by scripts/real-node and its files
# CRI-O (REAL_NODE_RUNTIME=crio): runtime.sh's contract. CRI-O v1.34 from its Go module
# (tools/crio/build.sh, built and cached when the cell first runs), Debian's conmon as the
# container monitor and runc as the OCI runtime, with drop_infra_ctr (templates/crio.conf): a
# pod's sandbox is its namespaces pinned by pinns under /var/run/netns, with no pause process in
# them (istio/istio#60478). Images live in containers-storage, copied there from the node's OCI
# archives by Debian's skopeo. Sourced by runtime.sh.

runtime_binary=runc
# conmon and skopeo are Debian's, installed with the build (ensure_crio) when missing.
runtime_tools=$runtime_binary
runtime_component=crio
runtime_layout() { sock="$node_dir/crio/crio.sock"; }

# CRI-O's binaries (crio, pinns), built on first use (a cold build takes about 20 minutes), and
# the Debian packages the cell needs.
crio_bin=""
ensure_crio() {
  [ -n "$crio_bin" ] && return
  local out=${TMPDIR:-/tmp}/real-node-crio.$$.log
  crio_bin=$("$repo/tools/crio/build.sh" 2>"$out" | tail -n 1) || {
    tail -n 20 "$out" >&2
    fail "building CRI-O failed (tools/crio/build.sh)"
  }
  rm -f "$out"
}

write_runtime_config() {
  local dir=$node_dir runtime_path conmon_path
  ensure_crio
  runtime_path=$(command -v "$runtime_binary") conmon_path=$(command -v conmon)
  mkdir -p "$dir/crio/storage" "$dir/crio/hooks"
  echo '{"default": [{"type": "insecureAcceptAnything"}]}' >"$dir/crio/policy.json"
  render crio-runc-restricted.sh >"$dir/crio/runc-restricted"
  chmod +x "$dir/crio/runc-restricted"
  render crio.conf >"$dir/crio/crio.conf"
}

start_crio() {
  ensure_crio
  start_component crio "$crio_bin/crio" --config "$node_dir/crio/crio.conf" --config-dir "" \
    --registries-conf /dev/null
}
wait_crio() { wait_for crio 60 inside test -S "$sock"; }

# CRI-O asks the runtime to limit hugepages when /proc/cgroups lists hugetlb, and runc's cgroupfs
# driver then fails every container ("cannot set hugetlb limit") on a hybrid machine whose hugetlb
# is the v2 hierarchy's (hierarchy 0 there). The node's /proc/cgroups lists only the controllers
# of v1 hierarchies, the ones its pods can be limited by; the machine's stays as it is.
runtime_fs_setup() {
  awk 'NR == 1 || $2 != 0' /proc/cgroups >"$node_dir/crio/proc-cgroups"
  mount --bind "$node_dir/crio/proc-cgroups" /proc/cgroups
}

# Copies every image of the OCI archives <dir>/*.tar into the selected node's containers-storage,
# under the names the archive gives them (its manifests' ref.name).
import_runtime_images() { # dir
  local tar name
  for tar in "$1"/*.tar; do
    for name in $(tar -xOf "$tar" index.json | grep -o '"org.opencontainers.image.ref.name":"[^"]*"' | cut -d'"' -f4); do
      inside skopeo --insecure-policy copy -q "oci-archive:$tar:$name" \
        "containers-storage:[vfs@$node_dir/crio/storage+/run/containers/storage]$name" || return 1
      echo "imported $name from $tar"
    done
  done
}

runtime_versions() {
  ensure_crio
  echo "crio $("$crio_bin/crio" --version | awk 'NR == 1 {print $3}')"
  echo "conmon $(conmon --version | awk 'NR == 1 {print $3}')"
  echo "$runtime_binary $("$runtime_binary" --version | awk 'NR == 1 {print $3}')"
}

# shellcheck shell=bash disable=SC2154,SC2034 # state shared by scripts/real-node and its files
# containerd with runc or crun under its runc shim (REAL_NODE_RUNTIME=runc|crun): runtime.sh's
# contract. Sourced by runtime.sh.

# The OCI runtime containerd's runc shim runs (crun takes runc's command line).
runtime_binary=$runtime
runtime_tools="containerd containerd-shim-runc-v2 $runtime_binary ctr"
runtime_component=containerd
runtime_layout() { sock="$node_dir/containerd/containerd.sock"; }

write_runtime_config() {
  local dir=$node_dir
  mkdir -p "$dir/containerd"
  render containerd-config.toml >"$dir/containerd/config.toml"
}

start_containerd() {
  start_component containerd containerd --config "$node_dir/containerd/config.toml"
}
wait_containerd() { wait_for containerd 30 ctr --address "$sock" version; }

# The OCI archives <dir>/*.tar into the selected node's containerd (k8s.io namespace).
import_runtime_images() { # dir
  [ -x "$repo/scripts/node-images" ] || fail "--images needs scripts/node-images"
  "$repo/scripts/node-images" import "$sock" "$1"
}

runtime_fs_setup() {
  # crun refuses a hybrid cgroup machine whose v2 hierarchy holds a controller (here hugetlb): the
  # node's view loses the v2 mount (its own mount namespace), so crun runs on v1 alone, as runc does.
  if [ "$runtime" = crun ] && mountpoint -q /sys/fs/cgroup/unified; then umount /sys/fs/cgroup/unified; fi
}

runtime_versions() {
  echo "containerd $(containerd --version | awk '{print $3}')"
  echo "$runtime $("$runtime_binary" --version | awk 'NR == 1 {print $3}')"
}

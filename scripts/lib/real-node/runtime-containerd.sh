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
  cat >"$dir/containerd/config.toml" <<EOF
version = 2
root = "$dir/containerd/root"
state = "/run/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "$sock"
[plugins."io.containerd.internal.v1.opt"]
  path = "$dir/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/istio-cni-rs/pause:dev"
  # The machine's processes lack CAP_SYS_RESOURCE: lowering a score below the parent's fails.
  restrict_oom_score_adj = true
  disable_apparmor = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/opt/cni/bin"
    conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "$runtime"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.$runtime]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.$runtime.options]
      BinaryName = "$runtime_binary"
      SystemdCgroup = false
EOF
}

start_containerd() {
  start_component containerd containerd --config "$node_dir/containerd/config.toml"
}
wait_containerd() { wait_for containerd 30 ctr --address "$sock" version; }

runtime_fs_setup() {
  # crun refuses a hybrid cgroup machine whose v2 hierarchy holds a controller (here hugetlb): the
  # node's view loses the v2 mount (its own mount namespace), so crun runs on v1 alone, as runc does.
  if [ "$runtime" = crun ] && mountpoint -q /sys/fs/cgroup/unified; then umount /sys/fs/cgroup/unified; fi
}

runtime_versions() {
  echo "containerd $(containerd --version | awk '{print $3}')"
  echo "$runtime $("$runtime_binary" --version | awk 'NR == 1 {print $3}')"
}

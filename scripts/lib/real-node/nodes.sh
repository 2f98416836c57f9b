# shellcheck shell=bash disable=SC2154,SC2034 # state shared by scripts/real-node and its files
# The cluster's addresses, every node's layout (select_node) and how commands enter a node: its
# namespace holder (pid 1 of the node) and nsenter. Sourced by scripts/real-node.

# The cluster's name in kubeconfigs; node 1's name, where the control plane runs.
cluster_name=real-node
# Node 1's IP: the API server and CoreDNS for every node.
api_ip=10.240.0.10
service_ip=10.96.0.1
service_cidr=10.96.0.0/16
dns_ip=10.96.0.10
# Every node's pod CIDR (10.244.(K-1).0/24 for node K): kube-proxy's clusterCIDR.
cluster_cidr=10.244.0.0/16
api_port=443

pki="$dir/pki"
# How many nodes the cluster has (`up --nodes N`; 1 when never said).
node_count() { cat "$dir/nodes" 2>/dev/null || echo 1; }

# Selects node K (1 = the control-plane node): every per-node variable below follows. Node 1's
# state is the directory itself, worker K's is <dir>/node-K.
select_node() { # K
  node=$1
  if [ "$node" = 1 ]; then
    node_dir=$dir
    node_name=$cluster_name
    node_ip=$api_ip
    node_pki=$pki
    api_server=https://127.0.0.1:$api_port
  else
    node_dir=$dir/node-$node
    node_name=$cluster_name-$node
    node_ip=10.240.0.$((9 + node))
    node_pki=$node_dir/pki
    api_server=https://$api_ip:$api_port
  fi
  pod_cidr=10.244.$((node - 1)).0/24
  run="$node_dir/run"
  logs="$node_dir/logs"
  runtime_layout
  # Pods' cgroups live under this root in every v1 hierarchy (and only there), so `stop` can find
  # and kill every container process of this node, and nothing else.
  cgroup_root="/istio-cni-rs/$(printf %s "$node_dir" | sha256sum | cut -c1-12)"
}
holder_pid() { cat "$run/holder.pid" 2>/dev/null || true; }
# A process's start time (clock ticks since boot), the field after its state, ppid, ...: with its
# pid, what names one process for good.
proc_start() { # pid
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
  stat=${stat##*) }
  echo "$stat" | cut -d' ' -f20
}
# Whether the node's init is the process it was: pids wrap within minutes on a busy machine
# (pid_max 32768), and the kernel hands a dead namespace's number to the next one made at once,
# so a stale holder.pid or mntns may name another node by now (a CI run's node was killed so).
holder_alive() {
  local pid
  pid=$(holder_pid)
  [ -n "$pid" ] && [ "$(proc_start "$pid")" = "$(cat "$run/holder.start" 2>/dev/null)" ] &&
    [ "$(readlink "/proc/$pid/ns/mnt" 2>/dev/null)" = "$(cat "$run/mntns" 2>/dev/null)" ]
}
# Whether process PID lives in this node's mount namespace; its number is this node's only while
# the node's init lives.
in_node() { # pid
  [ -n "$1" ] && holder_alive &&
    [ "$(readlink "/proc/$1/ns/mnt" 2>/dev/null)" = "$(cat "$run/mntns" 2>/dev/null)" ]
}
# Runs a command inside the node's mount and network namespaces (in its root directory).
inside() {
  holder_alive || fail "node $node_name in $dir is not running (scripts/real-node up)"
  nsenter -t "$(holder_pid)" -m -n -p -- "$@"
}
# The same for the user's commands (kubectl, helm, exec, shell), in the caller's working directory:
# nsenter would move them to /, where the relative paths they were given (deploy/...) are gone.
# The node's mount namespace sees the machine's paths, except its own /run and the overlays.
inside_here() {
  holder_alive || fail "node $node_name in $dir is not running (scripts/real-node up)"
  nsenter -t "$(holder_pid)" -m -n -p --wd="$PWD" -- "$@"
}

cmd_exec() {
  ensure_bins
  inside_here env KUBECONFIG="$node_pki/admin.kubeconfig" PATH="$k8s_bin:$PATH" "$@"
}

# Starts the selected node's namespace holder: pid 1 of the node, which sets up its filesystem
# and network (`_holder`).
start_holder() {
  # A pid namespace too: the node's /proc shows only its own processes, so a pod reading
  # /proc/1/ns/net (the agent finding "the host") gets the node's namespace, not the machine's,
  # and killing its init kills every process of the node.
  REAL_NODE_DIR=$dir setsid unshare --mount --net --pid --fork --mount-proc --propagation private \
    -- "$self" _holder "$node" </dev/null >"$logs/holder.log" 2>&1 &
  local unshare_pid=$! deadline=$((SECONDS + 10))
  until [ -e "$run/holder.ready" ]; do
    kill -0 "$unshare_pid" 2>/dev/null || { tail_log holder; return_fail "the namespaces of $node_name could not be set up"; }
    [ $SECONDS -lt $deadline ] || { tail_log holder; return_fail "the namespaces of $node_name were not set up after 10s"; }
    sleep 0.05
  done
  # The holder is unshare's child, pid 1 of the node.
  tr -d ' ' <"/proc/$unshare_pid/task/$unshare_pid/children" >"$run/holder.pid"
  proc_start "$(holder_pid)" >"$run/holder.start"
  readlink "/proc/$(holder_pid)/ns/mnt" >"$run/mntns"
}

# Entry point of the namespace holder, pid 1 of node K: sets up the node's filesystem and
# network, then becomes an init that reaps orphans (containerd's shims are reparented to it).
cmd_holder() {
  select_node "${1:-1}"
  node_fs_setup
  rm -f "$run/holder.ready"
  touch "$run/holder.ready"
  exec catatonit -P
}

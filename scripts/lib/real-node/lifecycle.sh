# shellcheck shell=bash disable=SC2154,SC2034 # state shared by scripts/real-node and its files
# The cluster's lifecycle: `up`, `stop`, `down`, `restart`. Sourced by scripts/real-node.

cmd_up() {
  local images="" count
  count=$(node_count)
  while [ $# -gt 0 ]; do
    case $1 in
      --images) images=${2:?--images needs a directory}; shift 2 ;;
      --nodes)
        count=${2:?--nodes needs a number}
        [[ $count =~ ^[1-9][0-9]*$ && $count -le 200 ]] || fail "--nodes: 1..200, not $count"
        shift 2 ;;
      *) fail "up: unknown argument $1" ;;
    esac
  done
  require_tools
  case $dir/ in
    /etc/* | /opt/* | /var/lib/* | /run/* | /var/run/* | /var/log/*)
      fail "REAL_NODE_DIR=$dir is under a directory the node mounts over; pick another" ;;
  esac
  mkdir -p "$dir" "$run" "$logs"
  if holder_alive; then fail "the node in $dir is already running (scripts/real-node stop)"; fi
  [ -e "$run/mntns" ] && cmd_stop >/dev/null 2>&1 # leftovers of a node that crashed
  mkdir -p "$run" "$logs"
  echo "$count" >"$dir/nodes"
  save_cell
  ensure_bins
  trap 'return_fail "interrupted"' INT TERM
  local start=$SECONDS k
  make_pki
  write_configs
  make_cgroups
  start_holder

  start_etcd
  start_kube_apiserver
  "start_$runtime_component"
  for k in $(seq 2 "$count"); do (select_node "$k"; start_worker); done
  wait_kube_apiserver
  start_kube_controller_manager
  start_kube_scheduler
  apply_addons
  start_kube_proxy
  start_coredns
  for k in $(seq "$count"); do (select_node "$k"; "wait_$runtime_component"); done
  [ -z "$images" ] || import_images_all "$images" "$count"
  wait_kube_controller_manager
  wait_kube_scheduler
  start_kubelet
  for k in $(seq 2 "$count"); do (select_node "$k"; start_kubelet; start_kube_proxy); done
  if [ "$primary" = flannel ]; then
    for k in $(seq "$count"); do (select_node "$k"; start_flannel); done
    for k in $(seq "$count"); do (select_node "$k"; wait_flannel); done
  fi
  wait_kube_proxy
  wait_coredns
  wait_kubelet
  for k in $(seq 2 "$count"); do (select_node "$k"; wait_kube_proxy; wait_kubelet); done
  if [ "$count" = 1 ]; then
    log "node $node_name ready in $((SECONDS - start))s (dir $dir)"
  else
    log "$count nodes ready in $((SECONDS - start))s (dir $dir)"
  fi
}

# Every process whose mount namespace is the node's: components, shims, hostNetwork pods' helpers.
node_processes() {
  local want p
  want=$(cat "$run/mntns" 2>/dev/null) || return 0
  [ -n "$want" ] || return 0
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/ns/mnt" 2>/dev/null)" = "$want" ] && echo "${p#/proc/}"
  done
  return 0
}
pod_processes() {
  local h
  for h in $(cgroup_hierarchies); do
    [ -d "$h$cgroup_root" ] && find "$h$cgroup_root" -name cgroup.procs -exec cat {} + 2>/dev/null
  done | sort -u
}
# Kills the selected node's init, then whatever of the node is left, and removes its cgroups and
# run dir (its components are stopped already).
stop_node_rest() {
  local pids holder pin="" alive=""
  # The node's init last: the kernel kills whatever is left in its pid namespace. Its mount
  # namespace is held open meanwhile, so the number node_processes matches cannot be handed to
  # another node's namespace while the loop runs. A node whose init is gone already has no
  # process left in it (all ran in its pid namespace), and its recorded number may be another
  # node's by now: then only the pods' cgroups, which are this node's by path, are looked at.
  holder=$(holder_pid)
  if holder_alive && exec {pin}<"/proc/$holder/ns/mnt"; then
    alive=1
    kill -KILL "$holder" 2>/dev/null || true
  fi
  for _ in 1 2 3 4 5; do
    mapfile -t pids < <(pod_processes)
    [ "${#pids[@]}" = 0 ] || kill -KILL "${pids[@]}" 2>/dev/null || true
    if [ -n "$alive" ]; then
      mapfile -t pids < <(node_processes)
      [ "${#pids[@]}" = 0 ] || kill -KILL "${pids[@]}" 2>/dev/null || true
    fi
    [ -z "$(pod_processes)${alive:+$(node_processes)}" ] && break
    sleep 0.3
  done
  [ -z "$pin" ] || exec {pin}<&-
  remove_cgroups
  rm -rf "$run"
}

cmd_stop() {
  # Also when a failure in a worker's start (return_fail) stops the whole cluster.
  select_node 1
  [ -d "$run" ] || { log "no node in $dir"; return 0; }
  local c k
  # The workers first (in parallel), while the API server still answers their kubelets.
  local workers=()
  for k in $(seq 2 "$(node_count)"); do
    (select_node "$k"; stop_worker) &
    workers+=($!)
  done
  [ ${#workers[@]} = 0 ] || wait "${workers[@]}"
  # kubelet first (it would restart what dies), the API server before etcd.
  stop_component kubelet
  local waits=()
  for c in kube-scheduler kube-controller-manager "$runtime_component" kube-proxy coredns flannel; do
    stop_component "$c" &
    waits+=($!)
  done
  stop_component kube-apiserver
  wait "${waits[@]}"
  stop_component etcd
  stop_node_rest
  log "node stopped (state kept in $dir)"
}

cmd_down() {
  cmd_stop
  rm -rf "$dir"
  log "node removed"
}

cmd_restart() {
  local c=${1:?restart needs a component}
  holder_alive || fail "node $node_name in $dir is not running"
  case $node:$c in
    *:kubelet | *:"$runtime_component" | *:kube-proxy) ;;
    *:flannel) [ "$primary" = flannel ] || fail "restart flannel: the node's primary CNI is $primary" ;;
    1:kube-apiserver | 1:kube-controller-manager | 1:kube-scheduler | 1:coredns | 1:etcd) ;;
    1:*) fail "restart: unknown component $c" ;;
    *) fail "restart: $node_name runs kubelet, $runtime_component and kube-proxy, not $c" ;;
  esac
  ensure_bins
  stop_component "$c"
  "start_${c//-/_}"
  [ "$c" = etcd ] || "wait_${c//-/_}"
  log "$c restarted"
}

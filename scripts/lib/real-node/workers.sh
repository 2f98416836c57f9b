# shellcheck shell=bash disable=SC2154,SC2034 # state shared by scripts/real-node and its files
# Worker nodes (`up --nodes N`): joined to node 1 by a veth pair, started and stopped with it.
# Sourced by scripts/real-node.

# Joins the selected worker to node 1: a veth pair `wkK` (node 1) - `eth0` (worker), the worker's
# node IP on its end, a host route to it and a route to its pod CIDR in node 1, and node 1 as the
# worker's default gateway (to node 1, its pods, the Service IPs bound there and the other
# workers, which node 1 forwards to).
link_worker() {
  local n1 nk link=wk$node
  n1=$(cat "$dir/run/holder.pid") nk=$(holder_pid)
  nsenter -t "$n1" -n -- ip link add "$link" type veth peer name eth0 netns "$nk"
  # Under flannel its VXLAN routes are the only way to the worker's pods.
  local pod_route="ip route add $pod_cidr via $node_ip dev $link"
  [ "$primary" != flannel ] || pod_route=true
  nsenter -t "$n1" -n -- sh -c "ip link set $link up &&
    ip route add $node_ip/32 dev $link &&
    $pod_route &&
    echo 1 >/proc/sys/net/ipv4/ip_forward"
  nsenter -t "$nk" -n -- sh -c "ip addr add $node_ip/32 dev eth0 &&
    ip link set eth0 up &&
    ip route add $api_ip/32 dev eth0 &&
    ip route add default via $api_ip dev eth0 &&
    echo 1 >/proc/sys/net/ipv4/ip_forward"
}

# A worker up to its runtime: state, certificates, configs, cgroups, namespaces, the link.
start_worker() {
  mkdir -p "$node_dir" "$run" "$logs"
  make_worker_pki
  write_configs
  make_cgroups
  start_holder
  link_worker
  "start_$runtime_component"
}

# Stops the selected worker: kubelet first, then its runtime and kube-proxy, then the rest.
stop_worker() {
  [ -d "$run" ] || return 0
  stop_component kubelet
  stop_component "$runtime_component" &
  stop_component kube-proxy
  stop_component flannel
  wait
  stop_node_rest
}

# shellcheck shell=bash disable=SC2154,SC2034 # state shared by scripts/real-node and its files
# The node's configuration files (kubelet, kube-proxy, resolv.conf, CoreDNS, the cluster's
# addons), written into the selected node's directory. Sourced by scripts/real-node.

write_configs() {
  local dir=$node_dir
  mkdir -p "$dir/kubelet" "$dir/volume-plugins" "$dir/var-log" "$dir/sysctl" \
    "$dir/kube-proxy"
  write_runtime_config
  render kubelet-config.yaml >"$dir/kubelet/config.yaml"
  if [ -n "${REAL_NODE_MAX_RESTART_BACKOFF:-}" ]; then
    render kubelet-crash-loop-backoff.yaml >>"$dir/kubelet/config.yaml"
  fi
  # Node 1 runs CoreDNS on its port 53; the workers ask it there.
  if [ "$node" = 1 ]; then echo "nameserver 127.0.0.1"; else echo "nameserver $api_ip"; fi >"$dir/resolv.conf"
  # kube-proxy: iptables mode (the node's iptables is nft-backed Debian iptables). bindAddress is
  # the node IP, which spares it waiting for the Node object to learn it. Conntrack limits and
  # timeouts are kernel-wide or module parameters on this machine: 0 leaves them as they are.
  render kube-proxy-config.yaml >"$dir/kube-proxy/config.yaml"
  # The rest (CoreDNS, the cluster's addons) is node 1's.
  [ "$node" = 1 ] || return 0
  mkdir -p "$dir/coredns"
  # CoreDNS: the kubernetes plugin for cluster.local and reverse zones, nothing forwarded (the node
  # has no way out). It listens on the node's port 53; the kube-dns Service's endpoint is the node
  # IP, so kube-proxy sends 10.96.0.10 there.
  render Corefile >"$dir/coredns/Corefile"
  # Cluster objects the node's own components need, applied once the API server is up.
  render addons.yaml >"$dir/addons.yaml"
}

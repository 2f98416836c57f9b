# shellcheck shell=bash disable=SC2154,SC2034 # state shared by scripts/real-node and its files
# The primary CNI (REAL_NODE_PRIMARY): its conflist, the reference plugins it chains and, for
# flannel, flanneld. Sourced by scripts/real-node once the cell is known.

# The reference CNI plugins the node chains (Debian's containernetworking-plugins).
debian_cni=${REAL_NODE_CNI_PLUGINS:-/usr/lib/cni}
# The primary CNI: its conflist (in the node's /etc/cni/net.d) and the plugins it chains.
case $primary in
  bridge) primary_conflist=/etc/cni/net.d/10-bridge.conflist primary_plugins="bridge host-local loopback portmap" ;;
  ptp) primary_conflist=/etc/cni/net.d/10-kindnet.conflist primary_plugins="ptp host-local loopback portmap" ;;
  # The flannel plugin (tools/flannel) delegates to bridge + host-local.
  flannel) primary_conflist=/etc/cni/net.d/10-flannel.conflist primary_plugins="bridge host-local loopback portmap" ;;
  *) fail "REAL_NODE_PRIMARY=$primary: not one of bridge, ptp, flannel" ;;
esac

# The primary's conflist as its installer writes it, for the selected node's pod CIDR.
primary_conflist_text() {
  case $primary in
    bridge) render bridge.conflist ;;
    # kindnet's (kind's default CNI) template: ptp, host routes to each pod's veth, no bridge.
    ptp) render kindnet.conflist ;;
    # kube-flannel's cni-conf.json: the subnet comes from flanneld's /run/flannel/subnet.env.
    flannel) render flannel.conflist ;;
  esac
}

# flanneld (REAL_NODE_PRIMARY=flannel) with the kube subnet manager: the node's podCIDR (set here
# once its kubelet registered it, as the controller-manager's allocator would) is its flannel
# subnet, the node IP on eth0 its VXLAN endpoint, and it masquerades what leaves the cluster CIDR
# (kube-flannel's and k3s's --ip-masq: without it the plugin has bridge masquerade pod-to-pod
# traffic between nodes). Each start writes the conflist again and copies the plugin, as
# kube-flannel's install-cni init container does at every flannel pod start.
start_flannel() {
  wait_for kubelet 90 kubectl_in get node "$node_name"
  kubectl_in patch node "$node_name" --type merge \
    -p "{\"spec\":{\"podCIDR\":\"$pod_cidr\",\"podCIDRs\":[\"$pod_cidr\"]}}" >/dev/null
  mkdir -p "$node_dir/flannel"
  render flannel-net-conf.json >"$node_dir/flannel/net-conf.json"
  inside sh -c "mkdir -p /run/flannel && rm -f /run/flannel/subnet.env && cp -f '$flannel_bin/flannel' /opt/cni/bin/flannel"
  primary_conflist_text | inside sh -c "cat >$primary_conflist"
  start_component flannel env NODE_NAME="$node_name" "$flannel_bin/flanneld" --kube-subnet-mgr \
    --kubeconfig-file="$node_pki/admin.kubeconfig" --iface=eth0 --ip-masq \
    --net-config-path="$node_dir/flannel/net-conf.json" --subnet-file=/run/flannel/subnet.env
}
wait_flannel() { wait_for flannel 90 inside test -s /run/flannel/subnet.env; }

# shellcheck shell=bash disable=SC2154,SC2034 # state shared by scripts/real-node and its files
# What describes the node to its users: `env` (the test bed's contract) and `versions`. Sourced by
# scripts/real-node.

cmd_env() {
  ensure_bins
  cat <<EOF
REAL_NODE_DIR=$dir
REAL_NODE_PID=$(holder_pid)
REAL_NODE_KUBECONFIG=$node_pki/admin.kubeconfig
REAL_NODE_CONTAINERD_SOCK=$sock
REAL_NODE_API=$api_server
REAL_NODE_NAME=$node_name
REAL_NODE_BIN=$k8s_bin
REAL_NODE_TESTENV_BIN=$testenv_bin
REAL_NODE_COREDNS_BIN=$coredns_bin
REAL_NODE_DNS_IP=$dns_ip
REAL_NODE_IP=$node_ip
REAL_NODE_POD_CIDR=$pod_cidr
REAL_NODE_NODES=$(node_count)
REAL_NODE_PRIMARY=$primary
REAL_NODE_RUNTIME=$runtime
REAL_NODE_K8S=$k8s
REAL_NODE_CONFLIST=$primary_conflist
EOF
}

# What a node of this shape runs, one `component version` a line (scripts/matrix records them).
cmd_versions() {
  ensure_bins
  echo "kubelet $("$k8s_bin/kubelet" --version | awk '{print $2}')"
  runtime_versions
  case $primary in
    bridge | ptp) echo "$primary $(dpkg-query -W -f='${Version}' containernetworking-plugins) (Debian's containernetworking-plugins)" ;;
    flannel) echo "flannel $("$flannel_bin/flanneld" --version 2>&1) (flanneld VXLAN, tools/flannel; its CNI plugin from $(basename "$flannel_bin" | sed 's/.*-cni-/containernetworking\/plugins /'))" ;;
  esac
}

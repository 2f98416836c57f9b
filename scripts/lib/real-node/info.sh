# shellcheck shell=bash disable=SC2154,SC2034 # state shared by scripts/real-node and its files
# What describes the node to its users: `env` (the test bed's contract) and `versions`. Sourced by
# scripts/real-node.

# The test bed (crates/testbed/src/real_node.rs) learns the node's layout from these lines only:
# where its files, logs, certificates and cgroups are, its name and addresses. Node K's with
# `--node K`; a node that is not running has them too (REAL_NODE_PID is then empty).
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
REAL_NODE_NODE_DIR=$node_dir
REAL_NODE_RUN=$run
REAL_NODE_HOLDER_PID_FILE=$run/holder.pid
REAL_NODE_LOGS=$logs
REAL_NODE_POD_LOGS=$node_dir/var-log/pods
REAL_NODE_CGROUP_ROOT=$cgroup_root
REAL_NODE_CA=$pki/ca.crt
REAL_NODE_ADMIN_CERT=$pki/admin.crt
REAL_NODE_ADMIN_KEY=$pki/admin.key
REAL_NODE_APISERVER_CERT=$pki/apiserver.crt
REAL_NODE_APISERVER_KEY=$pki/apiserver.key
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

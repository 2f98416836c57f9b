# shellcheck shell=bash disable=SC2154,SC2034 # state shared by scripts/real-node and its files
# The node's configuration files (kubelet, kube-proxy, resolv.conf, CoreDNS, the cluster's
# addons), written into the selected node's directory. Sourced by scripts/real-node.

write_configs() {
  local dir=$node_dir
  mkdir -p "$dir/kubelet" "$dir/volume-plugins" "$dir/var-log" "$dir/sysctl" \
    "$dir/kube-proxy"
  write_runtime_config
  cat >"$dir/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $pki/ca.crt}
authorization: {mode: Webhook}
tlsCertFile: $node_pki/kubelet-serving.crt
tlsPrivateKeyFile: $node_pki/kubelet-serving.key
containerRuntimeEndpoint: unix://$sock
cgroupDriver: cgroupfs
cgroupRoot: $cgroup_root
failCgroupV1: false
failSwapOn: false
oomScoreAdj: 0
volumePluginDir: $dir/volume-plugins
resolvConf: $dir/resolv.conf
clusterDomain: cluster.local
clusterDNS: [$dns_ip]
healthzBindAddress: 127.0.0.1
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 50Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
serializeImagePulls: false
maxPods: 250
EOF
  if [ -n "${REAL_NODE_MAX_RESTART_BACKOFF:-}" ]; then
    cat >>"$dir/kubelet/config.yaml" <<EOF
featureGates: {KubeletCrashLoopBackOffMax: true}
crashLoopBackOff: {maxContainerRestartPeriod: $REAL_NODE_MAX_RESTART_BACKOFF}
EOF
  fi
  # Node 1 runs CoreDNS on its port 53; the workers ask it there.
  if [ "$node" = 1 ]; then echo "nameserver 127.0.0.1"; else echo "nameserver $api_ip"; fi >"$dir/resolv.conf"
  # kube-proxy: iptables mode (the node's iptables is nft-backed Debian iptables). bindAddress is
  # the node IP, which spares it waiting for the Node object to learn it. Conntrack limits and
  # timeouts are kernel-wide or module parameters on this machine: 0 leaves them as they are.
  cat >"$dir/kube-proxy/config.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $node_pki/kube-proxy.kubeconfig}
hostnameOverride: $node_name
bindAddress: $node_ip
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
clusterCIDR: $cluster_cidr
nodePortAddresses: [primary]
mode: iptables
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s, udpTimeout: 0s, udpStreamTimeout: 0s}
EOF
  # The rest (CoreDNS, the cluster's addons) is node 1's.
  [ "$node" = 1 ] || return 0
  mkdir -p "$dir/coredns"
  # CoreDNS: the kubernetes plugin for cluster.local and reverse zones, nothing forwarded (the node
  # has no way out). It listens on the node's port 53; the kube-dns Service's endpoint is the node
  # IP, so kube-proxy sends 10.96.0.10 there.
  cat >"$dir/coredns/Corefile" <<EOF
.:53 {
    errors
    ready 127.0.0.1:8181
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig $pki/coredns.kubeconfig $node_name
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }
    cache 5
}
EOF
  # Cluster objects the node's own components need, applied once the API server is up.
  cat >"$dir/addons.yaml" <<EOF
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "system:coredns", labels: {app.kubernetes.io/part-of: real-node}}
rules:
- apiGroups: [""]
  resources: [endpoints, services, pods, namespaces]
  verbs: [list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "system:coredns", labels: {app.kubernetes.io/part-of: real-node}}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:coredns"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:coredns"}]
---
apiVersion: v1
kind: Service
metadata:
  name: kube-dns
  namespace: kube-system
  labels: {k8s-app: kube-dns, kubernetes.io/name: CoreDNS, app.kubernetes.io/part-of: real-node}
spec:
  clusterIP: $dns_ip
  ports:
  - {name: dns, port: 53, protocol: UDP}
  - {name: dns-tcp, port: 53, protocol: TCP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kube-dns-node
  namespace: kube-system
  labels:
    kubernetes.io/service-name: kube-dns
    endpointslice.kubernetes.io/managed-by: real-node
    app.kubernetes.io/part-of: real-node
addressType: IPv4
endpoints:
- addresses: [$node_ip]
  conditions: {ready: true}
  nodeName: $node_name
ports:
- {name: dns, port: 53, protocol: UDP}
- {name: dns-tcp, port: 53, protocol: TCP}
EOF
}

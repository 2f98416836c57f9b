# shellcheck shell=bash disable=SC2154,SC2034 # state shared by scripts/real-node and its files
# The cluster's PKI: its CA, the components' certificates and kubeconfigs, per node. Sourced by
# scripts/real-node.

cert() { # name subject extensions: <node_pki>/name.{crt,key}, signed by the cluster's CA
  local name=$1 subj=$2 ext=$3 out=$node_pki
  [ -s "$out/$name.crt" ] && return
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "$subj" \
    -keyout "$out/$name.key" -out "$out/$name.csr" 2>/dev/null
  printf '%b\n' "$ext" >"$out/$name.ext"
  openssl x509 -req -in "$out/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 3650 -extfile "$out/$name.ext" -out "$out/$name.crt" 2>/dev/null
  rm -f "$out/$name.csr" "$out/$name.ext"
}
client_ext='basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth'
server_ext() { printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\nsubjectAltName=%s' "$1"; }

kubeconfig() { # name cert-path-without-suffix: <node_pki>/name.kubeconfig, this node's API address
  local user=$1 client_cert=$2
  render kubeconfig.yaml >"$node_pki/$1.kubeconfig"
}

make_pki() {
  mkdir -p "$pki"
  if [ ! -s "$pki/ca.crt" ]; then
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 3650 \
      -subj "/CN=istio-cni-rs-real-node-ca" -keyout "$pki/ca.key" -out "$pki/ca.crt" 2>/dev/null
  fi
  [ -s "$pki/sa.key" ] || {
    openssl ecparam -name prime256v1 -genkey -noout 2>/dev/null | openssl pkey -out "$pki/sa.key"
    openssl pkey -in "$pki/sa.key" -pubout -out "$pki/sa.pub"
  }
  cert apiserver "/CN=kube-apiserver" "$(server_ext "IP:127.0.0.1,IP:$node_ip,IP:$service_ip,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local")"
  cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "$client_ext"
  cert admin "/O=system:masters/CN=real-node-admin" "$client_ext"
  cert controller-manager "/CN=system:kube-controller-manager" "$client_ext"
  cert scheduler "/CN=system:kube-scheduler" "$client_ext"
  cert kubelet "/O=system:nodes/CN=system:node:$node_name" "$client_ext"
  cert kubelet-serving "/O=system:nodes/CN=system:node:$node_name" "$(server_ext "IP:$node_ip,IP:127.0.0.1,DNS:$node_name")"
  # kube-proxy's user is bound to system:node-proxier by the API server's bootstrap policy;
  # CoreDNS's gets its ClusterRole from the node's addons (write_configs).
  cert kube-proxy "/CN=system:kube-proxy" "$client_ext"
  cert coredns "/CN=system:coredns" "$client_ext"
  kubeconfig admin "$pki/admin"
  kubeconfig controller-manager "$pki/controller-manager"
  kubeconfig scheduler "$pki/scheduler"
  kubeconfig kubelet "$pki/kubelet"
  kubeconfig kube-proxy "$pki/kube-proxy"
  kubeconfig coredns "$pki/coredns"
}

# A worker's own certificates (its kubelet's) and kubeconfigs (to node 1's API server at the
# node IP), in <node-dir>/pki; the CA and the shared client certificates stay in <dir>/pki.
make_worker_pki() {
  mkdir -p "$node_pki"
  cert kubelet "/O=system:nodes/CN=system:node:$node_name" "$client_ext"
  cert kubelet-serving "/O=system:nodes/CN=system:node:$node_name" "$(server_ext "IP:$node_ip,IP:127.0.0.1,DNS:$node_name")"
  kubeconfig admin "$pki/admin"
  kubeconfig kubelet "$node_pki/kubelet"
  kubeconfig kube-proxy "$pki/kube-proxy"
}

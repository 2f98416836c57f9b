# shellcheck shell=bash disable=SC2154,SC2034 # state shared by scripts/real-node and its files
# The node's components as processes: start one inside the node, wait until it works, stop it;
# and each component's start and readiness check. Sourced by scripts/real-node.

tail_log() { # name
  log "last lines of $logs/$1.log:"
  tail -n 25 "$logs/$1.log" 2>/dev/null | sed 's/^/    /' >&2 || true
}
component_pid() { cat "$run/$1.pid" 2>/dev/null || true; }
component_alive() { in_node "$(component_pid "$1")"; }

# Starts one component inside the node, in its own session (Ctrl-C on `up` does not reach it),
# logging to <dir>/logs/<name>.log.
start_component() { # name cmd...
  local name=$1 holder
  shift
  holder=$(holder_pid)
  # Nothing forks in the background job before it becomes nsenter (no $(...) there), so its
  # only child is the one nsenter forks into the pid namespace: the component.
  setsid nsenter -t "$holder" -m -n -p -- "$@" </dev/null >>"$logs/$name.log" 2>&1 &
  local outer=$! child=""
  for _ in $(seq 100); do
    child=$(cat "/proc/$outer/task/$outer/children" 2>/dev/null) || true
    child=${child%% *}
    [ -n "$child" ] && break
    kill -0 "$outer" 2>/dev/null || break
    sleep 0.01
  done
  echo "${child:-$outer}" >"$run/$name.pid"
}

# Waits until `check` succeeds; a component that exited or a timeout fails with its log tail.
wait_for() { # name seconds check...
  local name=$1 secs=$2
  shift 2
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    if ! component_alive "$name"; then
      tail_log "$name"
      return_fail "$name exited during start"
    fi
    if [ $SECONDS -ge $deadline ]; then
      tail_log "$name"
      return_fail "$name not ready after ${secs}s"
    fi
    sleep 0.2
  done
}
# A failed start tears down what was started, then exits.
return_fail() {
  log "error: $*; stopping what was started"
  cmd_stop >/dev/null 2>&1 || true
  exit 1
}

stop_component() { # name: TERM, then KILL after 10 s; only a process of this node
  local pid
  pid=$(component_pid "$1")
  if ! in_node "$pid" || ! kill -TERM "$pid" 2>/dev/null; then rm -f "$run/$1.pid"; return 0; fi
  for _ in $(seq 100); do
    in_node "$pid" || break
    sleep 0.1
  done
  ! in_node "$pid" || kill -KILL "$pid" 2>/dev/null || true
  rm -f "$run/$1.pid"
}

kubectl_in() { ensure_bins; inside_here env KUBECONFIG="$node_pki/admin.kubeconfig" "$k8s_bin/kubectl" "$@"; }

start_etcd() {
  start_component etcd "$testenv_bin/etcd" --data-dir="$dir/etcd" \
    --listen-client-urls=http://127.0.0.1:2379 --advertise-client-urls=http://127.0.0.1:2379 \
    --listen-peer-urls=http://127.0.0.1:2380 --initial-advertise-peer-urls=http://127.0.0.1:2380 \
    --initial-cluster=default=http://127.0.0.1:2380 --unsafe-no-fsync
}
start_kube_apiserver() {
  start_component kube-apiserver "$k8s_bin/kube-apiserver" \
    --etcd-servers=http://127.0.0.1:2379 --bind-address=0.0.0.0 --advertise-address="$node_ip" \
    --secure-port="$api_port" --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
    --client-ca-file="$pki/ca.crt" --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
    --kubelet-client-certificate="$pki/apiserver-kubelet-client.crt" \
    --kubelet-client-key="$pki/apiserver-kubelet-client.key" \
    --kubelet-certificate-authority="$pki/ca.crt" --kubelet-preferred-address-types=InternalIP \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$pki/sa.pub" --service-account-signing-key-file="$pki/sa.key" \
    --service-cluster-ip-range="$service_cidr" --allow-privileged=true --enable-priority-and-fairness=false
}
wait_kube_apiserver() { wait_for kube-apiserver 90 kubectl_in get --raw /readyz; }
start_kube_controller_manager() {
  local kc="$pki/controller-manager.kubeconfig"
  start_component kube-controller-manager "$k8s_bin/kube-controller-manager" --kubeconfig="$kc" \
    --authentication-kubeconfig="$kc" --authorization-kubeconfig="$kc" --bind-address=127.0.0.1 \
    --leader-elect=false --use-service-account-credentials=true \
    --service-account-private-key-file="$pki/sa.key" --root-ca-file="$pki/ca.crt" \
    --cluster-signing-cert-file="$pki/ca.crt" --cluster-signing-key-file="$pki/ca.key" \
    --flex-volume-plugin-dir="$dir/volume-plugins" --cert-dir="$run/controller-manager-certs"
}
# The controller-manager is working once it made the default namespace's service account.
wait_kube_controller_manager() { wait_for kube-controller-manager 60 kubectl_in -n default get serviceaccount default; }
start_kube_scheduler() {
  local kc="$pki/scheduler.kubeconfig"
  start_component kube-scheduler "$k8s_bin/kube-scheduler" --kubeconfig="$kc" \
    --authentication-kubeconfig="$kc" --authorization-kubeconfig="$kc" --bind-address=127.0.0.1 \
    --leader-elect=false
}
wait_kube_scheduler() { wait_for kube-scheduler 60 grep -q "Starting Kubernetes Scheduler" "$logs/kube-scheduler.log"; }
start_kubelet() {
  start_component kubelet "$k8s_bin/kubelet" --config="$node_dir/kubelet/config.yaml" \
    --kubeconfig="$node_pki/kubelet.kubeconfig" --root-dir="$node_dir/kubelet" \
    --hostname-override="$node_name" --node-ip="$node_ip"
}
wait_kubelet() { wait_for kubelet 90 kubectl_in wait --for=condition=Ready "node/$node_name" --timeout=1s; }
apply_addons() {
  kubectl_in apply -f "$dir/addons.yaml" >"$logs/addons.log" 2>&1 || {
    tail_log addons
    return_fail "the node's addons (CoreDNS RBAC, the kube-dns Service) were not accepted"
  }
}
start_kube_proxy() {
  start_component kube-proxy "$k8s_bin/kube-proxy" --config="$node_dir/kube-proxy/config.yaml"
}
# Services are programmed once the cluster DNS Service has its rule.
wait_kube_proxy() {
  wait_for kube-proxy 60 inside sh -c "iptables -w -t nat -S KUBE-SERVICES | grep -q -- '-d $dns_ip/32'"
}
start_coredns() {
  start_component coredns "$coredns_bin/coredns" -conf "$dir/coredns/Corefile"
}
# The whole path a pod's lookup takes: 10.96.0.10 → kube-proxy's DNAT → CoreDNS → the API.
wait_coredns() {
  wait_for coredns 60 inside busybox nslookup kubernetes.default.svc.cluster.local "$dns_ip"
}

# shellcheck shell=bash disable=SC2154,SC2034 # state shared by scripts/real-node and its files
# What the node runs: the Go-built binaries (built and cached on first use) and the machine's
# tools it needs. Sourced by scripts/real-node.

# Directories of the Go-built binaries (kubelet & co., etcd & kube-apiserver, CoreDNS), built and
# cached on first use: a cold build takes many minutes, so `up` does it before starting anything.
k8s_bin="" testenv_bin="" coredns_bin="" flannel_bin=""
ensure_bins() {
  [ -n "$k8s_bin" ] && return
  local out=${TMPDIR:-/tmp}/real-node-build.$$.log
  k8s_bin=$("$repo/tools/k8s-node/build.sh" "$k8s" 2>"$out" | tail -n 1) || {
    tail -n 20 "$out" >&2
    fail "building the node binaries failed (tools/k8s-node/build.sh)"
  }
  testenv_bin=$("$repo/tools/k8s-testenv/build.sh" 2>"$out" | tail -n 1) || {
    tail -n 20 "$out" >&2
    fail "building etcd/kube-apiserver failed (tools/k8s-testenv/build.sh)"
  }
  coredns_bin=$("$repo/tools/coredns/build.sh" 2>"$out" | tail -n 1) || {
    tail -n 20 "$out" >&2
    fail "building CoreDNS failed (tools/coredns/build.sh)"
  }
  [ "$primary" != flannel ] || flannel_bin=$("$repo/tools/flannel/build.sh" 2>"$out" | tail -n 1) || {
    tail -n 20 "$out" >&2
    fail "building flannel failed (tools/flannel/build.sh)"
  }
  rm -f "$out"
}

require_tools() {
  [ "$(id -u)" = 0 ] || fail "must run as root (namespaces, mounts, cgroups)"
  local t missing=()
  for t in $runtime_tools catatonit busybox openssl unshare nsenter \
    setsid ip mount sha256sum go iptables iptables-restore iptables-save; do
    command -v "$t" >/dev/null || missing+=("$t")
  done
  for t in $primary_plugins; do
    [ -x "$debian_cni/$t" ] || missing+=("$debian_cni/$t")
  done
  [ ${#missing[@]} = 0 ] ||
    fail "missing tools: ${missing[*]} (scripts/setup installs containerd runc crun catatonit busybox-static containernetworking-plugins openssl iptables)"
  grep -qw overlay /proc/filesystems || fail "the kernel has no overlay filesystem"
}

# shellcheck shell=bash disable=SC2154,SC2034 # state shared by scripts/real-node and its files
# The node's view of the machine (overlays, /run, sysctls, its NIC) and its pods' cgroups.
# Sourced by scripts/real-node.

# The node's view of the machine, set up by the namespace holder (`_holder`) before anything runs.
node_fs_setup() {
  local d dir=$node_dir
  # unshare made every mount private, so nothing below reaches the machine. Shared again, inside
  # this namespace only (its peer groups are new): as on a systemd host, mounts made later (pod
  # netns, kubelet volumes) reach containers that mount their parent HostToContainer.
  mount --make-rshared /
  for d in etc opt var/lib; do
    mkdir -p "$dir/overlay/$d/upper" "$dir/overlay/$d/work"
    mount -t overlay overlay -o "lowerdir=/$d,upperdir=$dir/overlay/$d/upper,workdir=$dir/overlay/$d/work" "/$d"
  done
  mount -t tmpfs -o mode=0755 tmpfs /run
  runtime_fs_setup
  mkdir -p /run/netns /run/lock
  mount --bind "$dir/var-log" /var/log
  # kubelet sets these (kernel-wide, not per namespace) when they differ from its defaults: it
  # finds its values in files bound over them and never writes the machine's.
  local kv
  for kv in vm/overcommit_memory=1 vm/panic_on_oom=0 kernel/panic=10 kernel/panic_on_oops=1 \
    kernel/keys/root_maxkeys=1000000 kernel/keys/root_maxbytes=25000000; do
    local f=${kv%%=*} v=${kv#*=}
    echo "$v" >"$dir/sysctl/${f//\//.}"
    mount --bind "$dir/sysctl/${f//\//.}" "/proc/sys/$f"
  done
  mkdir -p /opt/cni/bin /etc/cni/net.d
  for d in $primary_plugins; do cp "$debian_cni/$d" /opt/cni/bin/; done
  [ -e "$primary_conflist" ] || primary_conflist_text >"$primary_conflist"
  ip link set lo up
  # A worker's "NIC" is its end of the link to node 1, made from outside (link_worker).
  [ "$node" = 1 ] || return 0
  # The node's "NIC": one end of a veth pair (both ends stay inside; the kernel here has no dummy
  # links) with the node IP (kubelet refuses a loopback node IP) and the kubernetes Service IP,
  # so in-cluster clients reach the API server with no kube-proxy.
  ip link add eth0 type veth peer name uplink0
  ip link set uplink0 up
  ip addr add "$node_ip/24" dev eth0
  ip addr add "$service_ip/32" dev eth0
  ip link set eth0 up
  ip route add default dev eth0
}

cgroup_hierarchies() {
  local h
  for h in /sys/fs/cgroup/*/; do
    [ -e "$h/cgroup.procs" ] && [ ! -e "$h/cgroup.controllers" ] && echo "${h%/}"
  done
}
make_cgroups() {
  local h p part
  for h in $(cgroup_hierarchies); do
    p=$h
    for part in ${cgroup_root//\// }; do
      local parent=$p
      p="$p/$part"
      mkdir -p "$p"
      # A new cpuset cgroup starts with no CPUs and no memory nodes: inherit the parent's.
      if [ -e "$p/cpuset.cpus" ] && [ -z "$(cat "$p/cpuset.cpus")" ]; then
        cat "$parent/cpuset.cpus" >"$p/cpuset.cpus"
        cat "$parent/cpuset.mems" >"$p/cpuset.mems"
      fi
    done
  done
  # A node is a machine: its pods share the CPU by their requests, as kubepods does on a node.
  # Left at the default weight, the whole tree would weigh as much as one process of the test
  # runner, and on a loaded machine ztunnel and the agent (10m requests) would starve for seconds
  # (the agent then drops a ztunnel whose hello is 5 s late, and every ambient ADD fails closed).
  for h in $(cgroup_hierarchies); do
    p="$h${cgroup_root%/*}"
    if [ -e "$p/cpu.shares" ]; then echo 262144 >"$p/cpu.shares"; fi
  done
}
remove_cgroups() {
  local h d
  # Also the unified (v2) hierarchy of a hybrid machine, where runc makes the pods' cgroups too
  # (empty once the node's processes are gone); left there, every node ever run left its own.
  for h in $(cgroup_hierarchies) /sys/fs/cgroup/unified; do
    [ -d "$h$cgroup_root" ] || continue
    find "$h$cgroup_root" -depth -type d 2>/dev/null | while read -r d; do rmdir "$d" 2>/dev/null || true; done
    rmdir "$(dirname "$h$cgroup_root")" 2>/dev/null || true
  done
}

# shellcheck shell=bash disable=SC2154,SC2034 # state shared by scripts/real-node and its files
# The container runtime kubelet talks to (REAL_NODE_RUNTIME): the one place that picks it. A
# runtime's file defines runtime_binary (the OCI runtime), runtime_tools (what require_tools
# checks), runtime_component (its process's name: its log, `restart`, `stop`), runtime_layout (sets
# $sock, the selected node's CRI socket), write_runtime_config, start_/wait_<runtime_component>,
# runtime_fs_setup (in the node's namespaces, before anything runs), import_runtime_images (the
# OCI archives of a directory into the selected node's image store) and runtime_versions.
# Sourced by scripts/real-node once the cell is known.

case $runtime in
  runc | crun)
    # shellcheck source=scripts/lib/real-node/runtime-containerd.sh
    source "$lib/runtime-containerd.sh" ;;
  crio)
    # shellcheck source=scripts/lib/real-node/runtime-crio.sh
    source "$lib/runtime-crio.sh" ;;
  *) fail "REAL_NODE_RUNTIME=$runtime: not one of runc, crun, crio" ;;
esac

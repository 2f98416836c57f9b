#!/bin/sh
# CRI-O's OCI runtime on the real node: runc, with a negative oomScoreAdj in the container's (or
# an exec'd process's) spec raised to this process's own score first, as containerd's
# restrict_oom_score_adj does. Lowering a score below the parent's needs CAP_SYS_RESOURCE, which
# the machine's processes lack, and kubelet asks -997 for system-node-critical pods (the agent's).
own=$(cat /proc/self/oom_score_adj)
prev=""
for arg in "$@"; do
  case $prev in --bundle) spec=$arg/config.json ;; --process) spec=$arg ;; *) spec="" ;; esac
  if [ -n "$spec" ] && [ -f "$spec" ] && [ "$own" -ge 0 ]; then
    sed -i -E "s/(\"oomScoreAdj\": *)-[0-9]+/\1$own/" "$spec"
  fi
  prev=$arg
done
# shellcheck disable=SC2154 # a placeholder of the template, the runtime's path once rendered
exec "${runtime_path}" "$@"

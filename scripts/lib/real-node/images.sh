# shellcheck shell=bash disable=SC2154,SC2034 # state shared by scripts/real-node and its files
# Images into the nodes' runtime (`up --images DIR`). Sourced by scripts/real-node.

import_images() { # dir
  local images=$1
  import_runtime_images "$images" >&2 || return_fail "importing images from $images failed"
}
# The images into every node's runtime at once (one import per node, in parallel).
import_images_all() { # dir count
  local images=$1 count=$2 k pids=() failed=""
  [ "$count" = 1 ] && { import_images "$images"; return; }
  for k in $(seq "$count"); do
    (select_node "$k"; import_runtime_images "$images" >"$logs/images.log" 2>&1) &
    pids+=($!)
  done
  for k in $(seq "$count"); do
    wait "${pids[$((k - 1))]}" || failed+=" $k"
  done
  for k in $failed; do (select_node "$k"; tail_log images); done
  [ -z "$failed" ] || return_fail "importing images from $images failed on node(s)$failed"
}

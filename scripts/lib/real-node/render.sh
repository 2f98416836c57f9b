# shellcheck shell=bash disable=SC2154,SC2034 # state shared by scripts/real-node and its files
# The node's configuration files are templates (templates/): `${name}` in one stands for the
# value of the shell variable `name` where it is rendered (the selected node's, the cell's).
# Sourced by scripts/real-node.

render() { # template: prints templates/<template> with every ${name} replaced, left to right
  local file=$lib/templates/$1 rest="" out="" name match
  IFS= read -r -d '' rest <"$file" || [ -n "$rest" ] || fail "template $file is missing or empty"
  # One placeholder at a time, never rescanning what a value brought in.
  while [[ $rest =~ \$\{([A-Za-z_][A-Za-z0-9_]*)\} ]]; do
    match=${BASH_REMATCH[0]} name=${BASH_REMATCH[1]}
    [ -n "${!name+set}" ] || fail "template $file: \${$name} has no value"
    out+=${rest%%"$match"*}${!name}
    rest=${rest#*"$match"}
  done
  printf %s "$out$rest"
}

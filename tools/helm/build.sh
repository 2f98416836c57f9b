#!/usr/bin/env bash
# Builds the helm CLI from its Go module (this directory's go.mod) with the machine's Go toolchain,
# into a cache outside the repo, so scripts/render-manifests works without a system helm.
# Rebuilds only when the pinned version changes. Prints the binary's path on its last line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
version=$(awk '/^require helm.sh\/helm\/v3 /{print $3}' "$here/go.mod")
# The Kubernetes version `helm template` assumes without --kube-version (what a chart's
# kubeVersion is checked against): a release build stamps its own, an unstamped one says v1.20.
# Ours says the Kubernetes the tests run (tools/k8s-testenv).
k8s=$(awk '/^require k8s.io\/kubernetes /{print $3}' "$here/../k8s-testenv/apiserver/go.mod")
k8s_minor=${k8s#v1.}
k8s_minor=${k8s_minor%%.*}
[ -n "$k8s_minor" ] || { echo "helm: no k8s.io/kubernetes version in tools/k8s-testenv/apiserver/go.mod" >&2; exit 1; }
cache="${HELM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/istio-cni-rs/helm}/${version}-k8s1.${k8s_minor}"
mkdir -p "$cache"
export GOFLAGS=-mod=mod CGO_ENABLED=0
# One build at a time: scripts/test builds the tools in the background while its steps and
# tests call this for the path; a caller waits here for a build under way instead of racing it.
exec 9>"$cache.lock"
flock 9

if [ -x "$cache/helm" ]; then
  echo "helm: cached at $cache/helm" >&2
else
  echo "helm: building helm $version — a few minutes on 2 cores the first time" >&2
  start=$SECONDS
  ldflags="-s -w"
  for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
    ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
  done
  (cd "$here" && go build -trimpath -ldflags="$ldflags" -o "$cache/helm.tmp" helm.sh/helm/v3/cmd/helm)
  mv "$cache/helm.tmp" "$cache/helm"
  echo "helm: built in $((SECONDS - start))s" >&2
fi
echo "$cache/helm"

// The CRI-O release the real node's CRI-O cell runs (scripts/real-node, REAL_NODE_RUNTIME=crio),
// built by build.sh from its own module (its go.mod and go.sum pin every dependency). v1.34.0 is
// the only v1.34 release the Go module proxy serves here (v1.34.1 to v1.34.6 and v1.33.x: 403).
module istio-cni-rs/tools/crio

go 1.24.1

require github.com/cri-o/cri-o v1.34.0

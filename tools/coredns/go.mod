// The cluster DNS of the real node (scripts/real-node): CoreDNS with its kubernetes plugin, built
// from this pin by tools/coredns/build.sh in the module's own directory (its go.mod and go.sum), so
// nothing of CoreDNS is copied here.
module istio-cni-rs/tools/coredns

go 1.26.0

require github.com/coredns/coredns v1.15.0

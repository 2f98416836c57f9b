// The Istio this project matches: its test vectors, charts and binaries are read and built from
// this module in the Go module cache, never copied into the repo. Every use of Istio's Go code
// goes through this one pin.
module istio-cni-rs/tools/istio

go 1.26.0

require istio.io/istio v0.0.0-20260827124520-eed52ebb66ad

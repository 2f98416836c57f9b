// Command etcd is etcd's own server entry point, built from its Go module so the
// integration tests of istio-cni-rs can run a real kube-apiserver without
// downloading release binaries.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}

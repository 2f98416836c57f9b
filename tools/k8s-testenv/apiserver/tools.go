//go:build tools

// Package tools pins the Kubernetes commands built from this module (the API server for the
// integration tests, the node components and kubectl for the real node) so `go mod tidy` keeps
// their dependencies.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)

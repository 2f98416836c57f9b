//go:build tools

// Package tools pins CNCF distribution's registry command so `go mod tidy` keeps its dependencies.
package tools

import _ "github.com/distribution/distribution/v3/cmd/registry"

//go:build tools

// Package tools pins Anchore's syft command so `go mod tidy` keeps its dependencies.
package tools

import _ "github.com/anchore/syft/cmd/syft"

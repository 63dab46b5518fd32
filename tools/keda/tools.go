//go:build tools

// Package tools pins the commands this module builds: KEDA's operator and its metrics API server.
package tools

import (
	_ "github.com/kedacore/keda/v2/cmd/adapter"
	_ "github.com/kedacore/keda/v2/cmd/operator"
)

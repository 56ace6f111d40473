//go:build !amd64 && !arm64

package shmipc

// cpuRelax is a no-op where there is no spin-wait hint.
func cpuRelax() {}

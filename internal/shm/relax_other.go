//go:build !amd64 && !arm64

package shm

// CPURelax is a no-op where there is no spin-wait hint.
func CPURelax() {}

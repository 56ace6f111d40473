//go:build amd64 || arm64

package shm

// CPURelax tells the CPU that this is a spin-wait loop (PAUSE on x86-64,
// YIELD on arm64): it saves power and lets a sibling hyperthread run,
// without giving up the thread as runtime.Gosched does (see yieldEvery).
//
//go:noescape
func CPURelax()

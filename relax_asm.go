//go:build amd64 || arm64

package shmipc

// cpuRelax tells the CPU that this is a spin-wait loop (PAUSE on x86-64,
// YIELD on arm64): it saves power and lets a sibling hyperthread run,
// without giving up the thread the way runtime.Gosched does (which also
// wakes another thread to look for work, so that a spinning process would
// keep every core busy).
//
//go:noescape
func cpuRelax()

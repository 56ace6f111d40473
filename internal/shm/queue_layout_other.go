//go:build !arm64

package shm

// Queue header field offsets on x86-64 (docs/protocol.md §7.2). The 64-bit
// counters are only 4-byte aligned, which LOCK-prefixed instructions allow.
const (
	queueCapOff  = 0
	queueHeadOff = 4
	queueTailOff = 12
	queueFlagOff = 20
)

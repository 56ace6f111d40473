package shm

// Queue header field offsets on arm64 (docs/protocol.md §7.2), where the 64-bit
// counters must be 8-byte aligned.
const (
	queueCapOff  = 0
	queueFlagOff = 4
	queueHeadOff = 8
	queueTailOff = 16
)

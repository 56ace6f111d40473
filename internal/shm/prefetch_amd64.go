package shm

import "unsafe"

// prefetchMax bounds how much of a slice is prefetched: a few times the
// number of lines a core fetches at once, beyond which prefetches queue up
// or are dropped.
const prefetchMax = 16 << 10

// prefetchLinesW asks the CPU to fetch the cache lines of the n bytes at p
// for writing (PREFETCHW): owned by this core, other cores' copies
// invalidated. It never faults, so it is safe on shared memory a peer may
// have truncated.
//
//go:noescape
func prefetchLinesW(p unsafe.Pointer, n uintptr)

// PrefetchForWrite starts taking the first prefetchMax bytes of p for
// writing, without waiting for them: a slice kept for the next message was written by
// the peer on another core, and its lines are fetched while the stream
// waits for its peer rather than when the next message is copied in.
func PrefetchForWrite(p []byte) {
	if len(p) > 0 {
		prefetchLinesW(unsafe.Pointer(&p[0]), uintptr(min(len(p), prefetchMax)))
	}
}

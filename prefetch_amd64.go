package shmipc

import "unsafe"

// prefetchLinesW asks the CPU to fetch the cache lines of the n bytes at p
// for writing (PREFETCHW): owned by this core, other cores' copies
// invalidated. It never faults, so it is safe on shared memory a peer may
// have truncated.
//
//go:noescape
func prefetchLinesW(p unsafe.Pointer, n uintptr)

// prefetchForWrite starts taking the first prefetchMax bytes of p for
// writing, without waiting for them.
func prefetchForWrite(p []byte) {
	if len(p) > 0 {
		prefetchLinesW(unsafe.Pointer(&p[0]), uintptr(min(len(p), prefetchMax)))
	}
}

package shmipcgrpc

import (
	"math/bits"
	"sync"

	"google.golang.org/grpc/mem"
)

// dirtyPool is a gRPC buffer pool (mem.BufferPool) that hands out buffers
// as they were last used, without clearing them. gRPC's default pool zeroes
// every buffer it hands out; gRPC then fills each one completely (a frame's
// payload read from the connection, a marshalled message) before anyone
// reads it, so the zeroing only costs time: at 1 MiB, about a tenth of a
// call's CPU. What a buffer held last stays in the process.
//
// Buffers are kept in size classes of powers of two, from 256 B to 16 MiB;
// larger ones are allocated for each use.
type dirtyPool struct {
	classes [maxPoolShift + 1]sync.Pool
}

const (
	minPoolShift = 8
	maxPoolShift = 24
)

var _ mem.BufferPool = (*dirtyPool)(nil)

// poolClass is the size class of a buffer of n bytes: the smallest power of
// two that holds n, at least 1<<minPoolShift.
func poolClass(n int) int {
	return max(bits.Len(uint(n-1)), minPoolShift)
}

// Get returns a buffer of length n, whose contents are unspecified.
func (p *dirtyPool) Get(n int) *[]byte {
	if n <= 0 || n > 1<<maxPoolShift {
		b := make([]byte, max(n, 0))
		return &b
	}
	c := poolClass(n)
	if b, ok := p.classes[c].Get().(*[]byte); ok {
		*b = (*b)[:n]
		return b
	}
	b := make([]byte, n, 1<<c)
	return &b
}

// Put returns a buffer that Get handed out (or a prefix of it) for reuse.
func (p *dirtyPool) Put(b *[]byte) {
	c := cap(*b)
	if c < 1<<minPoolShift || c > 1<<maxPoolShift || c&(c-1) != 0 {
		return // not one of ours
	}
	*b = (*b)[:0]
	p.classes[bits.Len(uint(c-1))].Put(b)
}

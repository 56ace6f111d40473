package shmipc

// Regions in Go memory, for unit tests of the buffer manager and the IO
// queue: the layouts a real mapping holds, without a file or a session.

import (
	"testing"
	"unsafe"
)

// alignedBytes returns a zeroed, 8-byte aligned byte slice of n bytes
// (rounded up to a multiple of 8), so that atomics on offsets that are
// multiples of 4 are aligned as in a real mapping.
func alignedBytes(n int) []byte {
	words := max((n+7)/8, 1)
	backing := make([]uint64, words)
	return unsafe.Slice((*byte)(unsafe.Pointer(&backing[0])), words*8)
}

// heapRegion wraps Go memory in a region. It must never be released: that
// would munmap Go heap memory.
func heapRegion(mem []byte) *region {
	r := &region{mem: mem, path: "heap"}
	r.refs.Store(1)
	return r
}

// newHeapBuffer lays out a buffer region of plans in Go memory and returns
// the creator's manager and a second manager of the same memory, the view
// of the process that mapped it.
func newHeapBuffer(t *testing.T, plans ...listPlan) (creator, mapper *bufferManager) {
	t.Helper()
	mem := alignedBytes(int(bufferRegionSize(plans)))
	initBufferRegion(mem, plans)
	var err error
	if creator, err = newBufferManager(heapRegion(mem), true); err != nil {
		t.Fatalf("newBufferManager(creator): %v", err)
	}
	if mapper, err = newBufferManager(heapRegion(mem), false); err != nil {
		t.Fatalf("newBufferManager(mapper): %v", err)
	}
	return creator, mapper
}

// newHeapQueues lays out a queue region of two halves of capacity cap in Go
// memory and maps it twice, as the two processes of a session do. Each
// side's queues are in region order: client-to-server, server-to-client.
func newHeapQueues(t *testing.T, cap uint32) (mem []byte, client, server [2]*ioQueue) {
	t.Helper()
	mem = alignedBytes(queueRegionSize(cap))
	initQueueRegion(mem, cap)
	for _, side := range []*[2]*ioQueue{&client, &server} {
		c2s, s2c, err := mapQueues(mem)
		if err != nil {
			t.Fatalf("mapQueues: %v", err)
		}
		*side = [2]*ioQueue{c2s, s2c}
	}
	return mem, client, server
}

package shm

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

// newHeapBuffer lays out a buffer region of plans in Go memory and returns
// the creator's manager and a second manager of the same memory, the view
// of the process that mapped it.
func newHeapBuffer(t *testing.T, plans ...ListPlan) (creator, mapper *Buffer) {
	t.Helper()
	mem := alignedBytes(int(bufferRegionSize(plans)))
	InitBuffer(mem, plans)
	var err error
	if creator, err = NewBuffer(RegionOf(mem), true); err != nil {
		t.Fatalf("newBufferManager(creator): %v", err)
	}
	if mapper, err = NewBuffer(RegionOf(mem), false); err != nil {
		t.Fatalf("newBufferManager(mapper): %v", err)
	}
	return creator, mapper
}

// newHeapQueues lays out a queue region of two halves of capacity cap in Go
// memory and maps it twice, as the two processes of a session do. Each
// side's queues are in region order: client-to-server, server-to-client.
func newHeapQueues(t *testing.T, cap uint32) (mem []byte, client, server [2]*Queue) {
	t.Helper()
	mem = alignedBytes(QueueRegionSize(cap))
	InitQueues(mem, cap)
	for _, side := range []*[2]*Queue{&client, &server} {
		c2s, s2c, err := MapQueues(mem)
		if err != nil {
			t.Fatalf("mapQueues: %v", err)
		}
		*side = [2]*Queue{c2s, s2c}
	}
	return mem, client, server
}

// fzValidQueue is a valid queue region of capacity cap, in Go memory.
func fzValidQueue(cap uint32) []byte {
	mem := make([]byte, QueueRegionSize(cap))
	InitQueues(mem, cap)
	return mem
}

// bufferRegionSize is the space a region of plans occupies.
func bufferRegionSize(plans []ListPlan) uint64 {
	n := uint64(BufferHeaderSize)
	for _, p := range plans {
		n += ListHeaderSize + uint64(p.Count)*(uint64(p.SliceCap)+SliceHeaderSize)
	}
	return n
}

// maxSliceCap is the data capacity of the largest slice.
func (m *Buffer) maxSliceCap() uint32 {
	return m.lists[m.bySize[len(m.bySize)-1]].sliceCap
}

// pop removes the oldest element of q. It reports false when q is empty.
func (q *Queue) pop() (Elem, bool, error) {
	e, ok, err := q.Peek()
	if ok {
		q.Skip()
	}
	return e, ok, err
}

// end is the offset just past the last slice of l.
func (l *sliceList) end() uint32 { return l.area + l.count*l.stride }

// freeCounts returns the free slices of each list: those on the free list
// and those this process has parked (circulation.go).
func (m *Buffer) freeCounts() []int32 {
	var free []int32
	for _, l := range m.Lists() {
		free = append(free, l.Free)
	}
	return free
}

// fzScript reads an op script; once exhausted it yields zeros.
type fzScript struct{ b []byte }

func (s *fzScript) done() bool { return len(s.b) == 0 }

func (s *fzScript) u8() byte {
	if len(s.b) == 0 {
		return 0
	}
	v := s.b[0]
	s.b = s.b[1:]
	return v
}

func (s *fzScript) u16() uint16 { return uint16(s.u8()) | uint16(s.u8())<<8 }

func (s *fzScript) u32() uint32 { return uint32(s.u16()) | uint32(s.u16())<<16 }

func (s *fzScript) u64() uint64 { return uint64(s.u32()) | uint64(s.u32())<<32 }

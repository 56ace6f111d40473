package shmipc

import (
	"runtime"

	"github.com/goshm/shmipc/internal/shm"
)

// Library helpers that only tests use.

// createRegion is shm.CreateRegion with permissions 0o600.
func createRegion(mode MemMapType, path string, size int) (*shm.Region, int, error) {
	return shm.CreateRegion(mode == MemMapTypeMemFd, path, size, 0o600)
}

// bufferRegionSize is the space a region of plans occupies.
func bufferRegionSize(plans []shm.ListPlan) uint64 {
	n := uint64(shm.BufferHeaderSize)
	for _, p := range plans {
		n += shm.ListHeaderSize + uint64(p.Count)*(uint64(p.SliceCap)+shm.SliceHeaderSize)
	}
	return n
}

// Offsets in the shared-memory layouts (docs/protocol.md §6, §7), as a peer
// writing raw bytes sees them, and the name memfds are given before the
// region path.
const (
	listFreeOff, listCountOff, listHeadOff, listTailOff, listCapOff         = 0, 4, 8, 12, 16
	sliceCapOff, sliceSizeOff, sliceStartOff, sliceNextOff, sliceFlagsOff   = 0, 4, 8, 12, 16
	flagHasNext, flagInUse                                                  = 0x01, 0x02
	queueHeaderSize, queueElemSize, elemIDOff, elemOffsetOff, elemStatusOff = 24, 12, 0, 4, 8
	queueCapOff                                                             = 0
	memfdNamePrefix                                                         = "shmipc"
)

// The queue header's other fields: on arm64 its 64-bit counters are 8-byte
// aligned.
var queueHeadOff, queueTailOff, queueFlagOff = func() (int, int, int) {
	if runtime.GOARCH == "arm64" {
		return 8, 16, 4
	}
	return 4, 12, 20
}()

// refCount is 1 while r is referenced and 0 once it has been released.
func refCount(r *shm.Region) int32 {
	if !r.Acquire() {
		return 0
	}
	r.Release()
	return 1
}

// maxSliceCap is the data capacity of the largest slice of m that can be
// handed out (a list keeps its last slice).
func maxSliceCap(m *shm.Buffer) int {
	most := 0
	for _, l := range m.Lists() {
		if l.Count >= 2 {
			most = max(most, int(l.SliceCap))
		}
	}
	return most
}

// freeCounts returns the free slices of each list of m: those on the free
// list and those this process has parked.
func freeCounts(m *shm.Buffer) []int32 {
	var free []int32
	for _, l := range m.Lists() {
		free = append(free, l.Free)
	}
	return free
}

// free reports whether enter would find a slot now.
func (g *spinGovernor) free() bool {
	return g.active.Load() < g.slots.Load() && g.offUntil.Load() == 0
}

// failure is why this side ended the stream (fail), or nil.
func (st *Stream) failure() error {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.failErr
}

package shmipc

import (
	"encoding/binary"
	"fmt"
	"sort"
	"sync/atomic"
	"unsafe"
)

// Buffer region layout (docs/protocol.md §6). All integers are little-endian.
const (
	managerHeaderSize = 8 // u16 list count, u16 reserved, u32 used
	listHeaderSize    = 36
	sliceHeaderSize   = 20

	// list header fields
	listFreeOff    = 0  // i32, atomic
	listCountOff   = 4  // u32
	listHeadOff    = 8  // u32 relative offset, atomic
	listTailOff    = 12 // u32 relative offset, atomic
	listCapOff     = 16 // u32
	creatorCounter = 20 // i32 the creator adds to on pop, subtracts on push
	mapperCounter  = 24 // i32 the same for the mapper

	// slice header fields
	sliceCapOff   = 0
	sliceSizeOff  = 4
	sliceStartOff = 8
	sliceNextOff  = 12
	sliceFlagsOff = 16

	flagHasNext = 0x01
	flagInUse   = 0x02

	// maxReserve is how many free slices a list keeps for writers that
	// hold slices (bufferManager.alloc): min(maxReserve, count/4). It
	// is about liveness, not room: one slice lets an answer go out and free
	// its request.
	maxReserve = 2

	// maxSplitPieces bounds how finely alloc splits a message. Unbounded, a
	// large message takes the slices small messages live on, and its writer
	// holds part of it while it waits for the rest.
	maxSplitPieces = 8

	// popAttempts bounds the retries of one pop (docs/protocol.md §6.8).
	popAttempts = 200
	// pushAttempts bounds the retries of one push. The protocol sets no
	// limit; a peer that keeps the tail moving this long is broken.
	pushAttempts = 1 << 20
)

// sliceList is the local, validated description of one list of the region.
// Fields read from shared memory at mapping time are never read again.
type sliceList struct {
	header   uint32 // offset of the list header
	area     uint32 // offset of the first slice header
	stride   uint32 // sliceCap + sliceHeaderSize
	sliceCap uint32
	count    uint32
	first    uint32 // the index of its first slice among all the region's (held)
	reserve  int32  // free slices left for writers that hold slices (alloc)
	// keepLimit is how many streams of this process may keep a slice of
	// the list (0: none; reuse.go).
	keepLimit int32
}

// validRelative reports whether rel is the relative offset of a slice of l.
func (l *sliceList) validRelative(rel uint32) bool {
	return rel%l.stride == 0 && rel/l.stride < l.count
}

// bufferManager allocates and frees slices of one buffer region. It is safe
// for concurrent use, within and across processes: the free lists are
// lock-free, as the protocol requires.
type bufferManager struct {
	region   *region
	mem      []byte
	lists    []sliceList // in region order, which is ascending offset
	bySize   []int       // indexes into lists, ascending sliceCap
	slices   uint32      // total slices in all lists: the longest possible chain
	capacity uint64      // data bytes of all slices that can be handed out
	// splitCapacity is what a message larger than the largest slice can
	// have of the region when it is empty: the slices of an eighth of
	// usable or more (maxSplitPieces), less the reserves (alloc, roomFor).
	splitCapacity uint64
	usable        uint32       // the largest slice size that can be handed out
	counter       uint32       // offset of our counter word in a list header
	sessions      atomic.Int32 // sessions of this process using the region
	circ          *circulation // slices taken out of circulation (creator only)

	// held has a bit per slice of the region, set from readChain until the
	// slice is pushed back or a writer of this process takes it (reuse.go).
	// A correct peer cannot publish a slice whose bit is set, as it cannot
	// allocate one this process has not freed; unchecked, one slice could be
	// delivered (and freed) any number of times. Neighbouring slices are on
	// different cache lines (heldBit), as different processors hold them.
	held      []atomic.Uint64
	heldShift uint // log2 of the number of cache lines of held

	space spaceQueues // this process's writers waiting for room, in turn (space_queue.go)

	keepers []atomic.Int32 // per list, streams of this process that may keep a slice of it (reuse.go)
}

// initBufferRegion lays out a new region as docs/protocol.md §6.5 says. mem must
// be zero-filled: the fields that start at zero are not written.
func initBufferRegion(mem []byte, plans []listPlan) {
	binary.LittleEndian.PutUint16(mem[0:], uint16(len(plans)))
	cur := uint32(managerHeaderSize)
	for _, p := range plans {
		stride := p.sliceCap + sliceHeaderSize
		h := mem[cur:]
		binary.LittleEndian.PutUint32(h[listFreeOff:], p.count)
		binary.LittleEndian.PutUint32(h[listCountOff:], p.count)
		binary.LittleEndian.PutUint32(h[listTailOff:], (p.count-1)*stride)
		binary.LittleEndian.PutUint32(h[listCapOff:], p.sliceCap)
		area := cur + listHeaderSize
		for k := uint32(0); k < p.count; k++ {
			s := mem[area+k*stride:]
			binary.LittleEndian.PutUint32(s[sliceCapOff:], p.sliceCap)
			if k < p.count-1 {
				binary.LittleEndian.PutUint32(s[sliceNextOff:], (k+1)*stride)
				s[sliceFlagsOff] = flagHasNext
			}
		}
		cur = area + p.count*stride
	}
	binary.LittleEndian.PutUint32(mem[4:], cur-managerHeaderSize)
}

// newBufferManager reads and checks the layout of a mapped buffer region
// (docs/protocol.md §6.6): every list must lie inside the mapping and hold a
// slice, and slice sizes must be distinct non-zero multiples of 4. The
// values are copied; the manager never reads those header fields again.
func newBufferManager(r *region, creator bool) (*bufferManager, error) {
	mem := r.mem
	size := uint64(len(mem))
	if size < managerHeaderSize {
		return nil, fmt.Errorf("buffer region of %d bytes has no header", size)
	}
	n := int(binary.LittleEndian.Uint16(mem[0:]))
	used := uint64(binary.LittleEndian.Uint32(mem[4:]))
	if n == 0 {
		return nil, fmt.Errorf("buffer region has no lists")
	}
	if managerHeaderSize+used > size {
		return nil, fmt.Errorf("buffer region claims %d bytes of lists but is %d bytes long", used, size)
	}
	limit := managerHeaderSize + used
	if uint64(n)*listHeaderSize > used {
		return nil, fmt.Errorf("buffer region claims %d lists in %d bytes", n, used)
	}
	m := &bufferManager{region: r, mem: mem, lists: make([]sliceList, n), bySize: make([]int, n), counter: mapperCounter}
	if creator {
		m.counter = creatorCounter
	}
	cur := uint64(managerHeaderSize)
	var total uint64
	for i := range m.lists {
		if cur+listHeaderSize > limit {
			return nil, fmt.Errorf("list %d header at %d lies outside the %d bytes in use", i, cur, limit)
		}
		count := uint64(binary.LittleEndian.Uint32(mem[cur+listCountOff:]))
		sliceCap := uint64(binary.LittleEndian.Uint32(mem[cur+listCapOff:]))
		if count == 0 {
			return nil, fmt.Errorf("list %d at %d has no slices", i, cur)
		}
		if sliceCap == 0 || sliceCap%4 != 0 {
			return nil, fmt.Errorf("list %d at %d has slice size %d, which is not a positive multiple of 4", i, cur, sliceCap)
		}
		stride := sliceCap + sliceHeaderSize
		end := cur + listHeaderSize + count*stride
		if end > limit {
			return nil, fmt.Errorf("list %d at %d (%d slices of %d bytes) ends at %d, past the %d bytes in use", i, cur, count, sliceCap, end, limit)
		}
		m.lists[i] = sliceList{
			header:   uint32(cur),
			area:     uint32(cur + listHeaderSize),
			stride:   uint32(stride),
			sliceCap: uint32(sliceCap),
			count:    uint32(count),
			first:    uint32(total),
			reserve:  int32(min(count/4, maxReserve)),
		}
		if sliceCap <= keepMaxCap {
			m.lists[i].keepLimit = int32(count / keepShare)
		}
		m.bySize[i] = i
		total += count
		// The last slice of a list is never handed out (docs/protocol.md §6.8).
		m.capacity += (count - 1) * sliceCap
		if count >= 2 {
			m.usable = max(m.usable, uint32(sliceCap))
		}
		cur = end
	}
	m.slices = uint32(total)
	for 512<<m.heldShift < total {
		m.heldShift++
	}
	m.held = make([]atomic.Uint64, 8<<m.heldShift)
	sort.Slice(m.bySize, func(a, b int) bool { return m.lists[m.bySize[a]].sliceCap < m.lists[m.bySize[b]].sliceCap })
	for i := 1; i < n; i++ {
		if m.lists[m.bySize[i-1]].sliceCap == m.lists[m.bySize[i]].sliceCap {
			return nil, fmt.Errorf("two lists have slice size %d", m.lists[m.bySize[i]].sliceCap)
		}
	}
	for _, l := range m.lists {
		if l.sliceCap >= m.usable/maxSplitPieces && int32(l.count)-1 > l.reserve {
			m.splitCapacity += uint64(int32(l.count)-1-l.reserve) * uint64(l.sliceCap)
		}
	}
	m.keepers = make([]atomic.Int32, n)
	m.space.init(n + 1)
	return m, nil
}

func (m *bufferManager) i32(off uint32) *int32 {
	return (*int32)(unsafe.Pointer(&m.mem[off]))
}

// freeCount is list li's free count, which the peer writes too, clamped to
// [0, count] so that arithmetic and loops it bounds stay within the list.
func (m *bufferManager) freeCount(li int) int32 {
	l := &m.lists[li]
	n := shmLoadInt32(m.i32(l.header + listFreeOff))
	return min(max(n, 0), int32(l.count))
}

func (m *bufferManager) u32(off uint32) *uint32 {
	return (*uint32)(unsafe.Pointer(&m.mem[off]))
}

// flags reads the flags byte of the slice header at off, the low byte of a
// 4-byte word whose other bytes are zero (docs/protocol.md §6.4). It and setFlags
// are atomic: a pop that sees HAS_NEXT also sees the next the push stored
// before setting it, on weakly ordered CPUs too.
func (m *bufferManager) flags(off uint32) byte {
	return byte(shmLoadUint32(m.u32(off + sliceFlagsOff)))
}

func (m *bufferManager) setFlags(off uint32, f byte) {
	shmStoreUint32(m.u32(off+sliceFlagsOff), uint32(f))
}

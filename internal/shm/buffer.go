package shm

import (
	"encoding/binary"
	"fmt"
	"sort"
	"sync/atomic"
	"unsafe"
)

// Buffer region layout (docs/protocol.md §6). All integers are little-endian.
const (
	BufferHeaderSize = 8 // u16 list count, u16 reserved, u32 used
	ListHeaderSize   = 36
	SliceHeaderSize  = 20

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

	// maxReserve is how many free slices a list keeps for writers that hold
	// slices (Alloc): min(maxReserve, count/4). It is about liveness, not
	// room: one slice lets an answer go out and free its request.
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

	// keepShare bounds the share of a list whose slices the streams of this
	// process may keep (MayKeep), and keepMaxCap the largest slice they
	// keep: the reference layout's largest class. Larger slices are few,
	// and a stream that kept one would hold a MiB or more between messages.
	keepShare  = 8
	keepMaxCap = 128 << 10
)

// ListPlan is one size class of a region to be created (InitBuffer).
type ListPlan struct {
	SliceCap uint32 // data bytes of each slice
	Count    uint32 // slices of the list
}

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
	// the list (0: none; MayKeep).
	keepLimit int32
}

// validRelative reports whether rel is the relative offset of a slice of l.
func (l *sliceList) validRelative(rel uint32) bool {
	return rel%l.stride == 0 && rel/l.stride < l.count
}

// Buffer allocates and frees slices of one buffer region. It is safe
// for concurrent use, within and across processes: the free lists are
// lock-free, as the protocol requires.
type Buffer struct {
	region   *Region
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

	// held has a bit per slice of the region, set from ReadChain until the
	// slice is pushed back or a writer of this process takes it (Unhold).
	// A correct peer cannot publish a slice whose bit is set, as it cannot
	// allocate one this process has not freed; unchecked, one slice could be
	// delivered (and freed) any number of times. Neighbouring slices are on
	// different cache lines (heldBit), as different processors hold them.
	held      []atomic.Uint64
	heldShift uint // log2 of the number of cache lines of held

	space SpaceQueues // this process's writers waiting for room, in turn (Space)

	keepers []atomic.Int32 // per list, streams of this process that may keep a slice of it (MayKeep)
}

// InitBuffer lays out a new region as docs/protocol.md §6.5 says. mem must
// be zero-filled: the fields that start at zero are not written.
func InitBuffer(mem []byte, plans []ListPlan) {
	binary.LittleEndian.PutUint16(mem[0:], uint16(len(plans)))
	cur := uint32(BufferHeaderSize)
	for _, p := range plans {
		stride := p.SliceCap + SliceHeaderSize
		h := mem[cur:]
		binary.LittleEndian.PutUint32(h[listFreeOff:], p.Count)
		binary.LittleEndian.PutUint32(h[listCountOff:], p.Count)
		binary.LittleEndian.PutUint32(h[listTailOff:], (p.Count-1)*stride)
		binary.LittleEndian.PutUint32(h[listCapOff:], p.SliceCap)
		area := cur + ListHeaderSize
		for k := uint32(0); k < p.Count; k++ {
			s := mem[area+k*stride:]
			binary.LittleEndian.PutUint32(s[sliceCapOff:], p.SliceCap)
			if k < p.Count-1 {
				binary.LittleEndian.PutUint32(s[sliceNextOff:], (k+1)*stride)
				s[sliceFlagsOff] = flagHasNext
			}
		}
		cur = area + p.Count*stride
	}
	binary.LittleEndian.PutUint32(mem[4:], cur-BufferHeaderSize)
}

// NewBuffer reads, checks and copies (sliceList) a mapped buffer region's
// layout (docs/protocol.md §6.6): each list must lie inside the mapping and
// hold a slice, and slice sizes must be distinct non-zero multiples of 4.
func NewBuffer(r *Region, creator bool) (*Buffer, error) {
	mem := r.mem
	size := uint64(len(mem))
	if size < BufferHeaderSize {
		return nil, fmt.Errorf("buffer region of %d bytes has no header", size)
	}
	n := int(binary.LittleEndian.Uint16(mem[0:]))
	used := uint64(binary.LittleEndian.Uint32(mem[4:]))
	if n == 0 {
		return nil, fmt.Errorf("buffer region has no lists")
	}
	if BufferHeaderSize+used > size {
		return nil, fmt.Errorf("buffer region claims %d bytes of lists but is %d bytes long", used, size)
	}
	limit := BufferHeaderSize + used
	if uint64(n)*ListHeaderSize > used {
		return nil, fmt.Errorf("buffer region claims %d lists in %d bytes", n, used)
	}
	m := &Buffer{region: r, mem: mem, lists: make([]sliceList, n), bySize: make([]int, n), counter: mapperCounter}
	if creator {
		m.counter = creatorCounter
	}
	cur := uint64(BufferHeaderSize)
	var total uint64
	for i := range m.lists {
		if cur+ListHeaderSize > limit {
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
		stride := sliceCap + SliceHeaderSize
		end := cur + ListHeaderSize + count*stride
		if end > limit {
			return nil, fmt.Errorf("list %d at %d (%d slices of %d bytes) ends at %d, past the %d bytes in use", i, cur, count, sliceCap, end, limit)
		}
		m.lists[i] = sliceList{
			header:   uint32(cur),
			area:     uint32(cur + ListHeaderSize),
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

func (m *Buffer) i32(off uint32) *int32 {
	return (*int32)(unsafe.Pointer(&m.mem[off]))
}

// freeCount is list li's free count, which the peer writes too, clamped to
// [0, count] so that arithmetic and loops it bounds stay within the list.
func (m *Buffer) freeCount(li int) int32 {
	l := &m.lists[li]
	n := shmLoadInt32(m.i32(l.header + listFreeOff))
	return min(max(n, 0), int32(l.count))
}

func (m *Buffer) u32(off uint32) *uint32 {
	return (*uint32)(unsafe.Pointer(&m.mem[off]))
}

// flags reads the flags byte of the slice header at off, the low byte of a
// 4-byte word whose other bytes are zero (docs/protocol.md §6.4). It and setFlags
// are atomic: a pop that sees HAS_NEXT also sees the next the push stored
// before setting it, on weakly ordered CPUs too.
func (m *Buffer) flags(off uint32) byte {
	return byte(shmLoadUint32(m.u32(off + sliceFlagsOff)))
}

func (m *Buffer) setFlags(off uint32, f byte) {
	shmStoreUint32(m.u32(off+sliceFlagsOff), uint32(f))
}

// CreateBuffer creates a buffer region (CreateRegion) laid out as plans and
// returns its creator's manager, holding one reference, with circulation
// control at periods p. It keeps the descriptor open for peers (Region.Fd).
func CreateBuffer(memfd bool, path string, size int, perm uint32, plans []ListPlan, p Periods) (m *Buffer, err error) {
	r, fd, err := CreateRegion(memfd, path, size, perm)
	if err != nil {
		return nil, err
	}
	defer CloseFds(fd)
	defer func() { // deferred: a fault unwinding from here must not keep the region
		if m == nil {
			r.Release()
		}
	}()
	if err := r.KeepFd(fd); err != nil {
		return nil, err
	}
	InitBuffer(r.mem, plans)
	if m, err = NewBuffer(r, true); err != nil {
		return nil, err
	}
	r.onLastRelease = m.unparkAll
	m.startCirculation(p)
	return m, nil
}

// Region is the mapped region of m.
func (m *Buffer) Region() *Region { return m.region }

// OnLastRelease makes the region's last release run f, after every slice
// this process parked has gone back, before it is unmapped.
func (m *Buffer) OnLastRelease(f func()) {
	m.region.OnLastRelease(func() {
		m.unparkAll()
		f()
	})
}

// AddSession counts the sessions of this process that use the region.
func (m *Buffer) AddSession(delta int32) { m.sessions.Add(delta) }

// Sessions is the number of sessions of this process using the region.
func (m *Buffer) Sessions() int32 { return m.sessions.Load() }

// Space is this process's queues of writers waiting for room.
func (m *Buffer) Space() *SpaceQueues { return &m.space }

// SliceCap is the data capacity of a slice of list li.
func (m *Buffer) SliceCap(li int) int { return int(m.lists[li].sliceCap) }

// NeverFits reports whether a message of size bytes whose next piece is want
// bytes can never come from the region: a contiguous piece larger than any
// slice, a message over half of what the region can hand out, or one larger
// than any slice and over half its splitCapacity.
func (m *Buffer) NeverFits(size uint64, want int, contiguous bool) bool {
	if contiguous {
		return want > int(m.usable) || size > m.capacity/2
	}
	return size > m.capacity/2 || size > uint64(m.usable) && size > m.splitCapacity/2
}

// Keepable reports whether the streams of this process may keep slices of
// list li for their next message (MayKeep).
func (m *Buffer) Keepable(li int32) bool {
	return li >= 0 && int(li) < len(m.lists) && m.lists[li].keepLimit > 0
}

// MayKeep asks for one more stream's permission to keep slices of list li,
// within 1/keepShare of the list, and reports whether it got it; Unkeep
// gives a permission back.
func (m *Buffer) MayKeep(li int) bool {
	if m.keepers[li].Add(1) > m.lists[li].keepLimit {
		m.keepers[li].Add(-1)
		return false
	}
	return true
}

// Unkeep gives back a permission MayKeep granted for list li.
func (m *Buffer) Unkeep(li int) { m.keepers[li].Add(-1) }

// ListState is what Lists says of one list.
type ListState struct {
	SliceCap, Count uint32
	Free            int32 // free slices, parked ones included
	Parked          int32 // of those, the ones this process has parked
}

// Lists returns the state of each list, in region order.
func (m *Buffer) Lists() []ListState {
	ls := make([]ListState, len(m.lists))
	c := m.circ
	if c != nil {
		c.mu.Lock()
		defer c.mu.Unlock()
	}
	for i, l := range m.lists {
		ls[i] = ListState{SliceCap: l.sliceCap, Count: l.count, Free: m.freeCount(i)}
		if c != nil {
			ls[i].Parked = int32(len(c.parked[i]))
			ls[i].Free += ls[i].Parked
		}
	}
	return ls
}

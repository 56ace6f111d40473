package shmipc

import (
	"encoding/binary"
	"fmt"
	"sort"
	"sync/atomic"
	"unsafe"
)

// Buffer region layout (PROTOCOL.md §4). All integers are little-endian.
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
	// hold slices (bufferManager.alloc): 2, or a quarter of a list of fewer
	// than 8 slices. It is about liveness, not room: one slice is enough
	// for an answer to go out and free its request.
	maxReserve = 2

	// maxSplitPieces bounds how finely alloc splits the bytes a writer
	// asks for when the lists that hold them in one slice are empty: into
	// slices of at least 1/maxSplitPieces of them, or of the largest
	// slices when they are larger still. Without the bound a 4 MiB message
	// went into hundreds of 8 KiB slices once the large lists ran short:
	// it took the slices that small messages live on, its writer held a
	// part of it while it waited for the rest (and went over the socket
	// after heldSpaceWait), and its reader copied it out piece by piece.
	// With it, 64 streams echoing 1 or 4 MiB between two processes stay in
	// shared memory, fair, at 2–4 times the round trips per second they
	// had; a writer that finds no slice big enough waits for one.
	maxSplitPieces = 8

	// popAttempts bounds the retries of one pop (PROTOCOL.md §4.8).
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
	// reserve is how many free slices a writer that holds no slice of the
	// region leaves on the list for writers that do (see alloc).
	reserve int32
	// keepLimit is how many streams of this process may keep a slice of
	// the list (0: none; reuse.go).
	keepLimit int32
	// localLimit is how many slices of the list may wait in the manager's
	// local slots (local_slices.go).
	localLimit int32
}

func (l *sliceList) end() uint32 { return l.area + l.count*l.stride }

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

	// held has a bit per slice of the region, set while the slice is in
	// this process's hands as part of a message it received: from readChain
	// until it is pushed back on its free list or a writer of this process
	// takes it for a message of its own (a kept slice, reuse.go). A slice
	// the peer publishes while its bit is set was published twice, or
	// twice in one message: a correct peer publishes only slices it
	// allocated, and it cannot allocate one this process has not freed.
	// Without the check a peer could publish one slice again and again, and
	// every copy was delivered to a stream, which held it until read: heap
	// without bound, and each copy freed once more when read.
	//
	// Slices are spread over the cache lines of held (heldBit), so that
	// neighbouring slices, which the streams on different processors
	// often hold at once, do not make both processors write one line.
	held      []atomic.Uint64
	heldShift uint // log2 of the number of cache lines of held

	space spaceQueues // this process's writers waiting for room, in turn (space_queue.go)

	keepers []atomic.Int32 // per list, streams of this process that may keep a slice of it (reuse.go)

	local        atomic.Pointer[localSlots] // large slices paired streams have read, per processor (local_slices.go)
	localStreams atomic.Int32               // paired streams using the manager, which may fill local
}

// initBufferRegion lays out a new region exactly as PROTOCOL.md §4.5 says.
// mem must be zero-filled.
func initBufferRegion(mem []byte, plans []listPlan) {
	binary.LittleEndian.PutUint16(mem[0:], uint16(len(plans)))
	binary.LittleEndian.PutUint16(mem[2:], 0)
	cur := uint32(managerHeaderSize)
	for _, p := range plans {
		stride := p.sliceCap + sliceHeaderSize
		h := mem[cur:]
		binary.LittleEndian.PutUint32(h[listFreeOff:], p.count)
		binary.LittleEndian.PutUint32(h[listCountOff:], p.count)
		binary.LittleEndian.PutUint32(h[listHeadOff:], 0)
		binary.LittleEndian.PutUint32(h[listTailOff:], (p.count-1)*stride)
		binary.LittleEndian.PutUint32(h[listCapOff:], p.sliceCap)
		clear(h[creatorCounter:listHeaderSize])
		area := cur + listHeaderSize
		for k := uint32(0); k < p.count; k++ {
			s := mem[area+k*stride:]
			binary.LittleEndian.PutUint32(s[sliceCapOff:], p.sliceCap)
			binary.LittleEndian.PutUint32(s[sliceSizeOff:], 0)
			binary.LittleEndian.PutUint32(s[sliceStartOff:], 0)
			if k < p.count-1 {
				binary.LittleEndian.PutUint32(s[sliceNextOff:], (k+1)*stride)
				s[sliceFlagsOff] = flagHasNext
			} else {
				binary.LittleEndian.PutUint32(s[sliceNextOff:], 0)
				s[sliceFlagsOff] = 0
			}
		}
		cur = area + p.count*stride
	}
	binary.LittleEndian.PutUint32(mem[4:], cur-managerHeaderSize)
}

// bufferRegionSize is the space a region of plans occupies.
func bufferRegionSize(plans []listPlan) uint64 {
	n := uint64(managerHeaderSize)
	for _, p := range plans {
		n += listHeaderSize + uint64(p.count)*(uint64(p.sliceCap)+sliceHeaderSize)
	}
	return n
}

// newBufferManager reads and checks the layout of a mapped buffer region
// (PROTOCOL.md §4.6). Every list must lie inside the mapping, slice sizes must
// be distinct non-zero multiples of 4, and every list must hold a slice. The
// values are copied; the manager never trusts those header fields again.
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
	m := &bufferManager{region: r, mem: mem, lists: make([]sliceList, n), counter: mapperCounter}
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
		total += count
		// The last slice of a list is never handed out (PROTOCOL.md §4.8).
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
	m.bySize = make([]int, n)
	for i := range m.bySize {
		m.bySize[i] = i
	}
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
	for i := range m.lists {
		if l := &m.lists[i]; l.sliceCap <= keepMaxCap {
			l.keepLimit = int32(l.count / keepShare)
		}
	}
	m.initLocal()
	m.space.init(n + 1)
	return m, nil
}

func (m *bufferManager) i32(off uint32) *int32 {
	return (*int32)(unsafe.Pointer(&m.mem[off]))
}

// freeCount is list li's free count. The peer writes it too, so it is
// clamped to [0, count]: arithmetic on it cannot overflow, and a loop it
// bounds cannot run past the number of slices the list has.
func (m *bufferManager) freeCount(li int) int32 {
	l := &m.lists[li]
	n := shmLoadInt32(m.i32(l.header + listFreeOff))
	return min(max(n, 0), int32(l.count))
}

func (m *bufferManager) u32(off uint32) *uint32 {
	return (*uint32)(unsafe.Pointer(&m.mem[off]))
}

// The flags byte of a slice header sits in the low byte of a 4-byte word
// whose other bytes are always zero (PROTOCOL.md §4.4). It is read and
// written with atomic operations on that word, ordered with the atomic
// accesses to next: a pop that sees HAS_NEXT then also sees the next that
// the push stored before setting it, on weakly ordered CPUs too.

// flags returns the flags byte of the slice header at off.
func (m *bufferManager) flags(off uint32) byte {
	return byte(shmLoadUint32(m.u32(off + sliceFlagsOff)))
}

// setFlags sets the flags byte of the slice header at off.
func (m *bufferManager) setFlags(off uint32, f byte) {
	shmStoreUint32(m.u32(off+sliceFlagsOff), uint32(f))
}

// maxSliceCap is the data capacity of the largest slice.
func (m *bufferManager) maxSliceCap() uint32 {
	return m.lists[m.bySize[len(m.bySize)-1]].sliceCap
}

// corrupt builds the error for a value in the buffer region that cannot be.
func corrupt(format string, args ...any) error {
	return fmt.Errorf("%w: buffer region: %s", ErrProtocol, fmt.Sprintf(format, args...))
}

// pop takes one free slice from list li (PROTOCOL.md §4.8). It returns the
// absolute offset of the slice header, or 0 when the list has no slice to
// spare. An error means the list is corrupt.
func (m *bufferManager) pop(li int) (uint32, error) {
	return m.popLeaving(li, 0)
}

// popLeaving is pop that gives up when it would leave the list with fewer
// than keep free slices.
func (m *bufferManager) popLeaving(li int, keep int32) (uint32, error) {
	off, left, err := m.popList(li, keep)
	if off != 0 && m.circ != nil {
		err = m.circ.observe(m, li, left)
	}
	return off, err
}

// popList is pop without the circulation bookkeeping, giving up when it
// would leave the list with fewer than keep free slices (0: take any but
// the last). It also returns the free count the list was left with.
func (m *bufferManager) popList(li int, keep int32) (uint32, int32, error) {
	l := &m.lists[li]
	free, head := m.i32(l.header+listFreeOff), m.u32(l.header+listHeadOff)
	h := shmLoadUint32(head)
	left := shmAddInt32(free, -1)
	if left <= 0 || left < keep {
		shmAddInt32(free, 1)
		return 0, 0, nil
	}
	for range popAttempts {
		if !l.validRelative(h) {
			shmAddInt32(free, 1)
			return 0, 0, corrupt("list of %d-byte slices: head %d is not a slice", l.sliceCap, h)
		}
		hdr := l.area + h
		if m.flags(hdr)&flagHasNext != 0 {
			next := shmLoadUint32(m.u32(hdr + sliceNextOff))
			if !l.validRelative(next) {
				if shmLoadUint32(head) == h {
					shmAddInt32(free, 1)
					return 0, 0, corrupt("list of %d-byte slices: free slice %d links to %d, not a slice", l.sliceCap, h, next)
				}
			} else if shmCASUint32(head, h, next) {
				if w, bit := m.heldBit(li, hdr); w.Load()&bit != 0 {
					// Received and not freed: a writer of ours would share it.
					return 0, 0, corrupt("list of %d-byte slices: free slice %d is held by this process", l.sliceCap, h)
				}
				m.setFlags(hdr, flagInUse)
				shmAddInt32(m.i32(l.header+m.counter), 1)
				return hdr, left, nil
			}
		} else if shmLoadUint32(head) == h && shmLoadInt32(free) <= 1 {
			// h is the last slice on the list. A head that moved on means
			// h was taken meanwhile (its flags no longer say a slice
			// follows): try the new head.
			shmAddInt32(free, 1)
			return 0, 0, nil
		}
		h = shmLoadUint32(head)
	}
	shmAddInt32(free, 1)
	return 0, 0, nil
}

// push returns the slice at absolute offset off, which belongs to list li, to
// its free list (PROTOCOL.md §4.9).
func (m *bufferManager) push(li int, off uint32) error {
	left, err := m.pushList(li, off)
	if err == nil && m.circ != nil {
		// Just before this push the list held one slice fewer.
		err = m.circ.observe(m, li, left-1)
	}
	return err
}

// pushList is push without the circulation bookkeeping. It also returns the
// free count the list was left with.
func (m *bufferManager) pushList(li int, off uint32) (int32, error) {
	l := &m.lists[li]
	// Before the slice is on the list: from then on the peer may allocate
	// it and publish it again.
	m.unhold(li, off)
	binary.LittleEndian.PutUint32(m.mem[off+sliceSizeOff:], 0)
	binary.LittleEndian.PutUint32(m.mem[off+sliceStartOff:], 0)
	m.setFlags(off, 0)
	rel := off - l.area
	tail := m.u32(l.header + listTailOff)
	for range pushAttempts {
		t := shmLoadUint32(tail)
		if !l.validRelative(t) {
			return 0, corrupt("list of %d-byte slices: tail %d is not a slice", l.sliceCap, t)
		}
		if shmCASUint32(tail, t, rel) {
			prev := l.area + t
			shmStoreUint32(m.u32(prev+sliceNextOff), rel)
			atomic.OrUint32(m.u32(prev+sliceFlagsOff), flagHasNext)
			left := shmAddInt32(m.i32(l.header+listFreeOff), 1)
			shmAddInt32(m.i32(l.header+m.counter), -1)
			m.space.freed()
			return left, nil
		}
	}
	return 0, corrupt("list of %d-byte slices: tail kept moving for %d attempts", l.sliceCap, pushAttempts)
}

// locate returns the list holding the slice whose header is at absolute
// offset off, checking that off is exactly on a slice boundary.
func (m *bufferManager) locate(off uint32) (int, error) {
	i := sort.Search(len(m.lists), func(i int) bool { return m.lists[i].area > off }) - 1
	if i < 0 {
		return 0, corrupt("offset %d lies before the first slice", off)
	}
	l := &m.lists[i]
	if off >= l.end() || (off-l.area)%l.stride != 0 {
		return 0, corrupt("offset %d is not the start of a slice", off)
	}
	return i, nil
}

// hold marks the slice at off of list li as received and held by this
// process. It reports false when it was held already.
func (m *bufferManager) hold(li int, off uint32) bool {
	w, bit := m.heldBit(li, off)
	return w.Or(bit)&bit == 0
}

// unhold clears the mark of hold: the slice leaves this process's hands as
// received data.
func (m *bufferManager) unhold(li int, off uint32) {
	w, bit := m.heldBit(li, off)
	if w.Load()&bit != 0 {
		w.And(^bit)
	}
}

// heldBit locates the bit of held for the slice at off of list li, which
// locate has checked.
func (m *bufferManager) heldBit(li int, off uint32) (*atomic.Uint64, uint64) {
	l := &m.lists[li]
	i := l.first + (off-l.area)/l.stride
	// Slice i is bit p of cache line i mod lines: a line of 8 words holds
	// 512 bits, and there are enough lines for every slice.
	line := i & (1<<m.heldShift - 1)
	p := i >> m.heldShift
	return &m.held[line*8+p/64&7], 1 << (p % 64)
}

// alloc pops one slice for n more bytes: from the smallest list whose
// slices hold n, falling back to larger lists when it is empty. When split
// is set the bytes need not be contiguous, so after those it takes the
// largest smaller slice that is left, of at least an eighth of n (or of the
// largest slice that can be handed out, for n beyond it; maxSplitPieces).
// It returns li = -1 when no list can give a slice.
//
// With leave, the writer holds no slice of the region, and it leaves the
// reserve (maxReserve slices) of the lists it takes as a last resort: the
// largest list, and the smaller ones of a split. It takes no slice that
// would leave such a list with fewer free slices than its reserve besides
// the last one, which is never handed out; parked slices count as being on
// the list. The reserve goes to writers that hold slices: part of the
// message they are building, or a message they received and have not
// released, such as a request an echo answers before releasing it. When
// every writer may take every slice, new requests fill the region and the
// writers that would answer them, holding a request each, wait for room
// that only their answers would free; with the reserve there is always
// room for an answer, so exchanges go on turning instead of stalling until
// those writers fall back to the socket. The lists between the first that
// fits and the largest are taken in full: an answer that finds one empty
// goes on to a larger one, as a request does.
//
// Only the region's creator leaves a reserve. It alone sees the slices it
// parked (circulation.go), and keeps a busy list short of free slices on
// purpose; a mapper that counted only the free list could find such a list
// never above the reserve, and wait for ever.
func (m *bufferManager) alloc(n int, split, leave bool) (li int, off uint32, err error) {
	leave = leave && m.circ != nil
	start := m.firstFit(n)
	largest := m.bySize[len(m.bySize)-1]
	for _, i := range m.bySize[start:] {
		if off, err = m.take(i, leave && i == largest); off != 0 || err != nil {
			return i, off, err
		}
	}
	if !split {
		return -1, 0, nil
	}
	floor := min(n, int(m.usable)) / maxSplitPieces
	if leave && !m.roomFor(n, start, floor) {
		return -1, 0, nil
	}
	for k := start - 1; k >= 0 && int(m.lists[m.bySize[k]].sliceCap) >= floor; k-- {
		i := m.bySize[k]
		if off, err = m.take(i, leave); off != 0 || err != nil {
			return i, off, err
		}
	}
	return -1, 0, nil
}

// roomFor reports whether the lists below position start in bySize whose
// slices hold at least floor bytes have room for n bytes beyond their
// reserves. A writer that holds nothing begins a message that takes
// several slices only then: once it holds the first, it takes the rest
// from the reserves, which are kept for writers whose slices an exchange
// needs to finish. Between two processes, requests of 4 MiB split over
// 1 MiB slices took the reserves in about one run of three, and the echo
// server, holding a request each, found no room for its replies and sent
// them over the socket.
func (m *bufferManager) roomFor(n, start, floor int) bool {
	room := 0
	for k := start - 1; k >= 0 && room < n; k-- {
		li := m.bySize[k]
		l := &m.lists[li]
		if int(l.sliceCap) < floor {
			break
		}
		spare := m.freeCount(li) + m.circ.lists[li].parked.Load() - l.reserve - 1
		if spare > 0 {
			room += int(spare) * int(l.sliceCap)
		}
	}
	return room >= n
}

// firstFit is the position in bySize of the smallest list whose slices
// hold n bytes (len(bySize) if none does).
func (m *bufferManager) firstFit(n int) int {
	return sort.Search(len(m.bySize), func(i int) bool { return int(m.lists[m.bySize[i]].sliceCap) >= n })
}

// class is the queue a writer asking for n bytes waits for room in
// (space_queue.go): for n contiguous bytes, that of the smallest list whose
// slices hold them (or the largest list); for bytes that may be split over
// slices of any list, one queue of its own.
func (m *bufferManager) class(n int, split bool) int {
	if split {
		return len(m.lists)
	}
	return m.bySize[min(m.firstFit(n), len(m.bySize)-1)]
}

// take pops a slice of list li for this process's own use: from the free
// list, or when that has none to spare, one of the list's parked slices
// (circulation.go). With leave (which alloc sets only for the region's
// creator, the one that parks), it leaves the list's reserve, parked slices
// included.
func (m *bufferManager) take(li int, leave bool) (uint32, error) {
	l := &m.lists[li]
	var keep, parked int32
	if leave {
		// The reserve, beyond the last slice, which is never handed out;
		// parked slices are free too.
		parked = m.circ.lists[li].parked.Load()
		keep = l.reserve + 1 - parked
	}
	off, err := m.popLeaving(li, keep)
	if off != 0 || err != nil || m.circ == nil {
		return off, err
	}
	if leave && m.freeCount(li)+parked-1 < l.reserve+1 {
		return 0, nil
	}
	return m.circ.unparkOne(m, li)
}

// sliceData returns the whole data area of the slice at off in list li.
func (m *bufferManager) sliceData(li int, off uint32) []byte {
	d := off + sliceHeaderSize
	return m.mem[d : d+m.lists[li].sliceCap : d+m.lists[li].sliceCap]
}

// linkSlice writes the header of a slice of an outgoing message: its size,
// start 0, and a link to the next slice (next == 0 ends the message).
func (m *bufferManager) linkSlice(off uint32, size int, next uint32) {
	binary.LittleEndian.PutUint32(m.mem[off+sliceSizeOff:], uint32(size))
	binary.LittleEndian.PutUint32(m.mem[off+sliceStartOff:], 0)
	if next != 0 {
		binary.LittleEndian.PutUint32(m.mem[off+sliceNextOff:], next)
		m.setFlags(off, flagInUse|flagHasNext)
	} else {
		m.setFlags(off, flagInUse)
	}
}

// readChain walks the message that starts at the slice header at root and
// appends its slices to dst, marking them held (bufferManager.held). Every
// header is read once and checked: the offset must be a slice of a list,
// cap must match that list, start+size must fit in cap, and no slice may
// be held already: by another message this process received and has not
// freed (the peer published it again), or by this one (a cycle, or two
// links to one slice). Empty slices are freed once the whole chain has been
// checked and are not returned. On error nothing is freed (a corrupt chain
// may name slices that are free, or another message's: freeing them would
// hand them out twice; the session ends), the slices marked by this call
// are unmarked, and dst is returned unchanged.
func (m *bufferManager) readChain(dst []segment, root uint32) ([]segment, error) {
	first := len(dst)
	var empty [4]segment
	empties := empty[:0]
	fail := func(err error) ([]segment, error) {
		for _, sl := range dst[first:] {
			m.unhold(int(sl.list), sl.off)
		}
		for _, sl := range empties {
			m.unhold(int(sl.list), sl.off)
		}
		return dst[:first], err
	}
	off := root
	for n := uint32(0); ; n++ {
		if n == m.slices {
			return fail(corrupt("message at %d links more slices than the region has", root))
		}
		li, err := m.locate(off)
		if err != nil {
			return fail(fmt.Errorf("message at %d: %w", root, err))
		}
		if !m.hold(li, off) {
			if n > 0 && (seen(dst[first:], off) || seen(empties, off)) {
				return fail(corrupt("message at %d links the slice at %d twice (a cycle?)", root, off))
			}
			return fail(corrupt("message at %d: the slice at %d was received before and not freed (published twice)", root, off))
		}
		sliceCap := binary.LittleEndian.Uint32(m.mem[off+sliceCapOff:])
		size := binary.LittleEndian.Uint32(m.mem[off+sliceSizeOff:])
		start := binary.LittleEndian.Uint32(m.mem[off+sliceStartOff:])
		next := shmLoadUint32(m.u32(off + sliceNextOff))
		flags := m.flags(off)
		want := m.lists[li].sliceCap
		sl := segment{list: int32(li), off: off}
		if sliceCap != want {
			m.unhold(li, off)
			return fail(corrupt("slice at %d has cap %d, its list has %d", off, sliceCap, want))
		}
		if uint64(start)+uint64(size) > uint64(want) {
			m.unhold(li, off)
			return fail(corrupt("slice at %d has start %d and size %d beyond its cap %d", off, start, size, want))
		}
		if size == 0 {
			empties = append(empties, sl)
		} else {
			d := off + sliceHeaderSize + start
			sl.data = m.mem[d : d+size : d+size]
			dst = append(dst, sl)
		}
		if flags&flagHasNext == 0 {
			break
		}
		off = next
	}
	for _, sl := range empties {
		if err := m.push(int(sl.list), sl.off); err != nil {
			return fail(err)
		}
	}
	return dst, nil
}

// seen reports whether a slice at off is among slices: only to word the
// error when a slice is found held.
func seen(slices []segment, off uint32) bool {
	for i := range slices {
		if slices[i].off == off {
			return true
		}
	}
	return false
}

// segment is one piece of a received or outgoing message: a slice of the
// buffer region (list >= 0) or private memory (list < 0).
type segment struct {
	data []byte
	n    int // writer: bytes used in data
	list int32
	off  uint32
}

const heapSegment = -1

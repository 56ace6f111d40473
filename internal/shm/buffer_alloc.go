package shm

import (
	"encoding/binary"
	"fmt"
	"slices"
	"sort"
	"sync/atomic"
)

// Taking slices from the free lists and giving them back, the held bitmap
// that says which slices this process has handed out, allocation by size
// class, and the chains of slices that carry one message.

// corrupt builds the error for a value in the buffer region that cannot be.
func corrupt(format string, args ...any) error {
	return fmt.Errorf("%w: buffer region: %s", ErrProtocol, fmt.Sprintf(format, args...))
}

// Pop takes one free slice from list li (docs/protocol.md §6.8), as a peer
// allocating a slice of that size does. It returns the absolute offset of
// the slice header, or 0 when the list has no slice to spare. An error
// means the list is corrupt.
func (m *Buffer) Pop(li int) (uint32, error) {
	return m.popLeaving(li, 0)
}

// popLeaving is Pop, unless that would leave fewer than keep free slices.
func (m *Buffer) popLeaving(li int, keep int32) (uint32, error) {
	off, left, err := m.popList(li, keep)
	if off != 0 && m.circ != nil {
		err = m.circ.observe(m, li, left)
	}
	return off, err
}

// popList is popLeaving without the circulation bookkeeping (keep 0: take
// any but the last). It also returns the free count the list was left with.
func (m *Buffer) popList(li int, keep int32) (uint32, int32, error) {
	l := &m.lists[li]
	free, head := m.i32(l.header+listFreeOff), m.u32(l.header+listHeadOff)
	h := shmLoadUint32(head)
	left := shmAddInt32(free, -1)
	if left <= 0 || left < keep {
		shmAddInt32(free, 1)
		return 0, 0, nil
	}
	var err error
	for range popAttempts {
		if !l.validRelative(h) {
			err = corrupt("list of %d-byte slices: head %d is not a slice", l.sliceCap, h)
			break
		}
		hdr := l.area + h
		if m.flags(hdr)&flagHasNext != 0 {
			next := shmLoadUint32(m.u32(hdr + sliceNextOff))
			if !l.validRelative(next) {
				if shmLoadUint32(head) == h {
					err = corrupt("list of %d-byte slices: free slice %d links to %d, not a slice", l.sliceCap, h, next)
					break
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
			break
		}
		h = shmLoadUint32(head)
	}
	shmAddInt32(free, 1) // nothing taken
	return 0, 0, err
}

// Push returns the slice at absolute offset off, which belongs to list li, to
// its free list (docs/protocol.md §6.9).
func (m *Buffer) Push(li int, off uint32) error {
	left, err := m.pushList(li, off)
	if err == nil && m.circ != nil {
		// Just before this push the list held one slice fewer.
		err = m.circ.observe(m, li, left-1)
	}
	return err
}

// pushList is push without the circulation bookkeeping. It also returns the
// free count the list was left with.
func (m *Buffer) pushList(li int, off uint32) (int32, error) {
	l := &m.lists[li]
	// Before the slice is on the list: from then on the peer may allocate
	// it and publish it again.
	m.Unhold(li, off)
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
func (m *Buffer) locate(off uint32) (int, error) {
	i := sort.Search(len(m.lists), func(i int) bool { return m.lists[i].area > off }) - 1
	if i < 0 {
		return 0, corrupt("offset %d lies before the first slice", off)
	}
	l := &m.lists[i]
	if off >= l.area+l.count*l.stride || (off-l.area)%l.stride != 0 {
		return 0, corrupt("offset %d is not the start of a slice", off)
	}
	return i, nil
}

// hold marks the slice at off of list li as held (Buffer.held). It
// reports false when it was held already.
func (m *Buffer) hold(li int, off uint32) bool {
	w, bit := m.heldBit(li, off)
	return w.Or(bit)&bit == 0
}

// Unhold clears the mark of hold.
func (m *Buffer) Unhold(li int, off uint32) {
	w, bit := m.heldBit(li, off)
	if w.Load()&bit != 0 {
		w.And(^bit)
	}
}

// heldBit locates held's bit for slice off of list li, which locate checked.
func (m *Buffer) heldBit(li int, off uint32) (*atomic.Uint64, uint64) {
	l := &m.lists[li]
	i := l.first + (off-l.area)/l.stride
	// Slice i is bit p of cache line i mod lines: a line of 8 words holds
	// 512 bits, and there are enough lines for every slice.
	line := i & (1<<m.heldShift - 1)
	p := i >> m.heldShift
	return &m.held[line*8+p/64&7], 1 << (p % 64)
}

// Alloc pops one slice for n more bytes: from the smallest list whose
// slices hold n, or a larger one, or with split, the largest smaller slice
// left of at least 1/maxSplitPieces of n (or of usable). It returns li = -1
// when no list can give a slice.
//
// With leave (the writer holds no slice) it leaves the reserve of the lists
// it takes as a last resort, the largest and those of a split, to writers
// that hold slices, such as an echo holding the request it answers, which
// could otherwise wait for room only its answer would free. Only the
// creator leaves one: a mapper cannot see the parked slices (circulation.go)
// of a list kept short on purpose, and could wait for ever.
func (m *Buffer) Alloc(n int, split, leave bool) (li int, off uint32, err error) {
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
// reserves. A writer that holds nothing begins a split message only then:
// once it holds the first slice, it takes the rest from the reserves.
func (m *Buffer) roomFor(n, start, floor int) bool {
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
func (m *Buffer) firstFit(n int) int {
	return sort.Search(len(m.bySize), func(i int) bool { return int(m.lists[m.bySize[i]].sliceCap) >= n })
}

// Class is the queue a writer asking for n bytes waits for room in
// (space_queue.go): that of the smallest list whose slices hold them (or
// the largest list), or with split, one queue of its own.
func (m *Buffer) Class(n int, split bool) int {
	if split {
		return len(m.lists)
	}
	return m.bySize[min(m.firstFit(n), len(m.bySize)-1)]
}

// take pops a slice of list li for this process's own use: from the free
// list, or else one of its parked slices (circulation.go). With leave it
// leaves the list's reserve, parked slices included.
func (m *Buffer) take(li int, leave bool) (uint32, error) {
	l := &m.lists[li]
	var keep, parked int32
	if leave {
		// The reserve and the last slice, less the parked slices.
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

// SliceData returns the whole data area of the slice at off in list li.
func (m *Buffer) SliceData(li int, off uint32) []byte {
	d := off + SliceHeaderSize
	return m.mem[d : d+m.lists[li].sliceCap : d+m.lists[li].sliceCap]
}

// LinkSlice writes the header of a slice of an outgoing message: its size,
// start 0, and a link to the next slice (next == 0 ends the message).
func (m *Buffer) LinkSlice(off uint32, size int, next uint32) {
	binary.LittleEndian.PutUint32(m.mem[off+sliceSizeOff:], uint32(size))
	binary.LittleEndian.PutUint32(m.mem[off+sliceStartOff:], 0)
	if next != 0 {
		binary.LittleEndian.PutUint32(m.mem[off+sliceNextOff:], next)
		m.setFlags(off, flagInUse|flagHasNext)
	} else {
		m.setFlags(off, flagInUse)
	}
}

// ReadChain appends the slices of the message whose root slice header is
// at root to dst, marking them held. Every header is read once and checked
// (a slice of a list with that list's cap, start+size within it, not held
// already), and empty slices are freed once the whole chain is checked. On
// error nothing is freed (a corrupt chain may name free slices, or another
// message's), the marks of this call are undone and dst is returned as is.
func (m *Buffer) ReadChain(dst []Segment, root uint32) ([]Segment, error) {
	first := len(dst)
	var empty [4]Segment
	empties := empty[:0]
	fail := func(err error) ([]Segment, error) {
		for _, sl := range slices.Concat(dst[first:], empties) {
			m.Unhold(int(sl.List), sl.Off)
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
		sl := Segment{List: int32(li), Off: off}
		if sliceCap != want {
			m.Unhold(li, off)
			return fail(corrupt("slice at %d has cap %d, its list has %d", off, sliceCap, want))
		}
		if uint64(start)+uint64(size) > uint64(want) {
			m.Unhold(li, off)
			return fail(corrupt("slice at %d has start %d and size %d beyond its cap %d", off, start, size, want))
		}
		if size == 0 {
			empties = append(empties, sl)
		} else {
			d := off + SliceHeaderSize + start
			sl.Data = m.mem[d : d+size : d+size]
			dst = append(dst, sl)
		}
		if flags&flagHasNext == 0 {
			break
		}
		off = next
	}
	for _, sl := range empties {
		if err := m.Push(int(sl.List), sl.Off); err != nil {
			return fail(err)
		}
	}
	return dst, nil
}

// seen reports whether a slice at off is among segs, to word an error.
func seen(segs []Segment, off uint32) bool {
	return slices.ContainsFunc(segs, func(s Segment) bool { return s.Off == off })
}

// Segment is one piece of a received or outgoing message: a slice of the
// buffer region, of list List with its header at Off, or private memory
// (List HeapSegment).
type Segment struct {
	Data []byte
	N    int // a writer's: bytes used in Data
	List int32
	Off  uint32
}

const HeapSegment = -1

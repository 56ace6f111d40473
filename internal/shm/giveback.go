package shm

import (
	"slices"

	"golang.org/x/sys/unix"
)

// Giving memory back. A buffer region's pages stay committed once written,
// so when a list has been quiet for Periods.GiveBack, the process that created
// the region (which holds its descriptor) punches holes in the data pages
// of its free slices (fallocate FALLOC_FL_PUNCH_HOLE). Each slice is popped
// while its pages go, so no peer can be writing to it; headers are never
// punched. A slice handed out again faults its pages back in, zero-filled.

// listSample is what a list's header said at one look. Its head and tail
// tell traffic that left the free count and counters where they were.
type listSample struct {
	free, creator, mapper int32
	head, tail            uint32
}

// sample reads list li's header words.
func (m *Buffer) sample(li int) listSample {
	h := m.lists[li].header
	return listSample{
		free:    m.freeCount(li),
		creator: shmLoadInt32(m.i32(h + creatorCounter)),
		mapper:  shmLoadInt32(m.i32(h + mapperCounter)),
		head:    shmLoadUint32(m.u32(h + listHeadOff)),
		tail:    shmLoadUint32(m.u32(h + listTailOff)),
	}
}

// dataPages returns the range of whole pages inside the data of the slice
// whose header is at off in list li: [first, end) in bytes, empty if none.
func (m *Buffer) dataPages(li int, off uint32) (first, end int) {
	first = (int(off) + SliceHeaderSize + pageSize - 1) / pageSize * pageSize
	end = (int(off) + int(m.lists[li].stride)) / pageSize * pageSize
	return first, max(first, end)
}

// punch gives back the data pages of the slice at off in list li, which
// this process has popped.
func (m *Buffer) punch(li int, off uint32) {
	if first, end := m.dataPages(li, off); first < end {
		_ = unix.Fallocate(m.region.fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, int64(first), int64(end-first))
	}
}

// giveBackList cycles once through list li's free slices, if any slice of
// the list has data pages in memory, punching those. It pops as many as the
// list holds, not one fewer: the last, unpoppable at the tail, reaches the
// head as the others are pushed back behind it. It asks the kernel which
// pages are in memory for the list's slices alone, not the whole region:
// mincore's cost follows the pages it covers (2 ms for 128 MiB).
func (m *Buffer) giveBackList(li int) {
	l := &m.lists[li]
	base := int(l.area) / pageSize * pageSize
	resident := residentPages(m.mem[base:min(len(m.mem), int(l.area+l.count*l.stride))])
	if resident == nil {
		return
	}
	inMemory := func(off uint32) bool {
		first, end := m.dataPages(li, off)
		if first == end {
			return false // no whole page (first may lie past resident's end)
		}
		return slices.ContainsFunc(resident[(first-base)/pageSize:(end-base)/pageSize], func(v byte) bool { return v&1 != 0 })
	}
	found := false
	for k := uint32(0); k < l.count && !found; k++ {
		found = inMemory(l.area + k*l.stride)
	}
	if !found {
		return
	}
	for range m.freeCount(li) {
		off, _, err := m.popList(li, 0)
		if err != nil || off == 0 {
			break
		}
		if inMemory(off) {
			m.punch(li, off)
		}
		if _, err := m.pushList(li, off); err != nil {
			break
		}
	}
}

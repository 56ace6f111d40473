package shmipc

import (
	"runtime/debug"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// Giving memory back.
//
// A buffer region's pages are committed when first written and, left alone,
// stay committed: a burst of large messages would pin the pages of every
// slice it used for as long as the region lives. So the process that
// created a region (the client, which holds its descriptor) watches it, and
// when a list has been quiet for giveBackPeriod, nothing popped or pushed
// by either process, it punches holes in the data pages of its free slices
// (fallocate FALLOC_FL_PUNCH_HOLE). A slice is taken off the free list
// while its pages go, as any writer would take it, so no peer can be
// writing to it; slice headers are never punched. A slice handed out again
// faults its pages back in, zero-filled, as writers fill slices before they
// publish them.
//
// Nothing of this runs on the hot path: a busy list is not touched, and the
// cost (a pop, a push and a fallocate per slice with committed data pages)
// is paid once after traffic stops.

// giveBackPeriod is how long a list must be quiet before the data pages of
// its free slices are given back, and how often lists are looked at. A
// region takes the value when it is created.
var giveBackPeriod = time.Second

// listSample is what a list's header said at one look: its free count and
// both processes' counter words, which change with every pop and push.
type listSample struct{ free, creator, mapper int32 }

// startGiveBack watches m, a region this process created, until it is
// unmapped.
func (m *bufferManager) startGiveBack() {
	period := giveBackPeriod
	last := make([]listSample, len(m.lists))
	var tick func()
	tick = func() {
		if !m.region.acquire() {
			return // unmapped
		}
		m.giveBackQuiet(last)
		m.region.release()
		time.AfterFunc(period, tick)
	}
	time.AfterFunc(period, tick)
}

// sample reads list li's header words.
func (m *bufferManager) sample(li int) listSample {
	h := m.lists[li].header
	return listSample{
		free:    atomic.LoadInt32(m.i32(h + listFreeOff)),
		creator: atomic.LoadInt32(m.i32(h + creatorCounter)),
		mapper:  atomic.LoadInt32(m.i32(h + mapperCounter)),
	}
}

// giveBackQuiet gives back the data pages of the free slices of every list
// that has not changed since the previous look (last), and records this
// look. A fault (a region shrunk or a page not committable) ends the work
// quietly: the sessions using the region meet it in their own accesses.
func (m *bufferManager) giveBackQuiet(last []listSample) {
	defer func() {
		if r := recover(); r != nil {
			_ = faultError(r) // re-panics anything but a memory fault
		}
	}()
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	var resident []byte
	for li := range m.lists {
		now := m.sample(li)
		quiet := now == last[li]
		last[li] = now
		if !quiet {
			continue
		}
		if resident == nil {
			resident = residentPages(m.mem)
			if resident == nil {
				return
			}
		}
		if m.giveBackList(li, resident) {
			last[li] = m.sample(li) // our own pops and pushes are not traffic
		}
	}
}

// dataPages returns the range of whole pages inside the data of the slice
// whose header is at off in list li: [first, end) in bytes, empty if none.
func (m *bufferManager) dataPages(li int, off uint32) (first, end int) {
	ps := pageSize
	start := int(off) + sliceHeaderSize
	first = (start + ps - 1) / ps * ps
	end = (int(off) + int(m.lists[li].stride)) / ps * ps
	return first, max(first, end)
}

// hasResident reports whether any page of [first, end) is in memory.
func hasResident(resident []byte, first, end int) bool {
	for p := first / pageSize; p < end/pageSize; p++ {
		if resident[p]&1 != 0 {
			return true
		}
	}
	return false
}

// giveBackList cycles once through list li's free slices if any of them has
// data pages in memory, punching those. It reports whether it popped any.
func (m *bufferManager) giveBackList(li int, resident []byte) bool {
	l := &m.lists[li]
	found := false
	for k := uint32(0); k < l.count; k++ {
		off := l.area + k*l.stride
		if first, end := m.dataPages(li, off); first < end && hasResident(resident, first, end) {
			found = true
			break
		}
	}
	if !found {
		return false
	}
	n := atomic.LoadInt32(m.i32(l.header+listFreeOff)) - 1
	for range n {
		off, err := m.pop(li)
		if err != nil || off == 0 {
			break
		}
		if first, end := m.dataPages(li, off); first < end && hasResident(resident, first, end) {
			_ = unix.Fallocate(m.region.fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, int64(first), int64(end-first))
		}
		if m.push(li, off) != nil {
			break
		}
	}
	return true
}

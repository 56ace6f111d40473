package shm

import (
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Circulation control: committed memory that follows the bytes in flight.
// The free lists are FIFO (docs/protocol.md §6.8, §6.9), so under steady traffic
// every slice of a class takes its turn and has its data pages committed,
// however few messages are in flight.
//
// So the process that created a region looks at each of its lists every
// Periods.Look and keeps the peak in flight (count − parked − free)
// over the last circulationWindow looks. A busy list keeps peak + spare
// slices in circulation (spareFor); the others are parked: popped, their
// data pages punched (giveback.go), and kept in this process, where nobody
// can write them. As the FIFO order can touch every slice not parked within
// one period, a class commits at most min(count, peak + spare) slices
// besides its headers from the first look after traffic changes.
//
// Parked slices go back as soon as they may be needed: to this process's
// own allocation when the list has none to spare (take); when the free
// count falls below half the spare (observe, steer), so that a peer finds a
// list short for at most one period; all of them before the connection of
// the region's last session closes, as the peer may check that its lists
// are full (sessionEnding); and when a list has been quiet for
// Periods.GiveBack, or the region is unmapped. Parked slices count as free
// in Stats (Buffer.Lists).
//
// A region where nothing moves costs no work: once a look finds every list
// settled (quiet for Periods.GiveBack, its pages given back, nothing parked)
// and no slice in flight, the looks stop. The next pop or push of this
// process (observe) starts them again, at the cost of an atomic load while
// they run. A peer's pops and pushes do not run observe; but every slice a
// peer sends this process is freed by it, and while slices are in flight
// (held by the peer, perhaps) the looks go on, further and further apart
// (up to Periods.MaxLookGap), so that slices the peer frees have their pages
// given back too.

// Periods are the timing of circulation control; a region takes them when
// it is created (CreateBuffer).
type Periods struct {
	// Look is how often a region's lists are looked at.
	Look time.Duration
	// GiveBack is how long a list must be quiet before the data pages of
	// its free slices are given back (giveback.go).
	GiveBack time.Duration
	// MaxLookGap is the longest pause between looks at a settled region
	// with slices in flight.
	MaxLookGap time.Duration
}

// DefaultPeriods are 50 ms between looks, 1 s of quiet before give-back,
// and at most 8 s between looks at a settled region.
func DefaultPeriods() Periods {
	return Periods{Look: 50 * time.Millisecond, GiveBack: time.Second, MaxLookGap: 8 * time.Second}
}

const (
	// circulationWindow is how many looks the peak in flight is taken over.
	circulationWindow = 8
	// spareBytes is the data a busy list keeps free beyond its peak in
	// flight, and minSpare the fewest slices (a list never hands out its
	// last slice, so 2 leave one that can be popped).
	spareBytes = 1 << 20
	minSpare   = 2
	// parkHold is how long no slice is parked after the last session
	// using the region ends.
	parkHold = 250 * time.Millisecond
)

// circList is what the hot path reads and writes of a list's circulation,
// on a cache line of its own.
type circList struct {
	high   atomic.Int32 // the most slices in flight seen since the last look
	parked atomic.Int32 // how many are parked: len(circulation.parked[li])
	floor  atomic.Int32 // refill when the free count falls below this; 0 while nothing is parked
	_      [52]byte
}

// circulation is the circulation control of a region this process created.
type circulation struct {
	lists []circList

	// running says whether a look is due: cleared when a look finds the
	// region at rest, set, with a look scheduled, by this process's next pop
	// or push (observe). Written only then: the hot path reads it alone.
	running atomic.Bool
	// The Periods the region was created with.
	period, giveBack, maxGap time.Duration

	mu     sync.Mutex
	parked [][]uint32 // per list, the header offsets of its parked slices
	spare  []int32    // per list, the free slices to keep on it
	hold   time.Time  // no parking before this

	// Used by the looks alone, which run one at a time: a look that
	// rests may still be finishing when the look observe schedules begins.
	lookMu  sync.Mutex
	peaks   [][circulationWindow]int32
	pos     int
	last    []listSample
	quiet   []time.Duration
	settled []bool        // given back since its last traffic
	gap     time.Duration // the pause before the next look
	looks   atomic.Uint64 // how many looks have run
}

// startCirculation starts watching m, a region this process created, until
// it is unmapped. It takes over giving pages back (giveback.go).
func (m *Buffer) startCirculation(p Periods) {
	n := len(m.lists)
	c := &circulation{
		lists:   make([]circList, n),
		parked:  make([][]uint32, n),
		spare:   make([]int32, n),
		peaks:   make([][circulationWindow]int32, n),
		last:    make([]listSample, n),
		quiet:   make([]time.Duration, n),
		settled: make([]bool, n),
	}
	for li := range m.lists {
		c.spare[li] = m.spareFor(li, 0)
		c.last[li] = m.sample(li)
	}
	c.period = min(p.Look, p.GiveBack)
	c.giveBack = p.GiveBack
	c.maxGap = max(p.MaxLookGap, c.period)
	c.gap = c.period
	m.circ = c
	c.running.Store(true)
	time.AfterFunc(c.gap, m.tick)
}

// tick runs a look, and schedules the next unless unmapped or at rest.
func (m *Buffer) tick() {
	if !m.region.Acquire() {
		return // unmapped
	}
	defer m.region.Release()
	c := m.circ
	c.lookMu.Lock()
	defer c.lookMu.Unlock()
	c.looks.Add(1)
	again := true
	Quietly(func() {
		settled, inFlight := m.look(c.gap, c.giveBack)
		switch {
		case !settled:
			c.gap = c.period
		case inFlight:
			c.gap = min(2*c.gap, c.maxGap)
		default:
			again = !c.rest(m)
		}
	})
	if again {
		time.AfterFunc(c.gap, m.tick)
	}
}

// rest stops the looks of a region that look found settled with nothing in
// flight, and reports whether they stopped: not if a list changed since the
// look, as a pop or push that came before running was cleared did not
// start them (observe). It runs inside Quietly.
func (c *circulation) rest(m *Buffer) bool {
	c.gap = c.period
	c.running.Store(false)
	for li := range m.lists {
		if m.sample(li) != c.last[li] {
			// Whoever sets running schedules the next look.
			return !c.running.CompareAndSwap(false, true)
		}
	}
	return true
}

// spareFor is how many free slices list li keeps with peak of them in flight.
func (m *Buffer) spareFor(li int, peak int32) int32 {
	l := &m.lists[li]
	spare := max(minSpare, int32((spareBytes+l.sliceCap-1)/l.sliceCap), (peak+3)/4)
	return min(spare, int32(l.count))
}

// observe notes that list li was left with left free slices by a pop or
// push of this process, and refills the list if it is short.
func (c *circulation) observe(m *Buffer, li int, left int32) error {
	if !c.running.Load() && c.running.CompareAndSwap(false, true) {
		time.AfterFunc(c.period, m.tick) // a region at rest: traffic resumed
	}
	c.noteInFlight(m, li, left)
	if left >= c.lists[li].floor.Load() {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.refillLocked(m, li)
}

// noteInFlight records the slices of list li in flight, neither free nor
// parked, when it holds free slices (both counts read at the same moment).
func (c *circulation) noteInFlight(m *Buffer, li int, free int32) {
	cl := &c.lists[li]
	if n := int32(m.lists[li].count) - cl.parked.Load() - free; n > cl.high.Load() {
		cl.high.Store(n)
	}
}

// setParkedLocked makes p the parked slices of list li.
func (c *circulation) setParkedLocked(li int, p []uint32) {
	c.parked[li] = p
	c.lists[li].parked.Store(int32(len(p)))
}

// unparkLocked takes the last parked slice of list li, which has one, out
// of the parked ones and returns it.
func (c *circulation) unparkLocked(li int) uint32 {
	p := c.parked[li]
	c.setParkedLocked(li, p[:len(p)-1])
	return p[len(p)-1]
}

// setFloorLocked sets the free count below which list li is refilled.
func (c *circulation) setFloorLocked(li int) {
	var floor int32
	if len(c.parked[li]) > 0 {
		floor = max(2, c.spare[li]/2)
	}
	c.lists[li].floor.Store(floor)
}

// refillLocked pushes parked slices of list li until it holds its spare.
func (c *circulation) refillLocked(m *Buffer, li int) error {
	defer c.setFloorLocked(li)
	free := m.i32(m.lists[li].header + listFreeOff)
	for len(c.parked[li]) > 0 && shmLoadInt32(free) < c.spare[li] {
		if _, err := m.pushList(li, c.unparkLocked(li)); err != nil {
			return err
		}
	}
	return nil
}

// unparkOne hands out a parked slice of list li, whose free list had none
// to spare, and refills the list; it returns 0 when none is parked.
func (c *circulation) unparkOne(m *Buffer, li int) (uint32, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.parked[li]) == 0 {
		return 0, nil
	}
	// The list ran dry: every slice not parked is in flight.
	c.noteInFlight(m, li, m.freeCount(li))
	off := c.unparkLocked(li)
	return off, c.refillLocked(m, li)
}

// unparkList pushes every parked slice of list li back.
func (c *circulation) unparkList(m *Buffer, li int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.unparkListLocked(m, li)
}

func (c *circulation) unparkListLocked(m *Buffer, li int) {
	defer c.setFloorLocked(li)
	for len(c.parked[li]) > 0 {
		if _, err := m.pushList(li, c.unparkLocked(li)); err != nil {
			c.setParkedLocked(li, nil) // a corrupt list: the region is lost anyway
			return
		}
	}
}

// SessionEnding runs when a session using the region ends, before its
// connection closes: if no other session of this process uses the region,
// every parked slice goes back, so that the peer finds its lists full.
func (m *Buffer) SessionEnding() {
	if m.sessions.Load() <= 1 {
		m.unparkAll()
	}
}

// unparkAll pushes every parked slice back and parks none for parkHold.
func (m *Buffer) unparkAll() {
	c := m.circ
	if c == nil {
		return
	}
	Quietly(func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.hold = time.Now().Add(parkHold)
		for li := range c.parked {
			c.unparkListLocked(m, li)
		}
	})
}

// look records every list's peak in flight, steers busy lists, and gives
// the pages of lists quiet for giveBack back; period is the time since the
// last look. It reports whether every list is settled, and whether any
// has slices in flight. It runs inside Quietly.
func (m *Buffer) look(period, giveBack time.Duration) (settled, inFlight bool) {
	c := m.circ
	c.pos = (c.pos + 1) % circulationWindow
	settled = true
	for li := range m.lists {
		now := m.sample(li)
		cl := &c.lists[li]
		n := int32(m.lists[li].count) - cl.parked.Load() - now.free
		c.peaks[li][c.pos] = max(0, n, cl.high.Swap(n))
		inFlight = inFlight || n != 0
		switch {
		case now != c.last[li]:
			c.quiet[li], c.settled[li] = 0, false
			m.steer(li)
		case !c.settled[li]:
			c.quiet[li] += period
			if c.quiet[li] < giveBack {
				break
			}
			c.settled[li] = true
			c.unparkList(m, li)
			m.giveBackList(li)
		}
		c.last[li] = m.sample(li) // our own pops and pushes are not traffic
		settled = settled && c.settled[li]
	}
	return settled, inFlight
}

// steer parks the slices of busy list li beyond its peak in flight and its
// spare, or refills it if it is short.
func (m *Buffer) steer(li int) {
	c := m.circ
	peak := slices.Max(c.peaks[li][:])
	spare := m.spareFor(li, peak)
	c.mu.Lock()
	c.spare[li] = spare
	c.mu.Unlock()
	for c.parkOne(m, li, peak+spare) {
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if m.freeCount(li) < c.lists[li].floor.Load() {
		_ = c.refillLocked(m, li)
	}
	c.setFloorLocked(li)
}

// parkOne parks a slice of list li if more than keep of its slices are in
// circulation and the list holds more than its spare; it reports whether
// it did. Locking per slice, an allocation waits for one punch at most.
func (c *circulation) parkOne(m *Buffer, li int, keep int32) bool {
	l := &m.lists[li]
	c.mu.Lock()
	defer c.mu.Unlock()
	if !time.Now().After(c.hold) || m.sessions.Load() == 0 {
		return false // no session, or unparkAll ran less than parkHold ago
	}
	circulating := int32(l.count) - int32(len(c.parked[li]))
	if circulating <= keep || m.freeCount(li) <= c.spare[li] {
		return false
	}
	off, _, err := m.popList(li, 0)
	if off == 0 || err != nil {
		return false
	}
	m.punch(li, off)
	c.setParkedLocked(li, append(c.parked[li], off))
	c.setFloorLocked(li)
	return true
}

package shm

// Circulation control: what parks, and a region where nothing moves, whose
// looks stop once it has settled, start again with the next traffic, and go
// on while a peer holds slices. Committed memory under sustained traffic
// between processes is tested at the root, with sessions.

import (
	"sync/atomic"
	"testing"
	"time"
)

// defaultPlans is the layout of the default 128 MiB buffer region.
var defaultPlans = []ListPlan{{8172, 2457}, {32748, 245}, {131052, 71}, {1052672, 8}, {4198400, 20}}

// circIdleBuffer returns a creator's region of the default layout whose
// lists settle 200 ms after traffic and whose looks, with slices in flight,
// are at most 400 ms apart, and a peer's view of it.
func circIdleBuffer(t *testing.T) (m, peer *Buffer) {
	t.Helper()
	m = createTestBuffer(t, 128<<20, Periods{Look: 50 * time.Millisecond, GiveBack: 200 * time.Millisecond, MaxLookGap: 400 * time.Millisecond}, defaultPlans...)
	peer, err := NewBuffer(RegionOf(m.region.mem), false)
	if err != nil {
		t.Fatal(err)
	}
	return m, peer
}

// circEcho sends n bytes to peer and takes back its reply of n bytes, each
// in one slice, as an echo through a session does: this process allocates
// and writes the request, the peer frees it and allocates and writes the
// reply, and this process frees that.
func circEcho(t *testing.T, m, peer *Buffer, n int) {
	t.Helper()
	li, off, err := m.Alloc(n, false, true)
	if err != nil || li < 0 {
		t.Fatalf("no slice for %d bytes: %v", n, err)
	}
	fill(m.SliceData(li, off)[:n])
	if err := peer.Push(li, off); err != nil {
		t.Fatal(err)
	}
	var reply uint32
	waitUntil(t, "the peer finds a slice for its reply", time.Minute, func() bool {
		if reply, err = peer.Pop(li); err != nil {
			t.Fatal(err)
		}
		return reply != 0
	})
	fill(peer.SliceData(li, reply)[:n])
	if err := m.Push(li, reply); err != nil {
		t.Fatal(err)
	}
}

func fill(p []byte) {
	for i := range p {
		p[i] = byte(i>>12) + 1
	}
}

// listFor returns the list that serves a message of size bytes in one
// slice: the smallest whose slices hold it.
func listFor(t *testing.T, m *Buffer, size int) int {
	t.Helper()
	for _, li := range m.bySize {
		if int(m.lists[li].sliceCap) >= size {
			return li
		}
	}
	t.Fatalf("no list holds %d bytes", size)
	return -1
}

// circWaitRest waits until the looks at m have stopped and checks that the
// region is as a quiet one must be: every slice free, none parked, and no
// more committed than idle (with 256 KiB of slack).
func circWaitRest(t *testing.T, m *Buffer, idle uint64) {
	t.Helper()
	// A bound for a loaded machine; a fraction of a second otherwise.
	waitUntil(t, "the region's looks stop", time.Minute, func() bool { return !m.circ.running.Load() })
	for _, l := range m.Lists() {
		if l.Free != int32(l.Count) || l.Parked != 0 {
			t.Errorf("at rest, the list of %d-byte slices has %d of %d slices free, %d parked", l.SliceCap, l.Free, l.Count, l.Parked)
		}
	}
	if got := m.region.Committed(); got > idle+256<<10 {
		t.Errorf("at rest, %d bytes are committed; %d when idle", got, idle)
	}
}

// circSettled reports whether the last look found every list of c settled.
func circSettled(c *circulation) bool {
	c.lookMu.Lock()
	defer c.lookMu.Unlock()
	for _, s := range c.settled {
		if !s {
			return false
		}
	}
	return true
}

// waitUntil polls cond until it holds, failing the test after within.
func waitUntil(t *testing.T, what string, within time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, within)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestIdleRegionMakesNoLooks: once a region's lists have settled after
// traffic (pages given back, nothing parked or in flight), its looks stop,
// and no timer of the circulation control fires over a quiet second. The
// next traffic starts them again: a busy class gets slices parked, and
// once the traffic stops, its pages are given back and the looks stop
// again.
func TestIdleRegionMakesNoLooks(t *testing.T) {
	m, peer := circIdleBuffer(t)
	c := m.circ
	circEcho(t, m, peer, 5)
	idle := m.region.Committed()
	circEcho(t, m, peer, 2<<20)
	circWaitRest(t, m, idle)

	quiet := time.Second
	if testing.Short() {
		quiet = 300 * time.Millisecond
	}
	before := c.looks.Load()
	time.Sleep(quiet)
	if n := c.looks.Load() - before; n != 0 {
		t.Errorf("%d looks at a region at rest in %v", n, quiet)
	}
	if c.running.Load() {
		t.Error("the looks started again with no traffic")
	}

	// Traffic in one class until it has slices parked: only a look parks.
	li := listFor(t, m, 100<<10)
	deadline := time.Now().Add(time.Minute) // a bound for a loaded machine
	for m.Lists()[li].Parked == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("no slice of the %d-byte class parked in a minute of traffic after the rest: %+v", m.lists[li].sliceCap, m.Lists()[li])
		}
		for range 20 {
			circEcho(t, m, peer, 100<<10)
		}
	}
	if c.looks.Load() == before {
		t.Error("slices were parked with no look")
	}
	t.Logf("with traffic again: %+v", m.Lists()[li])
	circWaitRest(t, m, idle)
}

// TestRegionWithSliceInFlightKeepsLooking: a region whose lists have
// settled while the peer holds a slice goes on looking, as the peer's
// push does not run this process's code; once the peer has pushed the
// slice back, its pages are given back and the looks stop.
func TestRegionWithSliceInFlightKeepsLooking(t *testing.T) {
	m, peer := circIdleBuffer(t)
	c := m.circ
	circEcho(t, m, peer, 5)
	idle := m.region.Committed()

	li := listFor(t, m, 1<<20)
	// Traffic of this process, so that the looks run while the peer
	// takes the slice.
	circEcho(t, m, peer, 5)
	off, err := peer.Pop(li)
	if err != nil || off == 0 {
		t.Fatalf("the peer could not pop a slice: %d, %v", off, err)
	}
	data := peer.SliceData(li, off)
	fill(data)
	waitUntil(t, "the lists settle", time.Minute, func() bool { return circSettled(c) })
	quiet := time.Second
	if testing.Short() {
		quiet = 500 * time.Millisecond
	}
	before := c.looks.Load()
	time.Sleep(quiet)
	if !c.running.Load() || c.looks.Load() == before {
		t.Fatalf("the looks stopped while the peer holds a slice (%d looks in %v)", c.looks.Load()-before, quiet)
	}
	if got := m.region.Committed(); got < idle+uint64(len(data))/2 {
		t.Errorf("%d bytes committed while the peer holds a slice it wrote %d bytes of; %d when idle", got, len(data), idle)
	}

	if err := peer.Push(li, off); err != nil {
		t.Fatal(err)
	}
	circWaitRest(t, m, idle)
}

// TestNoParkingAfterUnparkAll: once unparkAll has put every parked slice
// back (a session ending, so that the peer finds its lists full), nothing
// parks again for parkHold, even a park that circulation decided on
// before: parkOne itself refuses.
func TestNoParkingAfterUnparkAll(t *testing.T) {
	m := createTestBuffer(t, 128<<20, DefaultPeriods(), defaultPlans...)
	li := m.bySize[0]
	count := int32(m.lists[li].count)

	if !m.circ.parkOne(m, li, 0) {
		t.Fatal("parkOne parked nothing in a full list with parking allowed")
	}
	if l := m.Lists()[li]; l.Parked != 1 || l.Free != count {
		t.Fatalf("after one park: %d free of %d, %d parked; want all free, 1 parked", l.Free, count, l.Parked)
	}
	m.unparkAll()
	if m.circ.parkOne(m, li, 0) {
		t.Error("parkOne parked a slice right after unparkAll")
	}
	if got := atomic.LoadInt32(m.i32(m.lists[li].header + listFreeOff)); got != count {
		t.Errorf("the list holds %d of its %d slices after unparkAll", got, count)
	}
}

package shmipc

// The circulation control of a region where nothing moves: its looks stop
// once it has settled, start again with the next traffic, and go on while
// a peer holds slices.

import (
	"testing"
	"time"
)

// circIdleSession returns a session to an in-process echo server with a
// buffer region of its own, whose lists settle 200 ms after traffic and
// whose looks, with slices in flight, are at most 400 ms apart.
func circIdleSession(t *testing.T) *Session {
	t.Helper()
	oldGiveBack, oldGap := giveBackPeriod, maxLookGap
	giveBackPeriod, maxLookGap = 200*time.Millisecond, 400*time.Millisecond
	t.Cleanup(func() { giveBackPeriod, maxLookGap = oldGiveBack, oldGap })
	conf := DefaultConfig()
	conf.ShareMemoryPathPrefix = shmPrefix(t, "idle")
	sess := dialEchoSession(t, conf)
	if sess.buf.circ == nil {
		t.Fatal("the client's buffer region has no circulation control")
	}
	return sess
}

// circWaitRest waits until the looks at sess's region have stopped and
// checks that the region is as a quiet one must be: every slice free,
// none parked, and no more committed than idle (with 256 KiB of slack).
func circWaitRest(t *testing.T, sess *Session, idle uint64) {
	t.Helper()
	// A bound for a loaded machine; a fraction of a second otherwise.
	waitUntil(t, "the region's looks stop", time.Minute, func() bool { return !sess.buf.circ.running.Load() })
	st := sess.Stats()
	for _, l := range st.Lists {
		if l.Free != int32(l.Slices) || l.Parked != 0 {
			t.Errorf("at rest, the list of %d-byte slices has %d of %d slices free, %d parked", l.SliceSize, l.Free, l.Slices, l.Parked)
		}
	}
	if st.Buffer.Committed > idle+256<<10 {
		t.Errorf("at rest, %d bytes are committed; %d when idle", st.Buffer.Committed, idle)
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

// TestIdleRegionMakesNoLooks: once a region's lists have settled after
// traffic (pages given back, nothing parked or in flight), its looks stop,
// and no timer of the circulation control fires over a quiet second. The
// next traffic starts them again: a busy class gets slices parked, and
// once the traffic stops, its pages are given back and the looks stop
// again.
func TestIdleRegionMakesNoLooks(t *testing.T) {
	sess := circIdleSession(t)
	c := sess.buf.circ
	fpEcho(t, sess, []byte("hello")).Close()
	idle := sess.Stats().Buffer.Committed
	big := make([]byte, 2<<20)
	for i := range big {
		big[i] = byte(i>>12) + 1
	}
	fpEcho(t, sess, big).Close()
	circWaitRest(t, sess, idle)

	quiet := shortOr(time.Second, 300*time.Millisecond)
	before := c.looks.Load()
	time.Sleep(quiet)
	if n := c.looks.Load() - before; n != 0 {
		t.Errorf("%d looks at a region at rest in %v", n, quiet)
	}
	if c.running.Load() {
		t.Error("the looks started again with no traffic")
	}

	// Traffic in one class until it has slices parked: only a look parks.
	li := circListFor(t, sess.buf, 100<<10)
	msg := make([]byte, 100<<10)
	deadline := time.Now().Add(time.Minute) // a bound for a loaded machine
	for sess.Stats().Lists[li].Parked == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("no slice of the %d-byte class parked in a minute of traffic after the rest: %+v", sess.buf.lists[li].sliceCap, sess.Stats().Lists[li])
		}
		for range 20 {
			fpEcho(t, sess, msg).Close()
		}
	}
	if c.looks.Load() == before {
		t.Error("slices were parked with no look")
	}
	t.Logf("with traffic again: %+v", sess.Stats().Lists[li])
	circWaitRest(t, sess, idle)
}

// TestRegionWithSliceInFlightKeepsLooking: a region whose lists have
// settled while the peer holds a slice goes on looking, as the peer's
// push does not run this process's code; once the peer has pushed the
// slice back, its pages are given back and the looks stop.
func TestRegionWithSliceInFlightKeepsLooking(t *testing.T) {
	sess := circIdleSession(t)
	m, c := sess.buf, sess.buf.circ
	fpEcho(t, sess, []byte("hello")).Close()
	idle := sess.Stats().Buffer.Committed

	peer := regionPeer(t, m)
	pm := peer.buf
	li := circListFor(t, m, 1<<20)
	// Traffic of this process, so that the looks run while the peer
	// takes the slice.
	fpEcho(t, sess, []byte("hello")).Close()
	off, err := pm.pop(li)
	if err != nil || off == 0 {
		t.Fatalf("the peer could not pop a slice: %d, %v", off, err)
	}
	data := pm.sliceData(li, off)
	for i := range data {
		data[i] = byte(i>>12) + 1
	}
	waitUntil(t, "the lists settle", time.Minute, func() bool { return circSettled(c) })
	quiet := shortOr(time.Second, 500*time.Millisecond)
	before := c.looks.Load()
	time.Sleep(quiet)
	if !c.running.Load() || c.looks.Load() == before {
		t.Fatalf("the looks stopped while the peer holds a slice (%d looks in %v)", c.looks.Load()-before, quiet)
	}
	if got := sess.Stats().Buffer.Committed; got < idle+uint64(len(data))/2 {
		t.Errorf("%d bytes committed while the peer holds a slice it wrote %d bytes of; %d when idle", got, len(data), idle)
	}

	if err := pm.push(li, off); err != nil {
		t.Fatal(err)
	}
	circWaitRest(t, sess, idle)
}

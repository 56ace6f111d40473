package shmipc

// Hostile buffer regions: root and chain offsets that point outside the
// region, off a slice boundary or onto headers; chains with cycles; slice
// headers whose cap, start or size do not fit; free lists whose head, tail
// or links lead outside their list. Both victims face the same cases. And a
// peer that puts a slice this process holds on a free list.

import (
	"encoding/binary"
	"errors"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/shm"
)

func hpRoot(off func(c *hpCtx) uint32) func(c *hpCtx) {
	return func(c *hpCtx) { c.publish(c.id, off(c), shm.StatusOpened) }
}

// hpSlice builds a valid message, lets damage change its slice header and
// publishes it.
func hpSlice(damage func(c *hpCtx, a uint32)) func(c *hpCtx) {
	return func(c *hpCtx) {
		a := c.p.msg("payload")
		damage(c, a)
		c.publish(c.id, a, shm.StatusOpened)
	}
}

// hpBufferCases are the buffer-region corruptions both victims face.
func hpBufferCases() []hpCase {
	const huge = 0xFFFFFF00
	return []hpCase{
		{name: "root offset past the region end", want: []string{"offset"},
			do: hpRoot(func(c *hpCtx) uint32 { return uint32(len(c.p.buf)) + 4096 })},
		{name: "root offset 0xFFFFFFF0", want: []string{"offset"},
			do: hpRoot(func(c *hpCtx) uint32 { return 0xFFFFFFF0 })},
		{name: "root offset in the last 8 bytes of the region", want: []string{"offset"},
			do: hpRoot(func(c *hpCtx) uint32 { return uint32(len(c.p.buf)) - 8 })},
		{name: "root offset in the unused tail", want: []string{"offset"},
			do: hpRoot(func(c *hpCtx) uint32 { l := c.p.list(len(c.p.bm.Lists()) - 1); return l.end() })},
		{name: "root offset misaligned by 4", want: []string{"offset"},
			do: hpRoot(func(c *hpCtx) uint32 { return c.p.msg("x") + 4 })},
		{name: "root offset one byte into a slice", want: []string{"offset"},
			do: hpRoot(func(c *hpCtx) uint32 { return c.p.msg("x") + 1 })},
		{name: "root offset on a list header", want: []string{"offset"},
			do: hpRoot(func(c *hpCtx) uint32 { return c.p.list(1).header })},
		{name: "root offset on the manager header", want: []string{"offset"},
			do: hpRoot(func(c *hpCtx) uint32 { return 4 })},
		{name: "root offset 0", want: []string{"offset", "0"},
			do: hpRoot(func(c *hpCtx) uint32 { return 0 })},
		{name: "chain next past the region", want: []string{"offset"},
			do: hpSlice(func(c *hpCtx, a uint32) { c.p.link(a, huge) })},
		{name: "chain next misaligned", want: []string{"offset"},
			do: hpSlice(func(c *hpCtx, a uint32) { c.p.link(a, c.p.msg("b")+8) })},
		{name: "chain next on a list header", want: []string{"offset"},
			do: hpSlice(func(c *hpCtx, a uint32) { c.p.link(a, c.p.list(2).header) })},
		{name: "chain cycle A-B-A", want: []string{"cycle"},
			do: hpSlice(func(c *hpCtx, a uint32) {
				b := c.p.msg("second")
				c.p.link(a, b)
				c.p.link(b, a)
			})},
		{name: "chain self-loop", want: []string{"cycle"},
			do: hpSlice(func(c *hpCtx, a uint32) { c.p.link(a, a) })},
		{name: "slice cap matching no list", want: []string{"cap", "1234"},
			do: hpSlice(func(c *hpCtx, a uint32) { c.p.setU32(a+sliceCapOff, 1234) })},
		{name: "slice cap of another list", want: []string{"cap"},
			do: hpSlice(func(c *hpCtx, a uint32) { c.p.setU32(a+sliceCapOff, c.p.list(1).sliceCap) })},
		{name: "slice size beyond cap", want: []string{"size", "cap"},
			do: hpSlice(func(c *hpCtx, a uint32) { c.p.setU32(a+sliceSizeOff, c.p.list(0).sliceCap+1) })},
		{name: "slice size 0xFFFFFFFF", want: []string{"size", "cap"},
			do: hpSlice(func(c *hpCtx, a uint32) { c.p.setU32(a+sliceSizeOff, 0xFFFFFFFF) })},
		{name: "slice start+size beyond cap", want: []string{"start", "cap"},
			do: hpSlice(func(c *hpCtx, a uint32) {
				c.p.setU32(a+sliceStartOff, c.p.list(0).sliceCap-2)
				c.p.setU32(a+sliceSizeOff, 5)
			})},
		{name: "slice start+size overflowing 32 bits", want: []string{"start", "cap"},
			do: hpSlice(func(c *hpCtx, a uint32) {
				c.p.setU32(a+sliceStartOff, 0xFFFFFFFF)
				c.p.setU32(a+sliceSizeOff, 2)
			})},
		{name: "second slice of a chain with size beyond cap", want: []string{"size", "cap"},
			do: hpSlice(func(c *hpCtx, a uint32) {
				b := c.p.msg("second")
				c.p.link(a, b)
				c.p.setU32(b+sliceSizeOff, 1<<20)
			})},
		{name: "free list head outside the list", want: []string{"head", "not a slice"},
			do: func(c *hpCtx) {
				c.provokeSend(func() { c.p.setU32(c.p.list(0).header+listHeadOff, huge) })
			}},
		{name: "free list head misaligned", want: []string{"head", "not a slice"},
			do: func(c *hpCtx) {
				c.provokeSend(func() {
					h := c.p.list(0).header + listHeadOff
					c.p.setU32(h, c.p.u32(h)+4)
				})
			}},
		{name: "free slice next outside the list", want: []string{"links", "not a slice"},
			do: func(c *hpCtx) {
				c.provokeSend(func() {
					l := c.p.list(0)
					head := c.p.u32(l.header + listHeadOff)
					c.p.setU32(l.area+head+sliceNextOff, huge)
				})
			}},
		{name: "free slice next misaligned", want: []string{"links", "not a slice"},
			do: func(c *hpCtx) {
				c.provokeSend(func() {
					l := c.p.list(0)
					head := c.p.u32(l.header + listHeadOff)
					c.p.setU32(l.area+head+sliceNextOff, l.stride+12)
				})
			}},
		{name: "free list tail outside the list (victim frees into it)", want: []string{"tail", "not a slice"},
			do: func(c *hpCtx) {
				// Two slices: the victim's stream may keep one for its
				// next message (reuse.go), and frees the other.
				off, next := c.p.msg("freed by"), c.p.msg(" the victim")
				c.p.link(off, next)
				c.p.setU32(c.p.list(0).header+listTailOff, huge)
				c.publish(c.id, off, shm.StatusOpened)
			}},
		// The library reads these fields once, at mapping time; rewriting
		// them later must change nothing.
		{name: "list count and slice size fields rewritten", survive: hpSurviveRoundTrip,
			do: func(c *hpCtx) {
				for i := range c.p.bm.Lists() {
					h := c.p.list(i).header
					c.p.setU32(h+listCountOff, 0xFFFFFFFF)
					c.p.setU32(h+listCapOff, 3)
				}
				c.p.setU32(0, 0xFFFF)
				c.p.setU32(4, 0xFFFFFFFF)
			}},
	}
}

func TestHostileClientBuffer(t *testing.T) {
	hpAgainstServer(t, hpBufferCases())
}

func TestHostileServerBuffer(t *testing.T) {
	hpAgainstClient(t, hpBufferCases())
}

// TestFreeListHeldSlice: the peer publishes a message, which the victim's
// reader holds in place (Peek), and then links that same slice at the head
// of its free list. The victim's next writer pops it: the pop must see that
// the slice is one this process holds, and end the session with
// ErrProtocol, instead of writing its message over the bytes its reader
// holds (and freeing the slice twice later).
func TestFreeListHeldSlice(t *testing.T) {
	p, victim := acceptRawVictim(t, MemMapTypeMemFd, 0)
	defer victim.Close()
	st := openPinged(t, p, victim)
	const li = 0 // the smallest slices: what a short message takes
	const data = "bytes the reader holds"
	off := p.msgIn(li, data)
	p.publish(st.ID(), off, shm.StatusOpened)
	view, err := st.BufferReader().Peek(len(data)) // in place: the slice itself
	if err != nil || string(view) != data {
		t.Fatalf("Peek: %q, %v", view, err)
	}

	// Corrupt: the held slice is the free list's head, linked to the
	// slice that was the head.
	l := p.list(li)
	headAt := l.header + listHeadOff
	oldHead := p.u32(headAt)
	p.setU32(off+sliceNextOff, oldHead)
	p.buf[off+sliceFlagsOff] = flagHasNext
	p.setU32(headAt, off-l.area)

	_, werr := st.Write([]byte("a writer's own message"))
	if string(view) != data {
		t.Errorf("the bytes the reader holds changed to %q", view)
	}
	if werr == nil {
		waitUntil(t, "the victim session ends", peerTimeout, victim.IsClosed)
	}
	if err := victim.Err(); !errors.Is(err, ErrProtocol) {
		t.Errorf("victim session: %v (write: %v), want an error wrapping ErrProtocol", err, werr)
	}
}

// Attacks that publish slices this process already holds: the same message
// again while the application has not read it, or a free count that makes
// the region's bookkeeping loop.

// TestHostileReplayedMessage: a peer that publishes a message twice, the
// second time while the stream still holds the first copy unread, ends its
// session with ErrProtocol; the stream got the data once, and the server
// still serves others. Before, every copy was delivered: a peer publishing
// one slice in a loop grew the victim's heap by about 120 MiB/s.
func TestHostileReplayedMessage(t *testing.T) {
	t.Run("against a server", func(t *testing.T) {
		accepted := make(chan *Stream, 1)
		srv := isoStartServer(t, peerConfig(t, MemMapTypeMemFd, 0), func(st *Stream) { accepted <- st })
		srv.dialGood(t)
		p, _, victim := srv.connect(t, MemMapTypeMemFd)
		root := p.msgIn(0, "once")
		p.publish(2, root, shm.StatusOpened)
		var st *Stream
		select {
		case st = <-accepted:
		case <-time.After(peerTimeout):
			t.Fatal("no stream accepted")
		}
		defer st.Close()
		p.publish(2, root, shm.StatusOpened)
		expectClosedWith(t, victim, nil, []string{"published twice"})
		if n := st.BufferReader().Len(); n > len("once") {
			t.Errorf("the stream holds %d unread bytes, want at most one copy of %q", n, "once")
		}
		srv.checkGood(t)
	})
	t.Run("against a client", func(t *testing.T) {
		p, victim := acceptRawVictim(t, MemMapTypeMemFd, 0)
		st := openPinged(t, p, victim)
		root := p.msgIn(0, "reply")
		p.publish(st.ID(), root, shm.StatusOpened)
		p.publish(st.ID(), root, shm.StatusOpened)
		expectClosedWith(t, victim, nil, []string{"published twice"})
		if n := st.BufferReader().Len(); n > len("reply") {
			t.Errorf("the stream holds %d unread bytes, want at most one copy of %q", n, "reply")
		}
	})
}

// TestHostileReplayFlood: a peer keeps its queue full of elements naming
// one message of 40,000 slices, which costs the victim milliseconds each,
// and the application does not read. The session ends at the second copy,
// and Listener.CloseAll returns at once. Before, the victim held every
// copy (hundreds of MiB of heap) and CloseAll waited for the receive loop
// until the flood stopped.
func TestHostileReplayFlood(t *testing.T) {
	srv := isoStartServer(t, peerConfig(t, MemMapTypeMemFd, 0), func(st *Stream) {})
	srv.dialGood(t)
	const n = 40000
	p, victim := connectLayout(t, &srv.testServer, []shm.ListPlan{{SliceCap: 4, Count: n + 100}})
	root := longChain(t, p, 0, n)
	var stop atomic.Bool
	done := make(chan struct{})
	go func() { replayForever(p, 2, root, &stop); close(done) }()
	defer func() { stop.Store(true); <-done }()
	expectClosedWith(t, victim, nil, []string{"published twice"})
	srv.checkGood(t)
	closed := make(chan struct{})
	go func() { srv.ln.CloseAll(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(peerTimeout):
		t.Errorf("Listener.CloseAll has not returned after %v while a hostile client keeps publishing", peerTimeout)
	}
}

// TestHostileFreeCountOverflow: a server that writes a free count near
// -2³¹ into a list of the client's region, then keeps the list's head on a
// slice that links to itself, cannot make the client's circulation control
// park more slices than the list has. Before, the peak in flight it
// computed from that count overflowed, its bound on parking went
// negative, and it parked the same slice thousands of times.
func TestHostileFreeCountOverflow(t *testing.T) {
	waitsInParallel(t)
	p, victim := acceptRawVictim(t, MemMapTypeMemFd, 0)
	const li = 0
	l := p.list(li)
	a, err := p.bm.Pop(li)
	if err != nil || a == 0 {
		t.Fatalf("pop: %v", err)
	}
	rel := a - l.area
	var stop atomic.Bool
	done := make(chan struct{})
	go func() {
		defer close(done)
		for !stop.Load() {
			p.setU32(l.header+listFreeOff, uint32(int32(l.count)-(1<<31-1)+10))
			time.Sleep(2 * circulationPeriods.Look)
			for end := time.Now().Add(6 * circulationPeriods.Look); time.Now().Before(end) && !stop.Load(); {
				for range 1000 {
					p.setU32(l.header+listFreeOff, 1<<30)
					p.setU32(a+sliceNextOff, rel)
					p.setU32(a+sliceFlagsOff, flagHasNext)
					p.setU32(l.header+listHeadOff, rel)
				}
			}
		}
	}()
	defer func() { stop.Store(true); <-done }()
	// Watched for 4 s, 600 ms with -short: more than one round of the
	// server's (8 circulation periods, 400 ms).
	var parked int32
	for end := time.Now().Add(shortOr(4*time.Second, 600*time.Millisecond)); time.Now().Before(end); time.Sleep(2 * time.Millisecond) {
		parked = max(parked, victim.buf.Lists()[li].Parked)
	}
	if parked > int32(l.count) {
		t.Errorf("the client parked %d slices of a %d-slice list at once", parked, l.count)
	}
	stop.Store(true)
	<-done
	closeWithin(t, victim, peerTimeout)
}

// TestHostileFreeCountLoop: a server that makes one slice of the client's
// region a whole free list linked to itself, with a free count of 2³¹-1,
// does not keep the client giving pages back in a loop of that many pushes
// (a fallocate each) once the list is quiet: the loop is bounded by the
// slices the list has, and it is over before the session's end.
func TestHostileFreeCountLoop(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: waits out the give-back period")
	}
	p, victim := acceptRawVictim(t, MemMapTypeMemFd, 0)
	const li = 0
	l := p.list(li)
	a, err := p.bm.Pop(li)
	if err != nil || a == 0 {
		t.Fatalf("pop: %v", err)
	}
	d := p.bm.SliceData(li, a)
	for i := range d {
		d[i] = 1 // its pages are resident: there is something to give back
	}
	rel := a - l.area
	p.setU32(a+sliceNextOff, rel)
	p.setU32(a+sliceFlagsOff, flagHasNext)
	p.setU32(l.header+listHeadOff, rel)
	p.setU32(l.header+listTailOff, rel)
	p.setU32(l.header+listFreeOff, 1<<31-1)
	time.Sleep(circulationPeriods.GiveBack + 500*time.Millisecond)
	closeWithin(t, victim, peerTimeout)
	// 2³¹ pushes and fallocates would take hours; a bounded loop ends in
	// milliseconds. The bound is for a loaded machine.
	deadline := time.Now().Add(30 * time.Second)
	for stacksMention("giveBackList") {
		if time.Now().After(deadline) {
			t.Fatalf("30 s after its only session closed, the client still gives pages back:\n%s", stacksMentioning("giveBackList"))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// replayForever keeps p's victim's receive queue full of data elements for
// stream id that all name the message at root, waking the victim as a
// correct producer does, until stop is set.
func replayForever(p *rawPeer, id, root uint32, stop *atomic.Bool) {
	q := p.send
	for i := int64(0); i < int64(q.cap); i++ {
		s := q.slot(i)
		binary.LittleEndian.PutUint32(s[elemIDOff:], id)
		binary.LittleEndian.PutUint32(s[elemOffsetOff:], root)
		binary.LittleEndian.PutUint32(s[elemStatusOff:], shm.StatusOpened)
	}
	for !stop.Load() {
		if h, t := q.head(), q.tail(); t < h+int64(q.cap) {
			q.setTail(h + int64(q.cap))
			if q.casFlag() {
				p.poll()
			}
		}
		runtime.Gosched()
	}
}

// connectLayout connects a hostile client to env whose buffer region has
// the given lists, and returns it with the server session it got.
func connectLayout(t *testing.T, env *testServer, plans []shm.ListPlan) (*rawPeer, *Session) {
	t.Helper()
	size := (int(bufferRegionSize(plans)) + 4095) &^ 4095
	p, _, victim := connectRawClientLayout(t, env, MemMapTypeMemFd, rawLayout{bufSize: size, initBuf: func(b []byte) { shm.InitBuffer(b, plans) }})
	return p, victim
}

// longChain links n slices of list li into one message of 4-byte pieces
// and returns its root.
func longChain(t *testing.T, p *rawPeer, li, n int) uint32 {
	t.Helper()
	offs := make([]uint32, n)
	for i := range offs {
		off, err := p.bm.Pop(li)
		if err != nil || off == 0 {
			t.Fatalf("pop %d: %v", i, err)
		}
		copy(p.bm.SliceData(li, off), "abcd")
		offs[i] = off
	}
	for i := n - 1; i >= 0; i-- {
		next := uint32(0)
		if i < n-1 {
			next = offs[i+1]
		}
		p.bm.LinkSlice(offs[i], 4, next)
	}
	return offs[0]
}

// stacksMention reports whether a goroutine's stack mentions word.
func stacksMention(word string) bool { return stacksMentioning(word) != "" }

// stacksMentioning returns the stacks of the goroutines that mention word.
func stacksMentioning(word string) string {
	b := make([]byte, 1<<20)
	var out []string
	for _, g := range strings.Split(string(b[:runtime.Stack(b, true)]), "\n\n") {
		if strings.Contains(g, word) {
			out = append(out, g)
		}
	}
	return strings.Join(out, "\n\n")
}

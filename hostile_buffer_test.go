package shmipc

// Hostile buffer regions: root and chain offsets that point outside the
// region, off a slice boundary or onto headers; chains with cycles; slice
// headers whose cap, start or size do not fit; free lists whose head, tail
// or links lead outside their list. Both victims face the same cases. And a
// peer that puts a slice this process holds on a free list.

import (
	"errors"
	"testing"

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

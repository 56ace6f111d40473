package shmipc

// A peer that puts a slice this process holds on a free list.

import (
	"errors"
	"testing"
)

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
	p.publish(st.ID(), off, statusOpened)
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

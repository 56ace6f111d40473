package shmipc

import (
	"bytes"
	"sync/atomic"
	"testing"
)

// A writer that finds the large lists empty splits its message over
// smaller slices, but not into slices far smaller than the message.
func TestAllocSplitsNoFinerThanAnEighth(t *testing.T) {
	sess, _ := bpPair(t, sqRegion())
	m := sess.buf
	small, large := m.bySize[0], m.bySize[1]
	// Take every large slice that can be handed out.
	var held []uint32
	for {
		li, off, err := m.alloc(sqSize, false, false)
		if err != nil {
			t.Fatal(err)
		}
		if li < 0 {
			break
		}
		if li != large {
			t.Fatalf("a contiguous %d bytes came from list %d", sqSize, li)
		}
		held = append(held, off)
	}
	if len(held) == 0 {
		t.Fatal("no large slice could be taken")
	}
	smallCap := int(m.lists[small].sliceCap)
	for _, tc := range []struct {
		n    int
		want int // list, -1 for none
	}{
		{sqSize, -1},                          // 4 KiB is 1/64 of it
		{maxSplitPieces * smallCap, small},    // exactly an eighth
		{maxSplitPieces * (smallCap + 1), -1}, // just over
		{smallCap / 2, small},
	} {
		li, off, err := m.alloc(tc.n, true, false)
		if err != nil {
			t.Fatal(err)
		}
		if li != tc.want {
			t.Errorf("alloc(%d, split) took list %d, want %d", tc.n, li, tc.want)
		}
		if li >= 0 {
			if err := m.push(li, off); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, off := range held {
		if err := m.push(large, off); err != nil {
			t.Fatal(err)
		}
	}
}

const splitEchoRole = "split-echo"

// Echoes between two processes that need more large slices than the
// region has, written with WriteBytes, which may split a message over
// smaller slices. Split into 4 KiB slices (64 per message), the messages
// used to hold parts of the region while their writers waited for the
// rest, until the writers gave up and sent over the socket; split no
// finer than an eighth, a writer waits for a large slice instead, and
// every exchange stays in shared memory.
func TestSplitEchoesStayInSharedMemory(t *testing.T) {
	c, sess := sqDialChild(t, "TestSpaceQueueEchoChild", splitEchoRole, sqRegion())
	const (
		streams = 16
		rounds  = 30
	)
	sqEchoStreams(t, sess, streams, rounds, func(st *Stream, msg []byte) error {
		_, err := st.BufferWriter().WriteBytes(msg) // may split it over slices
		return err
	})
	if fb := sess.Stats().FallbackMessagesOut; fb != 0 {
		t.Errorf("the client sent %d messages as fallback data, want 0", fb)
	}
	sqCheckServerFallbacks(t, c)
}

// A writer that holds nothing begins a message that needs several slices
// only when the lists it may split it over have room for all of it beyond
// their reserves; once it holds the first slice it may take the reserves.
func TestAllocBeginsSplitMessageOnlyWithRoomForAll(t *testing.T) {
	const small, big = 128 << 10, 1 << 20
	conf := DefaultConfig()
	conf.ShareMemoryBufferCap = 16 << 20
	conf.BufferSliceSizes = []SizePercentPair{{Size: small, Percent: 50}, {Size: big, Percent: 50}}
	sess, _ := bpPair(t, conf)
	m := sess.buf
	if m.circ == nil {
		t.Fatal("the dialling side did not create the region")
	}
	sl, bl := m.bySize[0], m.bySize[1]
	spare := func() int32 {
		l := &m.lists[sl]
		return atomic.LoadInt32(m.i32(l.header+listFreeOff)) + m.circ.lists[sl].parked.Load() - l.reserve - 1
	}
	type held struct {
		li  int
		off uint32
	}
	var taken []held
	t.Cleanup(func() {
		for _, h := range taken {
			if err := m.push(h.li, h.off); err != nil {
				t.Error(err)
			}
		}
	})
	take := func(n int, split bool) int {
		li, off, err := m.alloc(n, split, false)
		if err != nil {
			t.Fatal(err)
		}
		if li >= 0 {
			taken = append(taken, held{li, off})
		}
		return li
	}
	for take(big, false) == bl { // every big slice
	}
	for spare() > 4 {
		if take(small, false) != sl {
			t.Fatal("no small slice left")
		}
	}
	// Room for 4 small slices: half of a big message.
	li, off, err := m.alloc(big, true, true)
	if err != nil || li >= 0 {
		if li >= 0 {
			taken = append(taken, held{li, off})
		}
		t.Fatalf("a writer holding nothing began a %d-byte message with room for %d: list %d, %v", big, 4*m.lists[sl].sliceCap, li, err)
	}
	if li, off, err = m.alloc(4*int(m.lists[sl].sliceCap), true, true); err != nil || li != sl {
		t.Fatalf("a message that fits the room: list %d, %v", li, err)
	}
	taken = append(taken, held{li, off})
	// A writer that holds slices takes the rest, reserve included.
	for take(big, true) == sl {
	}
	if got, want := spare(), -m.lists[sl].reserve; got != want {
		t.Fatalf("a writer holding slices left %d spare slices, want %d (none of the reserve)", got, want)
	}
}

// A message that fits one slice of the largest size is never sent as
// fallback data for being too large to split, even when the region has
// only two slices of that size.
func TestMessageWithinLargestSliceStaysInSharedMemory(t *testing.T) {
	const big = 256 << 10
	sess, accepted := twoClassPair(t, big, 30, 2, nil)
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	msg := bytes.Repeat([]byte("w"), big*6/10)
	if _, err := st.BufferWriter().WriteBytes(msg); err != nil {
		t.Fatal(err)
	}
	if err := st.Flush(false); err != nil {
		t.Fatal(err)
	}
	srv := <-accepted
	defer srv.Close()
	got, err := srv.BufferReader().ReadBytes(len(msg))
	if err != nil || !bytes.Equal(got, msg) {
		t.Fatalf("the message arrived as %d bytes, %v", len(got), err)
	}
	if fb := sess.Stats().FallbackMessagesOut; fb != 0 {
		t.Errorf("%d messages went as fallback data, want 0", fb)
	}
}

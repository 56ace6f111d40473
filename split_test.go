package shmipc

import (
	"bytes"
	"testing"
)

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

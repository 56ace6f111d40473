package shmipc

import (
	"bytes"
	"io"
	"testing"
	"time"
)

// An echo that holds a large request (read in place, not yet released)
// while it reserves its reply must not wait for the slices it holds itself:
// with no other slice of the large class free, the reply goes as fallback
// data at once instead of failing after WriteSpaceTimeout.
func TestReserveWhileHoldingRequest(t *testing.T) {
	const size = 256 << 10
	conf := DefaultConfig()
	conf.ShareMemoryBufferCap = 2 << 20
	conf.BufferSliceSizes = []SizePercentPair{{Size: 4096, Percent: 50}, {Size: size, Percent: 50}}
	conf.WriteSpaceTimeout = 5 * time.Second
	sess, accepted := bpPair(t, conf)

	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	// The last slice of a list is never handed out: of three, two can be.
	if l := sess.Stats().Lists; len(l) != 2 || l[1].Slices != 3 {
		t.Fatalf("lists %+v: want three slices of %d bytes", l, size)
	}
	// Another stream takes one of them, so the request holds the other.
	other, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if _, err := other.BufferWriter().Reserve(size); err != nil {
		t.Fatal(err)
	}
	req := bytes.Repeat([]byte("q"), size)
	w := st.BufferWriter()
	p, err := w.Reserve(size)
	if err != nil {
		t.Fatal(err)
	}
	copy(p, req)
	if err := st.Flush(false); err != nil {
		t.Fatal(err)
	}

	srv := <-accepted
	defer srv.Close()
	got, err := srv.BufferReader().ReadBytes(size) // held: points into the slice
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	reply, err := srv.BufferWriter().Reserve(size)
	if err != nil {
		t.Fatalf("Reserve while holding the request: %v (after %v)", err, time.Since(start).Round(time.Millisecond))
	}
	if waited := time.Since(start); waited > conf.WriteSpaceTimeout/2 {
		t.Fatalf("Reserve waited %v for slices its own stream holds", waited)
	}
	copy(reply, got)
	srv.BufferReader().ReleasePreviousRead()
	if err := srv.Flush(false); err != nil {
		t.Fatal(err)
	}
	back := make([]byte, size)
	if _, err := io.ReadFull(st, back); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(back, req) {
		t.Fatal("the echo differs from the request")
	}
	if fb := srv.Session().Stats().FallbackMessagesOut; fb != 1 {
		t.Fatalf("server sent %d fallback messages, want the reply as 1", fb)
	}
}

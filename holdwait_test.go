package shmipc

import (
	"bytes"
	"io"
	"testing"
	"time"
)

// hwSize is the large slice size of hwRequest's region.
const hwSize = 256 << 10

// hwRequest sets up a region whose large class has two slices that can be
// handed out, takes one of them on another stream (other, which the caller
// closes to free it), and sends a request of hwSize bytes in the other on
// st. It returns the server's stream with the request.
func hwRequest(t *testing.T, writeTimeout time.Duration) (st, other, srv *Stream, req []byte) {
	t.Helper()
	// The last slice of a list is never handed out: of three, two can be.
	sess, accepted := twoClassPair(t, hwSize, 50, 3, func(c *Config) { c.WriteSpaceTimeout = writeTimeout })
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	if other, err = sess.OpenStream(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { other.Close() })
	if _, err := other.BufferWriter().Reserve(hwSize); err != nil {
		t.Fatal(err)
	}
	req = bytes.Repeat([]byte("q"), hwSize)
	p, err := st.BufferWriter().Reserve(hwSize)
	if err != nil {
		t.Fatal(err)
	}
	copy(p, req)
	if err := st.Flush(false); err != nil {
		t.Fatal(err)
	}
	srv = <-accepted
	t.Cleanup(func() { srv.Close() })
	return st, other, srv, req
}

// hwExpectEcho reads the reply on st, compares it with req, and checks how
// many messages the server sent as fallback data.
func hwExpectEcho(t *testing.T, st, srv *Stream, req []byte, fallbacks uint64) {
	t.Helper()
	back := make([]byte, len(req))
	if _, err := io.ReadFull(st, back); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(back, req) {
		t.Fatal("the echo differs from the request")
	}
	if fb := srv.Session().Stats().FallbackMessagesOut; fb != fallbacks {
		t.Fatalf("server sent %d fallback messages, want %d", fb, fallbacks)
	}
}

// An echo that holds a large request (read in place, not yet released)
// while it reserves its reply must not wait for the slices it holds itself:
// with no other slice of the large class free, the reply goes as fallback
// data at once instead of failing after WriteSpaceTimeout.
func TestReserveWhileHoldingRequest(t *testing.T) {
	const writeTimeout = 5 * time.Second
	st, _, srv, req := hwRequest(t, writeTimeout)
	got, err := srv.BufferReader().ReadBytes(hwSize) // held: points into the slice
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	reply, err := srv.BufferWriter().Reserve(hwSize)
	if err != nil {
		t.Fatalf("Reserve while holding the request: %v (after %v)", err, time.Since(start).Round(time.Millisecond))
	}
	if waited := time.Since(start); waited > writeTimeout/2 {
		t.Fatalf("Reserve waited %v for slices its own stream holds", waited)
	}
	copy(reply, got)
	srv.BufferReader().ReleasePreviousRead()
	if err := srv.Flush(false); err != nil {
		t.Fatal(err)
	}
	hwExpectEcho(t, st, srv, req, 1) // the reply, as fallback data
}

// A writer whose stream has received data it has not read yet waits for
// space rather than sending fallback data: on a full-duplex stream (gRPC's)
// another goroutine reads and frees that data, and a fallback message would
// turn the stream to fallback data for good.
func TestWriteWaitsWhileDataUnread(t *testing.T) {
	st, other, srv, req := hwRequest(t, 10*time.Second)
	waitUntil(t, "the request reached the server stream", 10*time.Second, func() bool { return srv.BufferReader().Len() == hwSize })

	// The slice is freed after hold (100 ms with -short): a Reserve that
	// did not wait for it would return at once, as fallback data.
	hold := shortOr(200*time.Millisecond, 100*time.Millisecond)
	start := time.Now()
	go func() {
		time.Sleep(hold)
		other.Close() // frees its slice
	}()
	reply, err := srv.BufferWriter().Reserve(hwSize) // the request is still unread
	if err != nil {
		t.Fatalf("Reserve with the request unread: %v", err)
	}
	if waited := time.Since(start); waited < hold/2 {
		t.Fatalf("Reserve returned after %v, before any slice was freed", waited)
	}
	copy(reply, req)
	if err := srv.Flush(false); err != nil {
		t.Fatal(err)
	}
	hwExpectEcho(t, st, srv, req, 0) // it waited for space
}

// A writer that holds part of its message when the region runs short waits
// briefly (heldSpaceWait) for more before the rest goes as fallback data,
// which would turn its stream to fallback data for good: a slice freed
// meanwhile keeps the message, and the stream, in shared memory. When
// nothing is freed, the message goes as fallback data after the wait.
func TestWriterHoldingPartWaitsBriefly(t *testing.T) {
	const big = 256 << 10
	conf := DefaultConfig()
	conf.ShareMemoryBufferCap = 4 << 20
	conf.BufferSliceSizes = []SizePercentPair{{Size: 4096, Percent: 2}, {Size: big, Percent: 98}}
	sess, accepted := bpPair(t, conf)
	lists := sess.Stats().Lists
	if len(lists) != 2 {
		t.Fatalf("lists %+v", lists)
	}
	msg := bytes.Repeat([]byte("m"), 4*big) // needs more than the free big slices can hold
	// A slice is freed heldSpaceWait/5 after the write begins; on a loaded
	// machine that can come after the whole wait, and falling back then is
	// right: such a round is run again.
	rounds, again := []bool{true, false}, 0
	for len(rounds) > 0 {
		free := rounds[0]
		rounds = rounds[1:]
		st, err := sess.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Write([]byte{1}); err != nil {
			t.Fatal(err)
		}
		srv := <-accepted
		if _, err := io.ReadFull(srv, make([]byte, 1)); err != nil {
			t.Fatal(err)
		}
		// Streams of the client take all big slices but four. The writer
		// is the server's stream: the side that did not create the region
		// takes any slice but the last (a writer of the creator's that
		// holds nothing would wait for room for all of its message,
		// bufferManager.roomFor), so it takes three and waits for a
		// fourth. The small slices are too small to split it over.
		var holders []*Stream
		for range lists[1].Slices - 4 {
			h, err := sess.OpenStream()
			if err != nil {
				t.Fatal(err)
			}
			if _, err := h.BufferWriter().Reserve(big); err != nil {
				t.Fatal(err)
			}
			holders = append(holders, h)
		}
		fb0 := srv.Session().Stats().FallbackMessagesOut
		start := time.Now()
		freed := make(chan time.Duration, 1)
		if free {
			go func() {
				time.Sleep(heldSpaceWait / 5)
				holders[0].Close() // a big slice comes back while the writer waits
				freed <- time.Since(start)
			}()
		}
		if _, err := srv.Write(msg); err != nil {
			t.Fatal(err)
		}
		took := time.Since(start)
		got := make([]byte, len(msg))
		if _, err := io.ReadFull(st, got); err != nil || !bytes.Equal(got, msg) {
			t.Fatalf("free=%v: the message arrived as %d bytes, %v", free, len(got), err)
		}
		fb := srv.Session().Stats().FallbackMessagesOut - fb0
		switch {
		case free && fb != 0:
			if d := <-freed; d >= heldSpaceWait {
				t.Logf("the slice came back %v after the write began, after heldSpaceWait", d)
				if again++; again < 50 {
					rounds = append(rounds, true)
				}
				break
			}
			t.Errorf("a slice freed during the wait: %d fallback messages, want none", fb)
		case !free && fb != 1:
			t.Errorf("nothing freed: %d fallback messages, want 1", fb)
		case !free && took < heldSpaceWait:
			t.Errorf("nothing freed: fell back after %v, before heldSpaceWait", took)
		}
		for _, h := range holders {
			h.Close()
		}
		st.Close()
		srv.Close()
	}
}

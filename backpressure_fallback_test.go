package shmipc

// The bounds on fallback data: what a stream and a session hold unread
// while their readers wait, hold or copy what they read, and frame sizes
// between peers with different limits.

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"
)

// TestReadBeyondFallbackBounds reads, with BufferReader.ReadBytes or Peek,
// a message sent as fallback data that is larger than the stream may hold
// unread: the bound holds for the waiting reader too, so after
// FallbackStallTimeout that stream fails with an error naming the bound,
// and the session goes on: another stream still echoes.
func TestReadBeyondFallbackBounds(t *testing.T) {
	for _, peek := range []bool{false, true} {
		t.Run(fmt.Sprintf("peek=%v", peek), func(t *testing.T) {
			conf := smallRegion()
			conf.MaxFallbackFrameSize = minFallbackFrame
			conf.MaxFallbackBufferedPerStream = 1 << 20
			conf.MaxFallbackBuffered = 2 << 20
			// Waited out: nothing reads, so a shorter stall (100 ms with
			// -short) changes only when the stream fails.
			conf.FallbackStallTimeout = shortOr(300*time.Millisecond, 100*time.Millisecond)
			sess, accepted := bpPair(t, conf)
			st, err := sess.OpenStream()
			if err != nil {
				t.Fatal(err)
			}
			defer st.Close()
			msg := make([]byte, 4<<20)
			go func() { // two messages: a flushed message goes as one frame, always taken while the stream holds none
				if _, err := st.Write(msg[:len(msg)/2]); err == nil {
					st.Write(msg[len(msg)/2:])
				}
			}()
			srv := bpAccepted(t, accepted)
			srv.SetReadDeadline(time.Now().Add(time.Minute))
			if peek {
				_, err = srv.BufferReader().Peek(len(msg))
			} else {
				_, err = srv.BufferReader().ReadBytes(len(msg))
			}
			if !errors.Is(err, ErrLimitExceeded) || !strings.Contains(err.Error(), "MaxFallbackBufferedPerStream") {
				t.Fatalf("reading %d bytes: %v; want ErrLimitExceeded naming Config.MaxFallbackBufferedPerStream", len(msg), err)
			}
			if _, err := srv.Write([]byte("x")); !errors.Is(err, ErrLimitExceeded) {
				t.Errorf("Write on the failed stream: %v, want the same error", err)
			}
			other, err := sess.OpenStream()
			if err != nil {
				t.Fatal(err)
			}
			defer other.Close()
			other.SetDeadline(time.Now().Add(peerTimeout))
			if _, err := other.Write([]byte("ping")); err != nil {
				t.Fatal(err)
			}
			o := bpAccepted(t, accepted)
			b := make([]byte, 4)
			if _, err := io.ReadFull(o, b); err != nil || string(b) != "ping" {
				t.Fatalf("another stream after the failure: %q, %v", b, err)
			}
			if err := sess.Err(); err != nil {
				t.Fatalf("session: %v", err)
			}
		})
	}
}

// bpAccepted returns the next stream the server accepted, closed when the
// test ends.
func bpAccepted(t *testing.T, accepted <-chan *Stream) *Stream {
	t.Helper()
	select {
	case st := <-accepted:
		t.Cleanup(func() { st.Close() })
		return st
	case <-time.After(peerTimeout):
		t.Fatal("no stream accepted")
		return nil
	}
}

// TestReadWhileHoldingAnEarlierRead: a reader keeps the bytes of one
// message (not released) while it reads the next; both fit the stream's
// bound together, so the receive loop takes the second while the first is
// held.
func TestReadWhileHoldingAnEarlierRead(t *testing.T) {
	conf := smallRegion()
	conf.MaxFallbackFrameSize = minFallbackFrame
	conf.MaxFallbackBufferedPerStream = 6 << 20
	conf.MaxFallbackBuffered = 8 << 20
	conf.FallbackStallTimeout = 5 * time.Second
	sess, accepted := bpPair(t, conf)
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	m1 := bytes.Repeat([]byte{1}, 5<<19) // 2.5 MiB each
	m2 := bytes.Repeat([]byte{2}, 5<<19)
	go func() {
		st.Write(m1)
		st.Write(m2)
	}()
	srv := bpAccepted(t, accepted)
	srv.SetReadDeadline(time.Now().Add(time.Minute))
	br := srv.BufferReader()
	a, err := br.ReadBytes(len(m1))
	if err != nil || !bytes.Equal(a, m1) {
		t.Fatalf("the first message: %v", err)
	}
	b, err := br.ReadBytes(len(m2)) // a is still held
	if err != nil {
		t.Fatalf("the second message while the first is held: %v", err)
	}
	if !bytes.Equal(b, m2) || !bytes.Equal(a, m1) {
		t.Fatal("the data read differs from the data written")
	}
	br.ReleasePreviousRead()
}

// TestReadBeyondSessionBoundBelowFrame: a session bound smaller than a
// frame does not wedge a stream whose application reads a message larger
// than both bounds as it arrives (Read copies, and frees what it read).
func TestReadBeyondSessionBoundBelowFrame(t *testing.T) {
	conf := smallRegion()
	conf.MaxFallbackFrameSize = minFallbackFrame
	conf.MaxFallbackBufferedPerStream = 256 << 10
	conf.MaxFallbackBuffered = 512 << 10
	conf.FallbackStallTimeout = 5 * time.Second
	sess, accepted := bpPair(t, conf)
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	msg := bytes.Repeat([]byte{7}, 3<<20)
	done := make(chan error, 1)
	go func() {
		_, err := st.Write(msg)
		done <- err
	}()
	srv := bpAccepted(t, accepted)
	srv.SetReadDeadline(time.Now().Add(time.Minute))
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(srv, got); err != nil {
		t.Fatalf("Read: %v", err)
	}
	if !bytes.Equal(got, msg) {
		t.Fatal("the data read differs from the data written")
	}
	if err := errWithin(t, done, peerTimeout, "Write"); err != nil {
		t.Fatalf("Write: %v", err)
	}
}

// TestFallbackFramesFitAnyPeer echoes messages sent as fallback data
// between peers with different MaxFallbackFrameSize: the server takes
// frames of the smallest size allowed, the client of the default size.
// Frames are sized for any peer, since neither learns the other's limit.
func TestFallbackFramesFitAnyPeer(t *testing.T) {
	srvConf := smallRegion()
	srvConf.MaxFallbackFrameSize = minFallbackFrame
	ln := startEchoListener(t, srvConf)
	s, err := Dial("unix", ln.Addr().String(), smallRegion())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	msg := bytes.Repeat([]byte("fallback"), (3<<20)/8) // more than the region: fallback data
	if err := echoRoundTrip(s, string(msg)); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.FallbackMessagesOut == 0 || st.FallbackMessagesIn < 3 {
		t.Errorf("stats %+v: want the message to go and come back as fallback frames", st)
	}
}

// TestWaitingReadersKeepFallbackBound: a reader waiting in Read for a byte
// makes no exception to the fallback bounds. Twelve streams each send a
// fallback message while their server handlers wait in Read; the session
// must hold no more than MaxFallbackBuffered plus a frame, fail the streams
// whose data nobody reads, and go on.
func TestWaitingReadersKeepFallbackBound(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: waits out the fallback stall timeout")
	}
	conf := smallRegion()
	conf.MaxFallbackFrameSize = minFallbackFrame
	conf.MaxFallbackBufferedPerStream = 1 << 20
	conf.MaxFallbackBuffered = 1 << 20
	conf.FallbackStallTimeout = 200 * time.Millisecond
	sess, accepted := bpPair(t, conf)
	block := make(chan struct{})
	defer close(block)
	var srvSess *Session
	var clients, servers []*Stream
	for range 12 {
		st, err := sess.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		if _, err := st.Write([]byte{1}); err != nil {
			t.Fatal(err)
		}
		srv := bpAccepted(t, accepted)
		srvSess = srv.Session()
		go func() {
			b := make([]byte, 1)
			srv.Read(b) // the first message
			srv.Read(b) // waits for the next
			<-block     // and does not read again
		}()
		clients = append(clients, st)
		servers = append(servers, srv)
	}
	time.Sleep(100 * time.Millisecond) // the readers wait
	for _, st := range clients {
		go st.Write(bytes.Repeat([]byte{'x'}, 900<<10)) // more than half the region: fallback
	}
	limit := int64(conf.MaxFallbackBuffered) + int64(conf.MaxFallbackFrameSize)
	failed := func() int {
		n := 0
		for _, srv := range servers {
			if srv.failed() {
				n++
			}
		}
		return n
	}
	var most int64
	waitUntil(t, "all but one of the server streams to fail", 30*time.Second, func() bool {
		most = max(most, srvSess.fallbackHeld.Load())
		return failed() >= len(servers)-1
	})
	if most > limit {
		t.Errorf("the server held %d bytes of fallback data; MaxFallbackBuffered is %d, plus a frame %d", most, conf.MaxFallbackBuffered, limit)
	}
	if err := srvSess.Err(); err != nil {
		t.Errorf("server session: %v, want it open", err)
	}
}

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
		// shm.Buffer.Alloc), so it takes three and waits for a
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

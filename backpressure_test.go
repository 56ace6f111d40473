package shmipc

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// bpPair starts a server whose streams are handed to the test, and a client
// session, both with conf.
func bpPair(t *testing.T, conf *Config) (*Session, <-chan *Stream) {
	t.Helper()
	ln, err := Listen("unix", filepath.Join(t.TempDir(), "bp.sock"), conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	accepted := make(chan *Stream, 16)
	go func() {
		for {
			st, err := ln.AcceptStream()
			if err != nil {
				return
			}
			accepted <- st
		}
	}()
	sess, err := Dial("unix", ln.Addr().String(), conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sess.Close() })
	return sess, accepted
}

// twoClassPair is bpPair over a 2 MiB region of two lists, 4 KiB slices and
// big ones (bigPercent of the region), after edit (if not nil) changes the
// configuration further. It checks that the list of big slices has
// bigSlices of them.
func twoClassPair(t *testing.T, big, bigPercent, bigSlices uint32, edit func(*Config)) (*Session, <-chan *Stream) {
	t.Helper()
	conf := DefaultConfig()
	conf.ShareMemoryBufferCap = 2 << 20
	conf.BufferSliceSizes = []SizePercentPair{{Size: 4096, Percent: 100 - bigPercent}, {Size: big, Percent: bigPercent}}
	if edit != nil {
		edit(conf)
	}
	sess, accepted := bpPair(t, conf)
	if l := sess.Stats().Lists; len(l) != 2 || l[1].Slices != bigSlices {
		t.Fatalf("lists %+v: want %d slices of %d bytes", l, bigSlices, big)
	}
	return sess, accepted
}

func smallRegion() *Config {
	conf := DefaultConfig()
	conf.ShareMemoryBufferCap = 1 << 20
	conf.BufferSliceSizes = []SizePercentPair{{Size: 4096, Percent: 100}}
	conf.QueueCap = 16
	return conf
}

func assertTimeout(t *testing.T, err error, what string) {
	t.Helper()
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("%s: %v is not a net.Error timeout", what, err)
	}
	if _, ok := err.(net.Error); !ok {
		t.Fatalf("%s: %T does not itself implement net.Error", what, err)
	}
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("%s: %v does not match os.ErrDeadlineExceeded", what, err)
	}
}

// TestBackPressureRegionFull fills the buffer region with messages the peer
// does not read. The next write waits for room until its deadline and then
// fails with a timeout; once the peer reads, writes go through again, and
// every byte arrives in order.
func TestBackPressureRegionFull(t *testing.T) {
	sess, accepted := bpPair(t, smallRegion())
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	msg := bytes.Repeat([]byte{7}, 4000)
	var sent bytes.Buffer
	st.SetWriteDeadline(time.Now().Add(10 * time.Second))
	// The region holds 254 slices of 4 KiB and one is never handed out.
	// The last write waits out its deadline: 100 ms with -short.
	deadline := shortOr(300*time.Millisecond, 100*time.Millisecond)
	var werr error
	for i := 0; i < 300 && werr == nil; i++ {
		start := time.Now()
		st.SetWriteDeadline(start.Add(deadline))
		msg[0] = byte(i)
		if _, werr = st.Write(msg); werr == nil {
			sent.Write(msg)
		} else if time.Since(start) < deadline {
			t.Fatalf("write %d failed after %v without waiting for its deadline: %v", i, time.Since(start), werr)
		}
	}
	if werr == nil {
		t.Fatal("300 unread 4000-byte messages fitted in a 1 MiB region")
	}
	assertTimeout(t, werr, "write into a full region")
	if st.fallback.Load() {
		t.Fatal("the stream switched to fallback data instead of waiting")
	}

	srv := <-accepted
	defer srv.Close()
	got := make([]byte, sent.Len())
	srv.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(srv, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, sent.Bytes()) {
		t.Fatal("the bytes written before the timeout arrived changed")
	}
	t.Logf("free counts after the peer read: %v", sess.buf.freeCounts())
	// The region has room again.
	st.SetWriteDeadline(time.Now().Add(5 * time.Second))
	msg[0] = 0xEE
	if _, err := st.Write(msg); err != nil {
		t.Fatalf("write after the peer read: %v", err)
	}
	if _, err := io.ReadFull(srv, got[:len(msg)]); err != nil || !bytes.Equal(got[:len(msg)], msg) {
		t.Fatalf("message after the timeout: %v", err)
	}
}

// TestBackPressureQueueFull fills the peer's IO queue (capacity 16) with
// small messages while its receiver is blocked, so that nothing drains it:
// the write waits, then fails with a timeout that wraps ErrQueueFull.
func TestBackPressureQueueFull(t *testing.T) {
	conf := smallRegion()
	conf.WriteSpaceTimeout = shortOr(300*time.Millisecond, 100*time.Millisecond) // waited out
	conf.ConsumerSpinTime = 0
	sess, accepted := bpPair(t, conf)
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := st.Write([]byte("first")); err != nil {
		t.Fatal(err)
	}
	srv := <-accepted
	defer srv.Close()
	// Stall the server's receive loop, the queue's only consumer.
	release := holdReceive(t, srv.s)
	var werr error
	for i := 0; i < 40 && werr == nil; i++ {
		_, werr = st.Write([]byte("x"))
	}
	release()
	if werr == nil {
		t.Fatal("40 messages fitted in a queue of 16")
	}
	assertTimeout(t, werr, "write into a full queue")
	if !errors.Is(werr, ErrQueueFull) {
		t.Fatalf("%v does not wrap ErrQueueFull", werr)
	}
}

// TestFallbackWhenFull checks the other policy: with no room in the region,
// messages go as fallback data at once, and arrive intact.
func TestFallbackWhenFull(t *testing.T) {
	conf := smallRegion()
	conf.FallbackWhenFull = true
	sess, accepted := bpPair(t, conf)
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	var sent bytes.Buffer
	msg := make([]byte, 4000)
	for i := range 300 {
		msg[0], msg[1] = byte(i), byte(i>>8)
		st.SetWriteDeadline(time.Now().Add(5 * time.Second))
		if _, err := st.Write(msg); err != nil {
			t.Fatalf("write %d: %v", i, err)
		}
		sent.Write(msg)
	}
	if !st.fallback.Load() {
		t.Fatal("300 unread messages in a 1 MiB region did not fall back")
	}
	srv := <-accepted
	defer srv.Close()
	got := make([]byte, sent.Len())
	srv.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(srv, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, sent.Bytes()) {
		t.Fatal("bytes differ across the switch to fallback data")
	}
}

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

// hostileFlood has the raw peer p send count frames of a frame's worth to
// each stream of ids, while the test watches how much fallback data the
// victim holds, until the writes are done or 30 s pass.
func hostileFlood(t *testing.T, p *rawPeer, victim *Session, ids []uint32, count int) (most int64) {
	data := strings.Repeat("x", minFallbackFrame-16)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range count {
			for _, id := range ids {
				p.conn.SetWriteDeadline(time.Now().Add(peerTimeout))
				if _, err := p.conn.Write(rawFallbackFrame(p.version, 0, id, 0, data)); err != nil {
					return
				}
			}
		}
	}()
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); {
		most = max(most, victim.fallbackHeld.Load())
		select {
		case <-done:
			return most
		case <-time.After(time.Millisecond):
		}
	}
	t.Fatal("the flood's writes still blocked after 30 s")
	return most
}

// hostileVictim is a client session of a raw server, with fallback bounds
// perStream and session and frames of at most minFallbackFrame. Its
// readers never make room, so every stall is waited out: the stall timeout
// is short (50 ms with -short), which changes how long each stall lasts,
// not what the session holds meanwhile.
func hostileVictim(t *testing.T, perStream, session int) (*rawPeer, *Session) {
	t.Helper()
	return acceptRawVictimWith(t, MemMapTypeDevShmFile, defaultConsumerSpinTime, func(c *Config) {
		c.MaxFallbackFrameSize = minFallbackFrame
		c.MaxFallbackBufferedPerStream = perStream
		c.MaxFallbackBuffered = session
		c.FallbackStallTimeout = shortOr(200*time.Millisecond, 50*time.Millisecond)
	})
}

// TestHostileFramesForWaitingReaders: a peer sends frames as large as the
// session accepts to streams whose readers wait: readers that each want a
// header or a byte, one scanning for a delimiter (netpoll Until, which
// waits for one byte more each time), one reading byte by byte and
// releasing only at the end of a line. None of them gets an exception from
// the bounds for that: the session holds at most its bound and a frame,
// the streams nobody makes room on fail with ErrLimitExceeded, and the
// session goes on.
func TestHostileFramesForWaitingReaders(t *testing.T) {
	for _, tc := range []struct {
		name               string
		perStream, session int
		streams, frames    int
		read               func(st *Stream)
	}{
		{"ReadBytes of a header", 512 << 10, 1 << 20, 8, 1, func(st *Stream) { st.BufferReader().ReadBytes(32) }},
		{"Read, bounds below a frame", 256 << 10, 512 << 10, 8, 1, func(st *Stream) { st.Read(make([]byte, 1)) }},
		{"Until", 1 << 20, 2 << 20, 1, 8, func(st *Stream) { st.NetpollReader().Until('\n') }},
		{"ReadByte, released at a newline", 1 << 20, 2 << 20, 1, 8, func(st *Stream) {
			r := st.NetpollReader()
			for {
				c, err := r.ReadByte()
				if err != nil {
					return
				}
				if c == '\n' {
					r.Release()
				}
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if testing.Short() && tc.name != "ReadBytes of a header" && tc.name != "Until" {
				t.Skip("-short: a reader of each kind")
			}
			// The cases run beside each other: each has a raw server and
			// a victim of its own (own region files), and they use no
			// process-global state.
			t.Parallel()
			p, victim := hostileVictim(t, tc.perStream, tc.session)
			defer victim.Close()
			block := make(chan struct{})
			defer close(block)
			var streams []*Stream
			var ids []uint32
			// With -short, at most 3 streams and 3 frames a stream (each
			// frame is 32 MiB): every frame past the first still finds a
			// bound full, waits out a stall and fails a stream.
			for range shortOr(tc.streams, min(tc.streams, 3)) {
				st := openPinged(t, p, victim)
				st.SetDeadline(time.Time{})
				streams = append(streams, st)
				ids = append(ids, st.ID())
				go func() {
					tc.read(st)
					<-block // and never reads again
				}()
			}
			waitBlocked(t, "(*Stream).awaitReadable", len(streams)) // the readers wait
			limit := int64(tc.session) + minFallbackFrame
			if most := hostileFlood(t, p, victim, ids, shortOr(tc.frames, min(tc.frames, 3))); most > limit {
				t.Errorf("the session held %d bytes of fallback data; MaxFallbackBuffered and a frame are %d", most, limit)
			}
			failed := 0
			for _, st := range streams {
				if err := st.failure(); err != nil {
					if !errors.Is(err, ErrLimitExceeded) || !strings.Contains(err.Error(), "Config.MaxFallbackBuffered") {
						t.Errorf("stream %d failed with %v, want ErrLimitExceeded naming a bound", st.ID(), err)
					}
					failed++
				}
			}
			if failed == 0 {
				t.Error("no stream failed")
			}
			if err := victim.Err(); err != nil {
				t.Errorf("session: %v, want it open", err)
			}
			openPinged(t, p, victim) // the session still carries new streams
		})
	}
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

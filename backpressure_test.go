package shmipc

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
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
	var werr error
	for i := 0; i < 300 && werr == nil; i++ {
		st.SetWriteDeadline(time.Now().Add(300 * time.Millisecond))
		msg[0] = byte(i)
		start := time.Now()
		if _, werr = st.Write(msg); werr == nil {
			sent.Write(msg)
		} else if time.Since(start) < 250*time.Millisecond {
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
	conf.WriteSpaceTimeout = 300 * time.Millisecond
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
	// Stall every consumer of the server's queue: its receive loop, and
	// the client's writer, which drains the queue itself when both ends
	// are in one process (drainForPeer), wait for the consumer token.
	srv.s.sealConsumer()
	var werr error
	for i := 0; i < 40 && werr == nil; i++ {
		_, werr = st.Write([]byte("x"))
	}
	srv.s.cons.token.Store(false)
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
// a message sent as fallback data that is larger than the session may hold
// unread: the receive loop takes the data for the waiting reader, where it
// would otherwise stop reading until the application made room while the
// application waited for the data, until FallbackStallTimeout ended the
// session. The last case holds the session's bound with another stream's
// unread data first.
func TestReadBeyondFallbackBounds(t *testing.T) {
	for _, tc := range []struct {
		name       string
		peek       bool
		otherHolds bool
	}{
		{"ReadBytes", false, false},
		{"Peek", true, false},
		{"session bound held by another stream", false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conf := smallRegion()
			conf.MaxFallbackFrameSize = minFallbackFrame
			conf.MaxFallbackBufferedPerStream = 1 << 20
			conf.MaxFallbackBuffered = 1 << 20
			conf.FallbackStallTimeout = 5 * time.Second // only a failing run waits for it
			sess, accepted := bpPair(t, conf)
			write := func(msg []byte) (*Stream, <-chan error) {
				st, err := sess.OpenStream()
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { st.Close() })
				done := make(chan error, 1)
				go func() {
					_, err := st.Write(msg)
					done <- err
				}()
				return st, done
			}
			receive := func() *Stream {
				select {
				case st := <-accepted:
					t.Cleanup(func() { st.Close() })
					return st
				case <-time.After(peerTimeout):
					t.Fatal("no stream accepted")
					return nil
				}
			}
			if tc.otherHolds {
				_, done := write(bytes.Repeat([]byte{'o'}, 600<<10)) // more than half the region: fallback
				if err := errWithin(t, done, peerTimeout, "Write on the other stream"); err != nil {
					t.Fatal(err)
				}
				other := receive() // and never read
				waitUntil(t, "the other stream's data received", peerTimeout, func() bool {
					return other.Session().Stats().FallbackBytesIn >= 600<<10
				})
			}
			msg := make([]byte, 4<<20)
			for i := range msg {
				msg[i] = byte(i / 4093)
			}
			_, done := write(msg)
			srv := receive()
			srv.SetReadDeadline(time.Now().Add(time.Minute))
			var got []byte
			var err error
			if tc.peek {
				got, err = srv.BufferReader().Peek(len(msg))
			} else {
				got, err = srv.BufferReader().ReadBytes(len(msg))
			}
			if err != nil {
				t.Fatalf("reading %d bytes: %v", len(msg), err)
			}
			if !bytes.Equal(got, msg) {
				t.Fatal("the data read differs from the data written")
			}
			if err := errWithin(t, done, peerTimeout, "Write"); err != nil {
				t.Fatalf("Write: %v", err)
			}
			if err := sess.Err(); err != nil {
				t.Fatalf("session: %v", err)
			}
		})
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
// must hold no more than MaxFallbackBuffered plus a frame, and end when
// nobody makes room.
func TestWaitingReadersKeepFallbackBound(t *testing.T) {
	conf := smallRegion()
	conf.MaxFallbackFrameSize = minFallbackFrame
	conf.MaxFallbackBufferedPerStream = 1 << 20
	conf.MaxFallbackBuffered = 1 << 20
	conf.FallbackStallTimeout = 2 * time.Second
	sess, accepted := bpPair(t, conf)
	block := make(chan struct{})
	defer close(block)
	var srvSess *Session
	for range 12 {
		st, err := sess.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		if _, err := st.Write([]byte{1}); err != nil {
			t.Fatal(err)
		}
		var srv *Stream
		select {
		case srv = <-accepted:
		case <-time.After(peerTimeout):
			t.Fatal("no stream accepted")
		}
		defer srv.Close()
		srvSess = srv.Session()
		go func() {
			b := make([]byte, 1)
			srv.Read(b) // the first message
			srv.Read(b) // waits for the next
			<-block     // and does not read again
		}()
		go st.Write(bytes.Repeat([]byte{'x'}, 900<<10)) // more than half the region: fallback
	}
	limit := int64(conf.MaxFallbackBuffered) + int64(conf.MaxFallbackFrameSize)
	waitUntil(t, "the server session to end or exceed its bound", 30*time.Second, func() bool {
		return srvSess.IsClosed() || srvSess.fallbackHeld.Load() > limit
	})
	if held := srvSess.fallbackHeld.Load(); held > limit {
		t.Errorf("the server holds %d bytes of fallback data; MaxFallbackBuffered is %d, plus a frame %d", held, conf.MaxFallbackBuffered, limit)
	}
	if err := srvSess.Err(); !errors.Is(err, ErrLimitExceeded) {
		t.Errorf("server session: %v, want ErrLimitExceeded", err)
	}
}

package shmipc

import (
	"bytes"
	"errors"
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
	t.Logf("free counts after the peer read: %v", freeCounts(sess.buf))
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

// A raw peer that floods waiting readers with frames as large as the
// session accepts: the fallback bounds hold.

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

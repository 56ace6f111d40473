package shmipc

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// Tests of the receive side's rules (recv.go, consume.go,
// fallback_recv.go): one goroutine per session reads the socket and
// consumes the queue; a stream whose fallback data is not read costs only
// that stream; memory follows the bytes that arrive, not those a frame
// announces; a reader with a deadline waits as one without.

// TestOneReceiveOwner: under streams with and without deadlines, readers
// that copy, read in place and use OnData, and fallback data, every read
// of a session's socket runs on one goroutine, its receive loop, and every
// drain of its queue runs on a goroutine that holds the receive token: the
// loop, or a polling reader.
func TestOneReceiveOwner(t *testing.T) {
	var mu sync.Mutex
	sockets := make(map[*Session]map[uint64]bool)
	var bad []string
	hook := func(s *Session, socket bool) {
		id := goroutineID()
		state := s.tok.state.Load()
		mu.Lock()
		defer mu.Unlock()
		if socket {
			if sockets[s] == nil {
				sockets[s] = make(map[uint64]bool)
			}
			sockets[s][id] = true
			return
		}
		if sockets[s] == nil && state != tokenReader {
			return // a session of an earlier test, whose loop read its socket before this hook
		}
		loop := sockets[s][id]
		if (loop && state != tokenLoop && state != tokenEnded) || (!loop && state != tokenReader) {
			bad = append(bad, fmt.Sprintf("%s session: goroutine %d (its loop: %v) drains with the token in state %d", s.role(), id, loop, state))
		}
	}
	old := consumeHook.Swap(&hook)
	t.Cleanup(func() { consumeHook.Store(old) })

	conf := smallRegion()
	conf.QueueCap = 64
	conf.FallbackWhenFull = true
	ln := startEchoListener(t, conf)
	s, err := Dial("unix", ln.Addr().String(), conf)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, err := s.OpenStream()
			if err != nil {
				errs <- err
				return
			}
			defer st.Close()
			for j := range 40 {
				size := []int{1, 100, 5000, 300 << 10}[(i+j)%4]
				msg := bytes.Repeat([]byte{byte(i + j)}, size)
				if i%2 == 0 {
					st.SetReadDeadline(time.Now().Add(peerTimeout))
				}
				if _, err := st.Write(msg); err != nil {
					errs <- err
					return
				}
				var got []byte
				if i%3 == 0 {
					got, err = st.BufferReader().ReadBytes(size)
					got = slices.Clone(got)
					st.BufferReader().ReleasePreviousRead()
				} else {
					got = make([]byte, size)
					_, err = io.ReadFull(st, got)
				}
				if err != nil || !bytes.Equal(got, msg) {
					errs <- errors.Join(err, errors.New("echo differs"))
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(sockets) < 2 {
		t.Fatalf("the hook saw %d sessions read their socket, want both ends", len(sockets))
	}
	for sess, ids := range sockets {
		if len(ids) != 1 {
			t.Errorf("%s session: its socket was read by %d goroutines, want 1", sess.role(), len(ids))
		}
	}
	for _, b := range bad[:min(len(bad), 5)] {
		t.Error(b)
	}
}

// TestFallbackStallLeavesOtherStreams: while one stream's fallback data
// waits for a reader that does not read, another stream's shared-memory
// messages still go both ways at once; after FallbackStallTimeout the
// stalled stream, not the session, fails with an error naming the bound.
func TestFallbackStallLeavesOtherStreams(t *testing.T) {
	waitsInParallel(t)
	conf := smallRegion()
	conf.MaxFallbackFrameSize = minFallbackFrame
	conf.MaxFallbackBufferedPerStream = 1 << 20
	// The stall is waited out. It must outlast a round trip's read
	// deadline below (500 ms), so that a receive loop held up by the stall
	// would fail the first round trip rather than pass it late: 800 ms
	// with -short.
	conf.FallbackStallTimeout = shortOr(1500*time.Millisecond, 800*time.Millisecond)
	conf.ConsumerSpinTime = 0 // every message comes with a wake-up on the socket
	sess, accepted := bpPair(t, conf)
	stuck, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer stuck.Close()
	if _, err := stuck.Write([]byte{0}); err != nil {
		t.Fatal(err)
	}
	stuckSrv := bpAccepted(t, accepted) // never read
	go func() {                         // more than the region: fallback data, one frame a message
		for range 2 {
			if _, err := stuck.Write(make([]byte, 4<<20)); err != nil {
				return
			}
		}
	}()
	waitUntil(t, "the stalled frame", peerTimeout, func() bool { return stuckSrv.heldFallback.Load() > 0 })

	other, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if _, err := other.Write([]byte{0}); err != nil {
		t.Fatal(err)
	}
	otherSrv := bpAccepted(t, accepted)
	b := make([]byte, 1)
	for i := range 20 {
		otherSrv.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
		if i > 0 {
			if _, err := other.Write([]byte{byte(i)}); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := io.ReadFull(otherSrv, b); err != nil || b[0] != byte(i) {
			t.Fatalf("message %d on the other stream while one stalls: %q, %v", i, b, err)
		}
		if _, err := otherSrv.Write(b); err != nil {
			t.Fatal(err)
		}
		other.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
		if _, err := io.ReadFull(other, b); err != nil || b[0] != byte(i) {
			t.Fatalf("reply %d on the other stream while one stalls: %q, %v", i, b, err)
		}
	}
	waitUntil(t, "the stalled stream to fail", 4*conf.FallbackStallTimeout, stuckSrv.failed)
	if err := stuckSrv.failure(); !errors.Is(err, ErrLimitExceeded) || !strings.Contains(err.Error(), "MaxFallbackBufferedPerStream") {
		t.Errorf("the stalled stream's error: %v, want ErrLimitExceeded naming Config.MaxFallbackBufferedPerStream", err)
	}
	if err := sess.Err(); err != nil {
		t.Fatalf("session: %v", err)
	}
	if _, err := other.Write([]byte{9}); err != nil {
		t.Fatal(err)
	}
	otherSrv.SetReadDeadline(time.Now().Add(peerTimeout))
	if _, err := io.ReadFull(otherSrv, b); err != nil || b[0] != 9 {
		t.Fatalf("the other stream after the failure: %q, %v", b, err)
	}
}

// TestOnDataKeepsFallbackBound: an OnData callback that never consumes
// waits for one byte more each time; that lifts no bound. The server holds
// at most the stream's bound and a frame of the 24 MiB sent, and the
// callback's stream fails with an error naming the bound.
func TestOnDataKeepsFallbackBound(t *testing.T) {
	conf := smallRegion()
	conf.MaxFallbackFrameSize = minFallbackFrame
	conf.MaxFallbackBufferedPerStream = 2 << 20
	conf.MaxFallbackBuffered = 4 << 20
	// Waited out: the callback never consumes, so a shorter stall (100 ms
	// with -short) changes only when the stream fails.
	conf.FallbackStallTimeout = shortOr(300*time.Millisecond, 100*time.Millisecond)
	sess, accepted := bpPair(t, conf)
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	go func() { // a frame a message: the second passes the bound
		for range 3 {
			if _, err := st.Write(make([]byte, 8<<20)); err != nil {
				return
			}
		}
	}()
	srv := bpAccepted(t, accepted)
	done := OnData(srv, func(*Stream) error { return nil }) // reads nothing
	limit := int64(conf.MaxFallbackBufferedPerStream) + int64(conf.MaxFallbackFrameSize)
	var most int64
	var err2 error
	deadline := time.Now().Add(time.Minute)
	for got := false; !got; {
		most = max(most, srv.heldFallback.Load())
		if most > limit || time.Now().After(deadline) {
			t.Fatalf("OnData still running after holding %d bytes of fallback data; the stream's bound and a frame are %d", most, limit)
		}
		select {
		case err2 = <-done:
			got = true
		case <-time.After(time.Millisecond):
		}
	}
	if most > limit {
		t.Errorf("the stream held %d bytes of fallback data; its bound and a frame are %d", most, limit)
	}
	if !errors.Is(err2, ErrLimitExceeded) || !strings.Contains(err2.Error(), "MaxFallbackBufferedPerStream") {
		t.Errorf("OnData: %v, want ErrLimitExceeded naming Config.MaxFallbackBufferedPerStream", err2)
	}
	if err := srv.Session().Err(); err != nil {
		t.Errorf("server session: %v, want it open", err)
	}
}

// TestPartialFrameHoldsNothing: a peer that sends the head of a
// FallbackData frame announcing the largest size allowed, and nothing
// more, makes the session allocate nothing near that size, and the
// session ends after PartialFrameTimeout with an error that says so.
func TestPartialFrameHoldsNothing(t *testing.T) {
	const sessions = 4
	runtime.GC()
	before := heapInUse()
	var victims []*Session
	for range sessions {
		p, victim := acceptRawVictimWith(t, MemMapTypeDevShmFile, 0, func(c *Config) {
			// Waited out; with -short 300 ms, still past the look at the
			// heap 100 ms after the last frame head.
			c.PartialFrameTimeout = shortOr(500*time.Millisecond, 300*time.Millisecond)
			c.MaxFallbackFrameSize = DefaultConfig().MaxFallbackFrameSize // 64 MiB
		})
		defer victim.Close()
		p.write(rawFallbackFrame(p.version, victim.conf.MaxFallbackFrameSize, 2, 0, "x"))
		victims = append(victims, victim)
	}
	time.Sleep(100 * time.Millisecond)
	if grown := heapInUse() - before; grown > 16<<20 {
		t.Errorf("%d frame heads announcing %d MiB each grew the heap by %.1f MiB", sessions, victims[0].conf.MaxFallbackFrameSize>>20, float64(grown)/(1<<20))
	}
	for _, v := range victims {
		err := waitSessionClosed(t, v, peerTimeout)
		if !errors.Is(err, errPartialFrame) {
			t.Errorf("victim session: %v, want the partial frame's error", err)
		}
	}
}

// TestReadDeadlineWaitsAsWithout: with spinning off, a request-reply round
// trip whose reader sets a read deadline takes about as long as one whose
// reader sets none: the deadline changes how long it may wait, not how it
// is woken.
func TestReadDeadlineWaitsAsWithout(t *testing.T) {
	_, cli, srv := exchangedPair(t)
	go echoStream(srv)
	buf := make([]byte, 5)
	round := func(deadline bool) time.Duration {
		if deadline {
			cli.SetReadDeadline(time.Now().Add(peerTimeout))
		} else {
			cli.SetReadDeadline(time.Time{})
		}
		start := time.Now()
		if _, err := cli.Write([]byte("hello")); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(cli, buf); err != nil {
			t.Fatal(err)
		}
		return time.Since(start)
	}
	var with, without []time.Duration
	for i := range 400 {
		d := round(i%2 == 0)
		if i%2 == 0 {
			with = append(with, d)
		} else {
			without = append(without, d)
		}
	}
	slices.Sort(with)
	slices.Sort(without)
	mw, mo := with[len(with)/2], without[len(without)/2]
	t.Logf("p50 round trip: %v with a read deadline, %v without", mw, mo)
	if mw > 3*mo+200*time.Microsecond {
		t.Errorf("p50 round trip %v with a read deadline, %v without", mw, mo)
	}
}

// TestListenerMaxSessions: a listener serves at most Config.MaxSessions
// sessions, handshakes in progress included; a connection beyond them is
// closed at once, and one more is served once a session has ended.
func TestListenerMaxSessions(t *testing.T) {
	conf := DefaultConfig()
	conf.MaxSessions = 2
	// The idle connection below must keep its place (its handshake
	// pending) for the whole test, and a third connection the listener
	// wrongly served would then wait out this timeout before its end:
	// longer than the read deadline that expects the end at once.
	conf.InitializeTimeout = 2 * peerTimeout
	ln := startEchoListener(t, conf)
	a, err := Dial("unix", ln.Addr().String(), conf) // the listener's first session
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	// A connection that never starts its handshake holds the second place.
	idle, err := net.Dial("unix", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer idle.Close()
	waitUntil(t, "the session and the idle connection to be counted", peerTimeout, func() bool {
		ln.mu.Lock()
		defer ln.mu.Unlock()
		return len(ln.sessions) == 1 && len(ln.pending) == 1
	})
	over, err := net.Dial("unix", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer over.Close()
	over.SetReadDeadline(time.Now().Add(peerTimeout))
	if n, err := over.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("a third connection read %d bytes, %v; want it closed (io.EOF)", n, err)
	}
	mustEcho(t, a)
	a.Close()
	waitUntil(t, "the ended session to leave the listener", peerTimeout, func() bool { return len(ln.liveSessions()) == 0 })
	b, err := Dial("unix", ln.Addr().String(), conf)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	mustEcho(t, b)
}

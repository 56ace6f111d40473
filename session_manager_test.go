package shmipc

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// smEchoServer serves a framed echo with Listener.Serve: a u32 big-endian
// length n and n bytes come back as they were; n == 0 makes the server close
// the stream without a reply.
type smEchoServer struct {
	ln       *Listener
	served   chan error
	accepted atomic.Int64

	mu       sync.Mutex
	sessions []*Session // server sessions in the order they carried a stream
}

func smStartEcho(t testing.TB, sock string) *smEchoServer {
	t.Helper()
	ln, err := Listen("unix", sock, smTestConfig())
	if err != nil {
		t.Fatal(err)
	}
	e := &smEchoServer{ln: ln, served: make(chan error, 1)}
	go func() { e.served <- ln.Serve(e.handle) }()
	return e
}

// smTestConfig is a small configuration: the tests open many sessions.
// Test servers use it too.
func smTestConfig() *Config {
	conf := DefaultConfig()
	conf.ShareMemoryBufferCap = 4 << 20
	conf.BufferSliceSizes = ReferenceSliceSizes()
	conf.InitializeTimeout = 10 * time.Second // a loaded machine with -race is slow
	return conf
}

func (e *smEchoServer) handle(st *Stream) {
	e.accepted.Add(1)
	e.mu.Lock()
	found := false
	for _, s := range e.sessions {
		found = found || s == st.Session()
	}
	if !found {
		e.sessions = append(e.sessions, st.Session())
	}
	e.mu.Unlock()
	hdr := make([]byte, 4)
	for {
		if _, err := io.ReadFull(st, hdr); err != nil {
			return
		}
		n := int(binary.BigEndian.Uint32(hdr))
		if n == 0 {
			return // Serve closes the stream
		}
		body, err := st.BufferReader().ReadBytes(n)
		if err != nil {
			return
		}
		w := st.BufferWriter()
		w.WriteBytes(hdr)
		w.WriteBytes(body)
		if err := st.Flush(false); err != nil {
			return
		}
	}
}

func (e *smEchoServer) serverSessions() []*Session {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]*Session(nil), e.sessions...)
}

// close closes the listener and its sessions and checks that Serve
// returned ErrListenerClosed.
func (e *smEchoServer) close(t testing.TB) {
	t.Helper()
	e.ln.CloseAll()
	select {
	case err := <-e.served:
		if !errors.Is(err, ErrListenerClosed) {
			t.Errorf("Serve returned %v, want ErrListenerClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Errorf("Serve did not return 5s after the listener closed")
	}
}

// smRoundTrip sends payload as an echo frame on st and checks the echo.
func smRoundTrip(st *Stream, payload []byte) error {
	msg := make([]byte, 4+len(payload))
	binary.BigEndian.PutUint32(msg, uint32(len(payload)))
	copy(msg[4:], payload)
	if _, err := st.Write(msg); err != nil {
		return fmt.Errorf("stream %d: write: %w", st.ID(), err)
	}
	got, err := st.BufferReader().ReadBytes(len(msg))
	if err != nil {
		return fmt.Errorf("stream %d: read the echo of %d bytes: %w", st.ID(), len(payload), err)
	}
	if !bytes.Equal(got, msg) {
		return fmt.Errorf("stream %d: echo of %d bytes differs", st.ID(), len(payload))
	}
	return nil
}

func smNewManager(t testing.TB, sock string, sessions int) *SessionManager {
	t.Helper()
	conf := smTestConfig()
	// The sessions share one buffer region: size it for all of them. Its
	// prefix is the test's own, so that it is shared with no other test's
	// sessions (the tests that run in parallel rely on that).
	conf.ShareMemoryBufferCap *= uint32(max(sessions, 1))
	conf.ShareMemoryPathPrefix = shmPrefix(t, "sm")
	m, err := NewSessionManager(SessionManagerConfig{
		Config:              conf,
		Network:             "unix",
		Address:             sock,
		SessionNum:          sessions,
		MinReconnectBackoff: 10 * time.Millisecond,
		MaxReconnectBackoff: 200 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// smWaitGoroutines polls until at most want goroutines run.
func smWaitGoroutines(t testing.TB, want int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > want {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			t.Fatalf("%d goroutines 5s after Close, %d before the test:\n%s", runtime.NumGoroutine(), want, buf)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestSessionManagerConcurrent(t *testing.T) {
	srv := smStartEcho(t, filepath.Join(t.TempDir(), "s.sock"))
	defer srv.close(t)
	before := runtime.NumGoroutine()
	m := smNewManager(t, srv.ln.Addr().String(), 4)

	const workers, rounds = 100, 20
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for g := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 1))
			for i := range rounds {
				st, err := m.GetStream()
				if err != nil {
					errs <- err
					return
				}
				payload := make([]byte, 1+rng.IntN(64<<10))
				for j := range payload {
					payload[j] = byte(g + i + j)
				}
				if err := smRoundTrip(st, payload); err != nil {
					st.Close()
					errs <- err
					return
				}
				m.PutBack(st)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	opened := srv.accepted.Load()
	t.Logf("%d requests on %d streams; %d idle in the pool", workers*rounds, opened, m.IdleStreams())
	if opened > 2*workers || opened >= workers*rounds {
		t.Errorf("%d streams opened for %d requests by %d workers: streams are not reused", opened, workers*rounds, workers)
	}
	// A stream that fell back to the socket is closed, not pooled (PROTOCOL.md
	// §6.5): under load, a region short of slices sends some messages that
	// way. Every other stream must be back in the pool.
	var fallbacks uint64
	for _, s := range m.Sessions() {
		st := s.Stats()
		fallbacks += st.FallbackMessagesOut + st.FallbackMessagesIn
	}
	if n := int64(m.IdleStreams()); n > opened || uint64(opened-n) > fallbacks {
		t.Errorf("%d streams in the pool after all were put back, want %d less at most one per fallback message (%d)", n, opened, fallbacks)
	}

	// New streams are spread over the sessions round-robin.
	perSession := map[*Session]int{}
	var held []*Stream
	for range int(opened) + 8 {
		st, err := m.GetStream()
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, st)
	}
	for _, st := range held[opened:] {
		perSession[st.Session()]++
		st.Close()
	}
	for _, st := range held[:opened] {
		m.PutBack(st)
	}
	if len(perSession) != 4 {
		t.Errorf("8 new streams went to %d sessions, want 2 on each of 4: %v", len(perSession), perSession)
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	smWaitGoroutines(t, before)
}

func TestSessionManagerReuse(t *testing.T) {
	srv := smStartEcho(t, filepath.Join(t.TempDir(), "s.sock"))
	defer srv.close(t)
	m := smNewManager(t, srv.ln.Addr().String(), 1)
	defer m.Close()

	get := func() *Stream {
		t.Helper()
		st, err := m.GetStream()
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	st := get()
	if err := smRoundTrip(st, []byte("first")); err != nil {
		t.Fatal(err)
	}
	id := st.ID()
	m.PutBack(st)
	if n := m.IdleStreams(); n != 1 {
		t.Fatalf("%d idle streams after PutBack, want 1", n)
	}
	st2 := get()
	if st2 != st || st2.ID() != id {
		t.Fatalf("GetStream after PutBack returned stream %d, want the pooled stream %d", st2.ID(), id)
	}
	if err := smRoundTrip(st2, []byte("second")); err != nil {
		t.Fatal(err)
	}
	if n := srv.accepted.Load(); n != 1 {
		t.Errorf("the server accepted %d streams for two requests, want 1", n)
	}

	// Put back twice, a stream is pooled once: handing it out twice would
	// give two users one stream.
	m.PutBack(st2)
	m.PutBack(st2)
	if n := m.IdleStreams(); n != 1 {
		t.Fatalf("%d idle streams after putting one stream back twice, want 1", n)
	}
	if a, b := get(), get(); a == b {
		t.Fatal("GetStream handed out one pooled stream twice")
	} else {
		b.Close()
		st2 = a
	}

	// A deadline set by one user does not stay for the next.
	st2.SetReadDeadline(time.Now().Add(-time.Second))
	m.PutBack(st2)
	st = get()
	if st != st2 {
		t.Fatal("stream not reused")
	}
	if err := smRoundTrip(st, []byte("after a deadline")); err != nil {
		t.Fatalf("pooled stream kept its deadline: %v", err)
	}

	notPooled := func(what string, st *Stream) {
		t.Helper()
		m.PutBack(st)
		if n := m.IdleStreams(); n != 0 {
			t.Errorf("%s: pooled (%d idle streams)", what, n)
		}
		if _, err := st.Write([]byte{0, 0, 0, 1, 1}); !errors.Is(err, ErrStreamClosed) {
			t.Errorf("%s: write after PutBack: %v, want ErrStreamClosed (the stream is closed)", what, err)
		}
	}

	// Unread data: the response has not been read.
	if _, err := st.Write([]byte{0, 0, 0, 3, 'a', 'b', 'c'}); err != nil {
		t.Fatal(err)
	}
	if _, err := st.BufferReader().Peek(7); err != nil {
		t.Fatal(err)
	}
	notPooled("stream with unread data", st)

	// An unflushed message.
	st = get()
	st.BufferWriter().WriteBytes([]byte("pending"))
	notPooled("stream with an unflushed message", st)

	// Closed by the user.
	st = get()
	st.Close()
	notPooled("closed stream", st)

	// Fallback: a message that no slice can hold goes over the socket, and
	// the stream keeps sending that way.
	st = get()
	big, err := st.BufferWriter().Reserve(4 + 200<<10)
	if err != nil {
		t.Fatal(err)
	}
	binary.BigEndian.PutUint32(big, 200<<10)
	if err := st.Flush(false); err != nil {
		t.Fatal(err)
	}
	if _, err := st.BufferReader().Discard(4 + 200<<10); err != nil {
		t.Fatal(err)
	}
	if !st.fallback.Load() {
		t.Fatal("a 200 KiB Reserve did not put the stream in fallback mode")
	}
	notPooled("stream in fallback mode", st)

	// Closed by the server while pooled: GetStream skips it.
	st = get()
	id = st.ID()
	if _, err := st.Write(make([]byte, 4)); err != nil { // the server closes the stream
		t.Fatal(err)
	}
	m.PutBack(st) // pooled, or closed if the close has already arrived
	waitUntil(t, "server close", 5*time.Second, st.writeClosed.Load)
	st = get()
	if st.ID() == id {
		t.Errorf("GetStream returned stream %d, which the server closed", id)
	}
	if err := smRoundTrip(st, []byte("fresh")); err != nil {
		t.Fatal(err)
	}
	m.PutBack(st)

	// The pool is bounded.
	m2, err := NewSessionManager(SessionManagerConfig{
		Config: smTestConfig(), Network: "unix", Address: srv.ln.Addr().String(), MaxIdleStreams: 2,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer m2.Close()
	var held []*Stream
	for range 4 {
		st, err := m2.GetStream()
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, st)
	}
	for _, st := range held {
		m2.PutBack(st)
	}
	if n := m2.IdleStreams(); n != 2 {
		t.Errorf("%d idle streams with MaxIdleStreams 2", n)
	}
}

func TestSessionManagerIdleTimeout(t *testing.T) {
	srv := smStartEcho(t, filepath.Join(t.TempDir(), "s.sock"))
	defer srv.close(t)
	m, err := NewSessionManager(SessionManagerConfig{
		Config: smTestConfig(), Network: "unix", Address: srv.ln.Addr().String(),
		StreamMaxIdleTime: 50 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	st, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	m.PutBack(st)
	waitUntil(t, "idle stream closed", 5*time.Second, func() bool { return m.IdleStreams() == 0 })
	waitUntil(t, "evicted stream closed", 5*time.Second, st.writeClosed.Load)
}

func TestSessionManagerReconnect(t *testing.T) {
	waitsInParallel(t)
	sock := filepath.Join(t.TempDir(), "s.sock")
	srv := smStartEcho(t, sock)
	m := smNewManager(t, sock, 2)
	defer m.Close()

	// One stream on each session.
	var held []*Stream
	for range 2 {
		st, err := m.GetStream()
		if err != nil {
			t.Fatal(err)
		}
		if err := smRoundTrip(st, []byte("hello")); err != nil {
			t.Fatal(err)
		}
		held = append(held, st)
	}
	if held[0].Session() == held[1].Session() {
		t.Fatal("two GetStream calls used the same session, want round-robin")
	}
	for _, st := range held {
		m.PutBack(st)
	}

	// The server kills one of the sessions. (The client end of a Unix
	// socket has no name, so which one shows on the client side.)
	srv.serverSessions()[0].Close()
	waitUntil(t, "a client session dies", 5*time.Second, func() bool {
		return held[0].Session().IsClosed() || held[1].Session().IsClosed()
	})
	dead := held[0].Session()
	if held[1].Session().IsClosed() {
		dead = held[1].Session()
	}
	// Meanwhile GetStream keeps working on the other session.
	for range 10 {
		st, err := m.GetStream()
		if err != nil {
			t.Fatalf("GetStream while one session is down: %v", err)
		}
		if err := smRoundTrip(st, []byte("meanwhile")); err != nil {
			// The stream may have been taken just before the session died.
			if !errors.Is(err, ErrSessionClosed) {
				t.Fatal(err)
			}
		}
		m.PutBack(st)
	}
	start := time.Now()
	waitUntil(t, "re-dial", 5*time.Second, func() bool {
		ss := m.Sessions()
		if len(ss) != 2 {
			return false
		}
		for _, s := range ss {
			if s == dead || s.IsClosed() {
				return false
			}
		}
		return true
	})
	t.Logf("session re-dialed after %v", time.Since(start))
	for range 4 {
		st, err := m.GetStream()
		if err != nil {
			t.Fatal(err)
		}
		if st.Session() == dead {
			t.Fatal("GetStream returned a stream of the dead session")
		}
		if err := smRoundTrip(st, []byte("again")); err != nil {
			t.Fatal(err)
		}
		m.PutBack(st)
	}

	// Restart the whole server: every session dies.
	srv.close(t)
	waitUntil(t, "all sessions die", 5*time.Second, func() bool {
		_, err := m.GetStream()
		return errors.Is(err, ErrNoHealthySession)
	})
	_, err := m.GetStream()
	t.Logf("GetStream with the server down: %v", err)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	_, err = m.GetStreamContext(ctx)
	cancel()
	if !errors.Is(err, ErrNoHealthySession) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("GetStreamContext with the server down: %v, want ErrNoHealthySession and context.DeadlineExceeded", err)
	}
	time.Sleep(300 * time.Millisecond) // let the backoff grow to its maximum

	srv = smStartEcho(t, sock)
	defer srv.close(t)
	start = time.Now()
	ctx, cancel = context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := m.GetStreamContext(ctx)
	if err != nil {
		t.Fatalf("GetStreamContext after the server restarted: %v", err)
	}
	wait := time.Since(start)
	t.Logf("GetStreamContext waited %v for the restarted server", wait)
	// The backoff is at most 200 ms; a handshake on a loaded machine under
	// -race can take a good part of a second.
	if wait > 3*time.Second {
		t.Errorf("reconnecting took %v with a maximum backoff of 200ms", wait)
	}
	if err := smRoundTrip(st, []byte("restarted")); err != nil {
		t.Fatal(err)
	}
	m.PutBack(st)
	waitUntil(t, "both sessions back", 5*time.Second, func() bool { return len(m.Sessions()) == 2 })
}

func TestSessionManagerClose(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s.sock")
	srv := smStartEcho(t, sock)
	defer srv.close(t)
	before := runtime.NumGoroutine()

	m := smNewManager(t, sock, 2)
	inUse, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	pooled, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	m.PutBack(pooled)
	sessions := m.Sessions()

	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if err := m.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := m.GetStream(); !errors.Is(err, ErrSessionManagerClosed) {
		t.Errorf("GetStream after Close: %v, want ErrSessionManagerClosed", err)
	}
	if _, err := m.GetStreamContext(context.Background()); !errors.Is(err, ErrSessionManagerClosed) {
		t.Errorf("GetStreamContext after Close: %v, want ErrSessionManagerClosed", err)
	}
	for _, s := range sessions {
		if !s.IsClosed() {
			t.Error("a session is open after Close")
		}
	}
	if _, err := inUse.Write([]byte("x")); !errors.Is(err, ErrSessionClosed) {
		t.Errorf("write on a stream held across Close: %v, want ErrSessionClosed", err)
	}
	m.PutBack(inUse) // closes it
	if n := m.IdleStreams(); n != 0 {
		t.Errorf("%d idle streams after Close", n)
	}
	smWaitGoroutines(t, before)

	// Close while re-dialing a server that is gone.
	m = smNewManager(t, sock, 1)
	srv.ln.Close()
	waitUntil(t, "session dies", 5*time.Second, func() bool { return len(m.Sessions()) == 0 })
	time.Sleep(50 * time.Millisecond)
	start := time.Now()
	m.Close()
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("Close took %v while re-dialing", d)
	}
	smWaitGoroutines(t, before)

	// A manager that cannot dial fails at once.
	if _, err := NewSessionManager(SessionManagerConfig{Network: "unix", Address: filepath.Join(t.TempDir(), "none.sock")}); err == nil {
		t.Error("NewSessionManager without a server succeeded")
	}
	for _, n := range []int{maxSessionNum + 1, 1 << 62} {
		if _, err := NewSessionManager(SessionManagerConfig{Network: "unix", Address: "x", SessionNum: n}); !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("NewSessionManager with SessionNum %d: %v, want ErrInvalidConfig", n, err)
		}
	}
	if _, err := NewSessionManager(SessionManagerConfig{Network: "unix"}); !errors.Is(err, ErrInvalidConfig) {
		t.Errorf("NewSessionManager without an address: %v, want ErrInvalidConfig", err)
	}
	smWaitGoroutines(t, before)
}

// TestSessionManagerServerStopsGracefully stops the server as Listener.Close
// says to, while the manager pools streams to it, and starts a new server
// at the same address. The old server's Listener closes each new stream as
// it arrives and its sessions end only once their last stream is closed:
// a manager that went on reusing its pooled streams would keep the old
// server from ever stopping, and every stream it opened would fail. A
// refused stream makes the manager move to the new server and let go of
// the old one.
func TestSessionManagerServerStopsGracefully(t *testing.T) {
	waitsInParallel(t)
	sock := filepath.Join(t.TempDir(), "s.sock")
	old := smStartEcho(t, sock)
	t.Cleanup(func() { old.ln.CloseAll() })
	m := smNewManager(t, sock, 1)
	defer m.Close()
	var pooled []*Stream
	for range 2 {
		st, err := m.GetStream()
		if err != nil {
			t.Fatal(err)
		}
		if err := smRoundTrip(st, []byte("hello")); err != nil {
			t.Fatal(err)
		}
		pooled = append(pooled, st)
	}
	for _, st := range pooled {
		m.PutBack(st)
	}
	time.Sleep(refusedMinAge) // a younger session ignores refusals

	if err := old.ln.Close(); err != nil {
		t.Fatal(err)
	}
	if n := len(listenerSessions(old.ln)); n != 1 {
		t.Fatalf("%d sessions of the closed listener left; want 1, kept by the pooled streams", n)
	}
	nw := smStartEcho(t, sock)
	defer nw.close(t)

	// Three requests at once, one more than the pool holds, until the new
	// server serves one.
	var failed atomic.Int64
	burst := func() { smBurst(m, &failed) }
	deadline := time.Now().Add(30 * time.Second)
	for nw.accepted.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("30s after the old server stopped accepting, the new one has served nothing (%d requests failed)", failed.Load())
		}
		burst()
	}
	t.Logf("%d requests failed before the manager moved", failed.Load())
	waitUntil(t, "the old server's sessions to end", 10*time.Second, func() bool {
		return len(listenerSessions(old.ln)) == 0
	})
	failed.Store(0)
	for range 50 {
		burst()
	}
	if n := failed.Load(); n != 0 {
		t.Errorf("%d of 150 requests failed after the move to the new server", n)
	}
}

// TestSessionManagerStopsGracefullyAfterHotRestart: a manager that moved to
// a new server by hot restart, while a stream of the old server's session
// was still handed out, follows that new server's graceful stop as it
// follows the first server's: it reaches the server that listens next.
func TestSessionManagerStopsGracefullyAfterHotRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: waits out the hot restart timeout")
	}
	sock := filepath.Join(t.TempDir(), "s.sock")
	first := smStartEcho(t, sock)
	t.Cleanup(func() { first.ln.CloseAll() })
	m := smNewManager(t, sock, 1)
	defer m.Close()
	held, err := m.GetStream() // handed out across the restart
	if err != nil {
		t.Fatal(err)
	}
	if err := smRoundTrip(held, []byte("hello")); err != nil {
		t.Fatal(err)
	}

	second, err := ListenTakeover(sock, smTestConfig())
	if err != nil {
		t.Fatal(err)
	}
	sec := &smEchoServer{ln: second, served: make(chan error, 1)}
	go func() { sec.served <- second.Serve(sec.handle) }()
	t.Cleanup(func() { second.CloseAll() })
	for {
		err = first.ln.HotRestart(1)
		if !errors.Is(err, ErrHotRestartHandshaking) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := first.ln.WaitHotRestart(ctx); err != nil {
		t.Fatal(err)
	}
	// Streams of the second server in the pool, old enough to be refused.
	var pooled []*Stream
	for range 2 {
		st, err := m.GetStream()
		if err != nil {
			t.Fatal(err)
		}
		if err := smRoundTrip(st, []byte("hello")); err != nil {
			t.Fatal(err)
		}
		pooled = append(pooled, st)
	}
	for _, st := range pooled {
		m.PutBack(st)
	}
	if sec.accepted.Load() == 0 {
		t.Fatal("after the hot restart the second server served nothing")
	}
	time.Sleep(refusedMinAge)

	if err := second.Close(); err != nil {
		t.Fatal(err)
	}
	third := smStartEcho(t, sock)
	defer third.close(t)
	// Three requests at once, one more than the pool holds, until the third
	// server serves one: the third opens a stream, which the second refuses.
	var failed atomic.Int64
	deadline := time.Now().Add(30 * time.Second)
	for third.accepted.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("30s after the second server stopped accepting, the third has served nothing (%d requests failed)", failed.Load())
		}
		smBurst(m, &failed)
	}
	t.Logf("%d requests failed before the manager moved", failed.Load())
	waitUntil(t, "the second server's sessions to end", 10*time.Second, func() bool {
		return len(listenerSessions(second)) == 0
	})
	held.Close()
}

// smBurst makes three requests at once through m, one more than a pool of
// two holds, and counts those that fail in failed.
func smBurst(m *SessionManager, failed *atomic.Int64) {
	var wg sync.WaitGroup
	for range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			st, err := m.GetStreamContext(ctx)
			if err != nil {
				failed.Add(1)
				return
			}
			st.SetDeadline(time.Now().Add(10 * time.Second))
			if err := smRoundTrip(st, []byte("request")); err != nil {
				failed.Add(1)
				st.Close()
				return
			}
			m.PutBack(st)
		}()
	}
	wg.Wait()
}

// slowAcceptListener delays each accepted connection, and says when one
// arrived.
type slowAcceptListener struct {
	net.Listener
	accepted chan struct{}
	delay    time.Duration
}

func (l *slowAcceptListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		select {
		case l.accepted <- struct{}{}:
		default:
		}
		time.Sleep(l.delay)
	}
	return c, err
}

// smRefuseOnce keeps a stream open on the manager's session, waits until
// the session may be replaced, stops the server gracefully, and has a new
// stream refused; it returns the stream kept.
func smRefuseOnce(t *testing.T, m *SessionManager, old *smEchoServer, start func()) *Stream {
	t.Helper()
	keep, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { keep.Close() })
	if err := smRoundTrip(keep, []byte("hello")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(refusedMinAge)
	if err := old.ln.Close(); err != nil {
		t.Fatal(err)
	}
	start()
	st, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	st.SetDeadline(time.Now().Add(peerTimeout))
	if err := smRoundTrip(st, []byte("refused")); err == nil {
		t.Fatal("a stream opened after the server stopped accepting was answered")
	}
	st.Close()
	return keep
}

// TestSessionManagerRefusalWakesWaiters: the old session dies while the
// slot dials its replacement after a refusal; a GetStreamContext that found
// no healthy session meanwhile is woken when the replacement is installed.
func TestSessionManagerRefusalWakesWaiters(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: waits out the refusal age")
	}
	sock := filepath.Join(t.TempDir(), "s.sock")
	old := smStartEcho(t, sock)
	t.Cleanup(func() { old.ln.CloseAll() })
	m := smNewManager(t, sock, 1)
	defer m.Close()
	var slow *slowAcceptListener
	keep := smRefuseOnce(t, m, old, func() {
		raw, err := net.Listen("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		slow = &slowAcceptListener{Listener: raw, accepted: make(chan struct{}, 1), delay: 700 * time.Millisecond}
		nw := NewListener(slow, smTestConfig())
		t.Cleanup(func() { nw.CloseAll() })
		go nw.Serve((&smEchoServer{ln: nw}).handle)
	})
	select {
	case <-slow.accepted:
	case <-time.After(10 * time.Second):
		t.Fatal("no dial after the refusal")
	}
	old.ln.CloseAll() // the old session dies while the dial waits
	waitUntil(t, "the old session to end", 10*time.Second, func() bool { return keep.Session().IsClosed() })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	st, err := m.GetStreamContext(ctx)
	if err != nil {
		t.Fatalf("GetStreamContext: %v", err)
	}
	defer st.Close()
	if err := smRoundTrip(st, []byte("on the new server")); err != nil {
		t.Fatal(err)
	}
}

// TestSessionManagerCloseEndsRetiredSessions: a session the manager
// retired after a refusal still carries a stream handed out; Close ends it
// as it ends the current ones.
func TestSessionManagerCloseEndsRetiredSessions(t *testing.T) {
	waitsInParallel(t)
	sock := filepath.Join(t.TempDir(), "s.sock")
	old := smStartEcho(t, sock)
	t.Cleanup(func() { old.ln.CloseAll() })
	m := smNewManager(t, sock, 1)
	keep := smRefuseOnce(t, m, old, func() {
		nw := smStartEcho(t, sock)
		t.Cleanup(func() { nw.close(t) })
	})
	waitUntil(t, "the slot to move to a new session", 10*time.Second, func() bool {
		ss := m.Sessions()
		return len(ss) == 1 && ss[0] != keep.Session()
	})
	if keep.Session().IsClosed() {
		t.Fatal("the retired session ended with a stream still open on it")
	}
	m.Close()
	if !keep.Session().IsClosed() {
		t.Error("the retired session is still open after SessionManager.Close")
	}
}

// TestSessionManagerRefusalDialsAreRateLimited: refusals make a slot dial
// at most once a second, whether the dial fails (a listener that drops
// every connection) or reaches the same server process again (one whose
// application closes new streams without answering: the wait then
// doubles).
func TestSessionManagerRefusalDialsAreRateLimited(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: watches a rate over seconds")
	}
	t.Run("failed dials", func(t *testing.T) {
		sock := filepath.Join(t.TempDir(), "s.sock")
		old := smStartEcho(t, sock)
		t.Cleanup(func() { old.ln.CloseAll() })
		m := smNewManager(t, sock, 1)
		defer m.Close()
		var dials atomic.Int64
		smRefuseOnce(t, m, old, func() {
			raw, err := net.Listen("unix", sock)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { raw.Close() })
			go func() {
				for {
					c, err := raw.Accept()
					if err != nil {
						return
					}
					dials.Add(1)
					c.Close()
				}
			}()
		})
		for end := time.Now().Add(time.Second); time.Now().Before(end); {
			if st, err := m.GetStream(); err == nil {
				st.SetDeadline(time.Now().Add(time.Second))
				_ = smRoundTrip(st, []byte("x"))
				st.Close()
			}
			time.Sleep(time.Millisecond)
		}
		if n := dials.Load(); n > 2 {
			t.Errorf("%d dials within a second of refusals", n)
		}
	})
	t.Run("same server", func(t *testing.T) {
		sock := filepath.Join(t.TempDir(), "s.sock")
		srv := smStartEcho(t, sock)
		defer srv.close(t)
		m := smNewManager(t, sock, 1)
		defer m.Close()
		// A zero length makes the server close the stream unanswered.
		for end := time.Now().Add(2500 * time.Millisecond); time.Now().Before(end); {
			st, err := m.GetStream()
			if err != nil {
				t.Fatal(err)
			}
			st.SetDeadline(time.Now().Add(peerTimeout))
			st.Write(make([]byte, 4))
			io.Copy(io.Discard, st)
			st.Close()
			time.Sleep(time.Millisecond)
		}
		// Dials at 1 s, then not before 3 s: two sessions in 2.5 s.
		if n := len(srv.serverSessions()); n > 2 {
			t.Errorf("streams closed unanswered by one server made the manager use %d sessions in 2.5 s; want at most 2", n)
		}
	})
}

// TestSessionManagerEarlyRefusalActedOnLater: a stream refused on a session
// younger than refusedMinAge still moves the slot to the new server, once
// the wait is over, without another refusal to remind it.
func TestSessionManagerEarlyRefusalActedOnLater(t *testing.T) {
	waitsInParallel(t)
	sock := filepath.Join(t.TempDir(), "s.sock")
	old := smStartEcho(t, sock)
	t.Cleanup(func() { old.ln.CloseAll() })
	m := smNewManager(t, sock, 1)
	defer m.Close()
	keep, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	defer keep.Close()
	if err := smRoundTrip(keep, []byte("hello")); err != nil {
		t.Fatal(err)
	}
	if err := old.ln.Close(); err != nil {
		t.Fatal(err)
	}
	nw := smStartEcho(t, sock)
	defer nw.close(t)
	st, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	st.SetDeadline(time.Now().Add(peerTimeout))
	if err := smRoundTrip(st, []byte("refused")); err == nil {
		t.Fatal("a stream opened after the server stopped accepting was answered")
	}
	st.Close()
	waitUntil(t, "the slot to move to the new server", 20*time.Second, func() bool {
		ss := m.Sessions()
		return len(ss) == 1 && ss[0] != keep.Session()
	})
	st, err = m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if err := smRoundTrip(st, []byte("on the new server")); err != nil {
		t.Fatal(err)
	}
}

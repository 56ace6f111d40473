package shmipc

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
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

// smUsedStreams gets n streams from m and makes one round trip on each,
// so that each is clean for PutBack; the caller puts them back.
func smUsedStreams(t testing.TB, m *SessionManager, n int) []*Stream {
	t.Helper()
	var used []*Stream
	for range n {
		st, err := m.GetStream()
		if err != nil {
			t.Fatal(err)
		}
		if err := smRoundTrip(st, []byte("hello")); err != nil {
			t.Fatal(err)
		}
		used = append(used, st)
	}
	return used
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
	// A stream that fell back to the socket is closed, not pooled (docs/protocol.md
	// §9.5): under load, a region short of slices sends some messages that
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

package shmipc

// The manager when its sessions end: one killed by the server is replaced,
// and Close ends them all.

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestSessionManagerReconnect(t *testing.T) {
	waitsInParallel(t)
	sock := filepath.Join(t.TempDir(), "s.sock")
	srv := smStartEcho(t, sock)
	m := smNewManager(t, sock, 2)
	defer m.Close()

	// One stream on each session.
	held := smUsedStreams(t, m, 2)
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

// rcServer completes the handshake of every client and then, while it is
// not healthy, closes the session at once (as a server does that refuses
// the client after the handshake); once healthy it serves the echo of
// mpServeEcho.
type rcServer struct {
	ln      net.Listener
	conf    *Config
	dials   atomic.Int32 // connections accepted
	healthy atomic.Bool
	wg      sync.WaitGroup

	mu       sync.Mutex
	sessions []*Session // kept open
}

func rcStart(t *testing.T, sock string, conf *Config) *rcServer {
	t.Helper()
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &rcServer{ln: ln, conf: conf}
	srv.wg.Add(1)
	go srv.acceptLoop()
	t.Cleanup(srv.close)
	return srv
}

func (srv *rcServer) acceptLoop() {
	defer srv.wg.Done()
	for {
		c, err := srv.ln.Accept()
		if err != nil {
			return
		}
		srv.dials.Add(1)
		srv.wg.Add(1)
		go func() {
			defer srv.wg.Done()
			s, err := Server(c, srv.conf)
			if err != nil {
				return
			}
			if !srv.healthy.Load() {
				s.Close()
				return
			}
			srv.mu.Lock()
			srv.sessions = append(srv.sessions, s)
			srv.mu.Unlock()
			for {
				st, err := s.AcceptStream()
				if err != nil {
					return
				}
				srv.wg.Add(1)
				go func() {
					defer srv.wg.Done()
					_ = mpServeEcho(st)
				}()
			}
		}()
	}
}

func (srv *rcServer) close() {
	srv.ln.Close()
	srv.mu.Lock()
	for _, s := range srv.sessions {
		s.Close()
	}
	srv.mu.Unlock()
	srv.wg.Wait()
}

// TestSessionManagerBackoffAcrossShortSessions: against a server that
// completes each handshake and drops the session at once, the manager's
// re-dials slow down (the backoff is not reset by a dial whose session dies
// straight away), and once the server is healthy the manager recovers.
func TestSessionManagerBackoffAcrossShortSessions(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: watches a backoff grow over seconds")
	}
	prefix := shmPrefix(t, "rc")
	conf := clConfig(MemMapTypeMemFd, prefix)
	conf.BufferSliceSizes = ReferenceSliceSizes()
	conf.ShareMemoryBufferCap = minBufferCap
	conf.InitializeTimeout = 10 * time.Second
	sock := filepath.Join(t.TempDir(), "s.sock")
	srv := rcStart(t, sock, conf)

	m, err := NewSessionManager(SessionManagerConfig{
		Config:              conf,
		Network:             "unix",
		Address:             sock,
		MinReconnectBackoff: 10 * time.Millisecond,
		MaxReconnectBackoff: 2 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()

	// Doubling from 10 ms, the dials fall 10, 30, 70, 150, 310, 630 and
	// 1270 ms after the first: eight in two seconds. Allow for more.
	const window, maxDials = 2 * time.Second, 20
	time.Sleep(window)
	n := srv.dials.Load()
	t.Logf("%d dials in %v against a server that drops every session", n, window)
	if n > maxDials {
		t.Errorf("%d dials in %v against a server that drops every session, want at most %d", n, window, maxDials)
	}

	srv.healthy.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var lastErr error
	for ctx.Err() == nil {
		st, err := m.GetStreamContext(ctx)
		if err != nil {
			lastErr = err
			continue
		}
		st.SetDeadline(time.Now().Add(5 * time.Second))
		if lastErr = mpRoundTrip(st, mpPayload(64, 3), false); lastErr == nil {
			m.PutBack(st)
			return
		}
		st.Close() // a session dropped before the server became healthy
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("no echo through the manager 20s after the server became healthy: %v", lastErr)
}

package shmipc

// The manager when its sessions end: one killed by the server is replaced,
// and Close ends them all.

import (
	"context"
	"errors"
	"path/filepath"
	"runtime"
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

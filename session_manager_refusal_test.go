package shmipc

// The manager following a server's graceful stop: refused streams move a
// slot to the next server, waking its waiters, at a limited rate, and a
// retired session still ends with Close.

import (
	"context"
	"errors"
	"io"
	"net"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

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
	for _, st := range smUsedStreams(t, m, 2) {
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
	for _, st := range smUsedStreams(t, m, 2) {
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

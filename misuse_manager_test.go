package shmipc

import (
	"context"
	"errors"
	"io"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func mzManager(t *testing.T, addr string, tweak func(*SessionManagerConfig)) *SessionManager {
	t.Helper()
	conf := SessionManagerConfig{Network: "unix", Address: addr, SessionNum: 2,
		MinReconnectBackoff: 5 * time.Millisecond, MaxReconnectBackoff: 50 * time.Millisecond}
	if tweak != nil {
		tweak(&conf)
	}
	m, err := NewSessionManager(conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// TestMisuseManagerPutBackTwice: a stream put back twice must not be handed
// out twice.
func TestMisuseManagerPutBackTwice(t *testing.T) {
	ln := startEchoListener(t, nil)
	m := mzManager(t, ln.Addr().String(), nil)
	st, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	st.SetDeadline(time.Now().Add(mzTimeout))
	if _, err := st.Write([]byte("ab")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(st, make([]byte, 2)); err != nil {
		t.Fatal(err)
	}
	// Twice from two goroutines at once, then once more.
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() { defer wg.Done(); m.PutBack(st) }()
	}
	wg.Wait()
	m.PutBack(st)
	if n := m.IdleStreams(); n != 1 {
		t.Errorf("IdleStreams after putting one stream back thrice: %d", n)
	}
	a, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	b, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	if a == b {
		t.Fatalf("the same stream handed out twice")
	}
	// PutBack of a closed stream, a stream with unread data, a stream with
	// an unflushed message, and a stream of another manager.
	a.Close()
	m.PutBack(a)
	if m.IdleStreams() != 0 {
		t.Errorf("a closed stream was pooled")
	}
	b.SetDeadline(time.Now().Add(mzTimeout))
	b.Write([]byte("zz"))
	waitUntil(t, "the echo arrives", mzTimeout, func() bool { return b.BufferReader().Len() == 2 })
	m.PutBack(b)
	if m.IdleStreams() != 0 {
		t.Errorf("a stream with unread data was pooled")
	}
	if _, err := b.Write([]byte("x")); !errors.Is(err, ErrStreamClosed) {
		t.Errorf("stream with unread data put back: Write %v, want ErrStreamClosed (it must be closed)", err)
	}
	c, _ := m.GetStream()
	c.BufferWriter().WriteString("pending")
	m.PutBack(c)
	if m.IdleStreams() != 0 {
		t.Errorf("a stream with an unflushed message was pooled")
	}
	m2 := mzManager(t, ln.Addr().String(), nil)
	d, err := m2.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	m.PutBack(d)
	if m.IdleStreams() != 0 || m2.IdleStreams() != 0 {
		t.Errorf("a stream of another manager was pooled: %d %d", m.IdleStreams(), m2.IdleStreams())
	}
	m2.PutBack(d) // its own manager, after the other closed it
	if m2.IdleStreams() != 0 {
		t.Errorf("a closed stream was pooled by its own manager")
	}
}

// TestMisuseManagerCloseWhileWaiting: Close ends GetStreamContext and
// DialContext calls waiting for a session, and leaves no goroutine behind.
func TestMisuseManagerCloseWhileWaiting(t *testing.T) {
	base := runtime.NumGoroutine()
	func() {
		sock := sockPath(t)
		ln, err := Listen("unix", sock, nil)
		if err != nil {
			t.Fatal(err)
		}
		go serveStreams(ln, echoStream)
		m, err := NewSessionManager(SessionManagerConfig{Network: "unix", Address: sock, SessionNum: 2,
			MinReconnectBackoff: 5 * time.Millisecond, MaxReconnectBackoff: 20 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		out, err := m.GetStream()
		if err != nil {
			t.Fatal(err)
		}
		ln.CloseAll() // every session dies; re-dials fail
		waitUntil(t, "the sessions die", mzTimeout, func() bool { return len(m.Sessions()) == 0 })
		_, err = m.GetStream()
		mzWantErr(t, "GetStream with no session", err, ErrNoHealthySession)
		errs := make(chan error, 2)
		go func() { _, err := m.GetStreamContext(context.Background()); errs <- err }()
		go func() { _, err := m.DialContext(context.Background(), "x"); errs <- err }()
		waitBlocked(t, "(*SessionManager).GetStreamContext", 1)
		waitBlocked(t, "(*SessionManager).DialContext", 1)
		mzCall(t, "SessionManager.Close", m.Close)
		for range 2 {
			select {
			case err := <-errs:
				mzWantErr(t, "waiting call after Close", err, ErrSessionManagerClosed)
			case <-time.After(mzTimeout):
				t.Fatal("HANG: a waiting GetStreamContext/DialContext did not end on Close")
			}
		}
		_, err = out.Read(make([]byte, 1))
		mzWantErr(t, "Read of a stream of a dead session", err, ErrSessionClosed)
		out.Close()
		// ctx cancellation while waiting.
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		_, err = m.GetStreamContext(ctx)
		mzWantErr(t, "GetStreamContext after Close", err, ErrSessionManagerClosed)
	}()
	mzGoroutines(t, base, 2)
}

// TestMisuseManagerCloseWithStreamsOut: Close while streams are handed out
// and in use on other goroutines.
func TestMisuseManagerCloseWithStreamsOut(t *testing.T) {
	ln := startEchoListener(t, nil)
	base := runtime.NumGoroutine()
	m, err := NewSessionManager(SessionManagerConfig{Network: "unix", Address: ln.Addr().String(), SessionNum: 3})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var rounds atomic.Int64
	for i := range 12 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				st, err := m.GetStream()
				if err != nil {
					if !errors.Is(err, ErrSessionManagerClosed) && !errors.Is(err, ErrNoHealthySession) {
						t.Errorf("GetStream: %v", err)
					}
					return
				}
				st.SetDeadline(time.Now().Add(mzTimeout))
				msg := make([]byte, 100*(i+1))
				if _, err := st.Write(msg); err != nil {
					if !mzAcceptable(err) {
						t.Errorf("Write: %v", err)
					}
					st.Close()
					continue
				}
				if _, err := io.ReadFull(st, msg); err != nil {
					if !mzAcceptable(err) {
						t.Errorf("Read: %v", err)
					}
					st.Close()
					continue
				}
				m.PutBack(st)
				rounds.Add(1)
			}
		}()
	}
	// Close once the users are under way: 200 ms of traffic, or with
	// -short 500 round trips.
	if testing.Short() {
		waitUntil(t, "500 round trips", mzTimeout, func() bool { return rounds.Load() >= 500 })
	} else {
		time.Sleep(200 * time.Millisecond)
	}
	mzCall(t, "Close", m.Close)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(2 * mzTimeout):
		t.Fatal("HANG: users of the manager did not finish after Close")
	}
	mzGoroutines(t, base, 2)
}

// TestMisuseManagerCancelledContext: DialContext and GetStreamContext with a
// context that is already done. net.Dialer.DialContext fails at once with
// the context's error; here a healthy manager hands out a stream anyway.
func TestMisuseManagerCancelledContext(t *testing.T) {
	ln := startEchoListener(t, nil)
	m := mzManager(t, ln.Addr().String(), nil)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	c, err := m.DialContext(ctx, "x")
	if err == nil {
		c.Close()
		t.Errorf("DialContext with a cancelled context: a stream and nil error, want ctx.Err() (as net.Dialer)")
	}
	st, err := m.GetStreamContext(ctx)
	if err == nil {
		st.Close()
		t.Logf("NOTE GetStreamContext with a cancelled context: a stream and nil error")
	}
}

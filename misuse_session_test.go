package shmipc

import (
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestMisuseMaxStreamsReuse: streams closed free their place under
// MaxStreams, whichever side closed them.
func TestMisuseMaxStreamsReuse(t *testing.T) {
	mzModes(t, func(t *testing.T) {
		p := newStreamTestPair(t, MemMapTypeMemFd, func(c *Config) { c.MaxStreams = 4 })
		go serveStreams(p.server, echoStream)
		for round := range 5 {
			var sts []*Stream
			for i := range 4 {
				st, err := p.client.OpenStream()
				if err != nil {
					t.Fatalf("round %d: OpenStream %d: %v", round, i, err)
				}
				st.SetDeadline(time.Now().Add(mzTimeout))
				if _, err := st.Write([]byte("x")); err != nil {
					t.Fatal(err)
				}
				if _, err := io.ReadFull(st, make([]byte, 1)); err != nil {
					t.Fatalf("round %d stream %d: %v (server session: %v)", round, i, err, p.server.Err())
				}
				sts = append(sts, st)
			}
			if _, err := p.client.OpenStream(); !errors.Is(err, ErrLimitExceeded) {
				t.Errorf("round %d: fifth OpenStream: %v, want ErrLimitExceeded", round, err)
			}
			for _, st := range sts {
				st.Close()
			}
			// The server closes its side too (echoStream ends on EOF); the
			// client's places must come back.
			waitUntil(t, "the streams are forgotten", mzTimeout, func() bool {
				p.client.mu.Lock()
				defer p.client.mu.Unlock()
				return len(p.client.streams) == 0
			})
		}
	})
}

// TestMisuseConcurrentSessionClose: Session.Close, Listener.Close and
// Listener.CloseAll from many goroutines at once, with streams open.
func TestMisuseConcurrentSessionClose(t *testing.T) {
	base := runtime.NumGoroutine()
	for r := range 10 {
		ln, err := Listen("unix", sockPath(t), nil)
		if err != nil {
			t.Fatal(err)
		}
		go serveStreams(ln, echoStream)
		var sessions []*Session
		var streams []*Stream
		for range 3 {
			s, err := Dial("unix", ln.Addr().String(), nil)
			if err != nil {
				t.Fatal(err)
			}
			sessions = append(sessions, s)
			for range 3 {
				st, err := s.OpenStream()
				if err != nil {
					t.Fatal(err)
				}
				st.Write([]byte("hi"))
				streams = append(streams, st)
			}
		}
		var wg sync.WaitGroup
		start := make(chan struct{})
		run := func(f func()) {
			wg.Add(1)
			go func() { defer wg.Done(); <-start; f() }()
		}
		for _, s := range sessions {
			run(func() { s.Close() })
			run(func() { s.Close() })
		}
		for _, st := range streams {
			run(func() { st.Close() })
			run(func() { st.Read(make([]byte, 10)) })
		}
		run(func() { ln.Close() })
		run(func() { ln.CloseAll() })
		run(func() { ln.Close() })
		close(start)
		done := make(chan struct{})
		go func() { wg.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(2 * mzTimeout):
			buf := make([]byte, 1<<20)
			t.Fatalf("round %d: HANG\n%s", r, buf[:runtime.Stack(buf, true)])
		}
		ln.CloseAll()
	}
	mzGoroutines(t, base, 2)
}

// TestMisuseCloseFromOnData: the OnData callback closes its stream, and
// another closes the whole session, from inside the callback.
func TestMisuseCloseFromOnData(t *testing.T) {
	mzModes(t, func(t *testing.T) {
		p, cli, srv := mzPair(t, nil)
		cli.Write([]byte("abc"))
		done := OnData(srv, func(st *Stream) error {
			st.BufferReader().Discard(st.BufferReader().Len())
			return st.Close()
		})
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("OnData after the callback closed the stream: %v, want nil", err)
			}
		case <-time.After(mzTimeout):
			t.Fatal("HANG: OnData did not end after its callback closed the stream")
		}
		cli2, err := p.client.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		cli2.Write([]byte("abc"))
		srv2 := acceptWithin(t, p.server, mzTimeout)
		done = OnData(srv2, func(st *Stream) error {
			st.BufferReader().Discard(st.BufferReader().Len())
			return st.Session().Close()
		})
		select {
		case err := <-done:
			t.Logf("OnData after the callback closed the session: %v", err)
		case <-time.After(mzTimeout):
			t.Fatal("HANG: OnData did not end after its callback closed the session")
		}
	})
}

// TestMisuseMaxStreamsServerHoldsClosed: the client never has more than
// MaxStreams streams open, but the server application has not yet closed
// the streams the client closed (it is still finishing them). A new stream
// of the client then ends the whole session with ErrLimitExceeded, which
// kills every other stream of the session too.
func TestMisuseMaxStreamsServerHoldsClosed(t *testing.T) {
	mzModes(t, func(t *testing.T) {
		p := newStreamTestPair(t, MemMapTypeMemFd, func(c *Config) { c.MaxStreams = 2 })
		var held []*Stream
		for i := range 2 {
			st, err := p.client.OpenStream()
			if err != nil {
				t.Fatal(err)
			}
			st.Write([]byte("req"))
			srv := acceptWithin(t, p.server, mzTimeout)
			held = append(held, srv) // the server's handler still works on it
			if i == 0 {
				st.Close()
			} else {
				defer st.Close() // one stream stays open on both sides
			}
		}
		// The server reads the first request and sees the client's close.
		held[0].SetReadDeadline(time.Now().Add(mzTimeout))
		if _, err := io.ReadFull(held[0], make([]byte, 3)); err != nil {
			t.Fatal(err)
		}
		if _, err := held[0].Read(make([]byte, 1)); err != io.EOF {
			t.Fatalf("server read after client close: %v", err)
		}
		// The client has one stream open, below MaxStreams 2.
		st, err := p.client.OpenStream()
		if err != nil {
			t.Fatalf("OpenStream with 1 of 2 open: %v", err)
		}
		defer st.Close()
		st.SetDeadline(time.Now().Add(mzTimeout))
		if _, err := st.Write([]byte("req")); err != nil {
			t.Fatalf("Write: %v", err)
		}
		srv := acceptWithin(t, p.server, 2*time.Second)
		if srv == nil {
			t.Fatalf("not accepted")
		}
		if err := p.server.Err(); err != nil {
			t.Fatalf("the session ended: %v", err)
		}
		for _, h := range held {
			h.Close()
		}
	})
}

// Helpers of the misuse_*_test.go tests: the public API used wrongly or
// unusually, from several goroutines, after Close.

const mzTimeout = 10 * time.Second

// mzModes runs test. (Sessions of one process talk as two processes do,
// so there is one mode.)
func mzModes(t *testing.T, test func(t *testing.T)) { test(t) }

// mzPair returns a client/server session pair and a stream open on both
// sides (one byte exchanged so that the server knows of it).
func mzPair(t *testing.T, tweak func(*Config)) (p *streamTestPair, cli, srv *Stream) {
	t.Helper()
	p = newStreamTestPair(t, MemMapTypeMemFd, tweak)
	cli, err := p.client.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	if _, err := cli.Write([]byte{'x'}); err != nil {
		t.Fatal(err)
	}
	srv = acceptWithin(t, p.server, mzTimeout)
	t.Cleanup(func() { srv.Close() })
	b := make([]byte, 1)
	srv.SetReadDeadline(time.Now().Add(mzTimeout))
	if _, err := io.ReadFull(srv, b); err != nil {
		t.Fatal(err)
	}
	srv.SetReadDeadline(time.Time{})
	return p, cli, srv
}

// mzCall runs f with a time bound and turns a panic into an error; it
// reports whether it finished in time.
func mzCall(t *testing.T, what string, f func() error) (err error, finished bool) {
	t.Helper()
	type res struct {
		err error
		pan any
		stk string
	}
	ch := make(chan res, 1)
	go func() {
		defer func() {
			if r := recover(); r != nil {
				ch <- res{pan: r, stk: string(debug.Stack())}
			}
		}()
		ch <- res{err: f()}
	}()
	select {
	case r := <-ch:
		if r.pan != nil {
			t.Errorf("%s: PANIC: %v\n%s", what, r.pan, r.stk)
			return fmt.Errorf("panic: %v", r.pan), true
		}
		return r.err, true
	case <-time.After(mzTimeout):
		t.Errorf("%s: HANG (no return within %v)", what, mzTimeout)
		return nil, false
	}
}

// mzWantErr checks that err matches want.
func mzWantErr(t *testing.T, what string, err error, want ...error) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: nil error, want one matching %v", what, want)
		return
	}
	for _, w := range want {
		if errors.Is(err, w) {
			return
		}
	}
	t.Errorf("%s: error %q (%T) matches none of %v", what, err, err, want)
}

// mzTimeoutErr checks that err is a deadline error as net.Conn users expect.
func mzTimeoutErr(t *testing.T, what string, err error) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: nil error, want a timeout", what)
		return
	}
	var ne interface{ Timeout() bool }
	if !errors.Is(err, os.ErrDeadlineExceeded) || !errors.As(err, &ne) || !ne.Timeout() {
		t.Errorf("%s: error %q (%T) is not a deadline error", what, err, err)
	}
}

// mzGoroutines waits for the goroutine count to settle at or below base
// (plus slack) and reports the stacks of the extra goroutines if it does not.
func mzGoroutines(t *testing.T, base, slack int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		n := runtime.NumGoroutine()
		if n <= base+slack {
			return
		}
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			var ours []string
			for _, g := range strings.Split(string(buf), "\n\n") {
				if strings.Contains(g, "shmipc") && !strings.Contains(g, "testing.tRunner") && !strings.Contains(g, "mzGoroutines") {
					ours = append(ours, g)
				}
			}
			t.Errorf("goroutines: %d, base %d (+%d slack)\n%s", n, base, slack, strings.Join(ours, "\n\n"))
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

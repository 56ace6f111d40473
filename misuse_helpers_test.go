package shmipc

import (
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"runtime/debug"
	"strings"
	"testing"
	"time"
)

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

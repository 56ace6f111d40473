package shmipc

// The parent's side of the peer death tests: starting and connecting to a
// child, calls expected to fail once it is killed, killing it, and the leak
// checks after.

import (
	"errors"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

// ---------------------------------------------------------------------------
// Parent side

// pdStart starts a child.
func pdStart(t testing.TB, args map[string]string) *proctest.Child {
	t.Helper()
	c, _ := startChild(t, proctest.Config{TestName: pdChildTest, Role: "peerdeath", Args: args})
	return c
}

// pdExpectLine waits for the child to print want (or a line starting with
// want followed by a space).
func pdExpectLine(t testing.TB, c *proctest.Child, want string) string {
	t.Helper()
	for {
		line, err := c.ReadLine(30 * time.Second)
		if err != nil {
			t.Fatalf("waiting for %q: %v\n%s", want, err, c.Output())
		}
		if line == want || strings.HasPrefix(line, want+" ") {
			return line
		}
	}
}

// pdCall is a call running in its own goroutine.
type pdCall struct {
	name string
	done chan struct{}
	err  error
	at   time.Time
}

func pdGo(name string, fn func() error) *pdCall {
	c := &pdCall{name: name, done: make(chan struct{})}
	go func() {
		c.err = fn()
		c.at = time.Now()
		close(c.done)
	}()
	return c
}

// pdLatencies collects error latencies of all tests, for the summary.
var pdLatencies struct {
	sync.Mutex
	d []time.Duration
}

// pdKill kills c while the calls are blocked (checking they are), then
// checks that each fails within pdBound with an error for which ok holds,
// and returns the largest latency, measured from the kill.
func pdKill(t testing.TB, c *proctest.Child, ok func(error) bool, calls ...*pdCall) time.Duration {
	t.Helper()
	for _, call := range calls {
		select {
		case <-call.done:
			t.Fatalf("%s returned before the peer was killed: %v", call.name, call.err)
		default:
		}
	}
	worst := pdKillQuiet(t, c, ok, calls...)
	t.Logf("blocked calls failed at most %v after SIGKILL (%d calls)", worst.Round(10*time.Microsecond), len(calls))
	pdLatencies.Lock()
	pdLatencies.d = append(pdLatencies.d, worst)
	pdLatencies.Unlock()
	return worst
}

// pdKillQuiet is pdKill without the check that the calls are blocked (a
// workload's calls are busy) and without logging.
func pdKillQuiet(t testing.TB, c *proctest.Child, ok func(error) bool, calls ...*pdCall) time.Duration {
	t.Helper()
	killed := time.Now()
	if err := c.Kill(); err != nil {
		t.Fatal(err)
	}
	var worst time.Duration
	for _, call := range calls {
		select {
		case <-call.done:
		case <-time.After(pdBound + 8*time.Second):
			t.Fatalf("%s still running %v after the peer was killed", call.name, pdBound+8*time.Second)
		}
		lat := max(call.at.Sub(killed), 0)
		worst = max(worst, lat)
		if lat > pdBound {
			t.Errorf("%s failed %v after the peer was killed, want <= %v", call.name, lat, pdBound)
		}
		if call.err == nil || !ok(call.err) {
			t.Errorf("%s after the peer was killed: %v", call.name, call.err)
		}
	}
	<-c.Done()
	return worst
}

func pdSessionGone(err error) bool { return errors.Is(err, ErrSessionClosed) }

func pdHandshakeFailed(err error) bool { return errors.Is(err, ErrHandshake) }

// pdGoroutines waits until no more goroutines run than base, and reports
// the shmipc ones otherwise.
func pdGoroutines(t testing.TB, base int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		n := runtime.NumGoroutine()
		if n <= base {
			return
		}
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			var ours []string
			for _, g := range strings.Split(string(buf), "\n\n") {
				if strings.Contains(g, "shmipc.(*") || strings.Contains(g, "shmipc.pd") {
					ours = append(ours, g)
				}
			}
			t.Errorf("%d goroutines 5s after the test, %d before; shmipc ones:\n%s", n, base, strings.Join(ours, "\n\n"))
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// pdLeakCheck takes the baseline and returns the check to run at the end.
func pdLeakCheck(t *testing.T, prefix string) func(what string) {
	base := clBaseline(t, prefix)
	g := runtime.NumGoroutine()
	return func(what string) {
		t.Helper()
		clCheckBack(t, what, base, prefix)
		pdGoroutines(t, g)
	}
}

// pdArgs builds the child's arguments.
func pdArgs(sock, prefix string, mode MemMapType, side, behavior, conf string, kv ...string) map[string]string {
	m := map[string]string{"SOCK": sock, "PREFIX": prefix, "MODE": mode.String(), "SIDE": side, "BEHAVIOR": behavior, "CONF": conf, "NSTREAMS": "1"}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return m
}

// pdPeer is the parent's end of a session with a child.
type pdPeer struct {
	c       *proctest.Child
	sess    *Session
	streams []*Stream
	raw     net.Listener // the parent's listener when the child is the client
}

// pdConnect starts a child on side ("server": the parent dials it;
// "client": it dials the parent) running behavior on nstreams streams, and
// sets up the parent's session and streams (hello sent or read).
func pdConnect(t *testing.T, side, behavior, conf string, mode MemMapType, prefix string, nstreams int) *pdPeer {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "s.sock")
	p := &pdPeer{}
	args := pdArgs(sock, prefix, mode, side, behavior, conf, "NSTREAMS", strconv.Itoa(nstreams))
	if side == "server" {
		p.c = pdStart(t, args)
		sess, err := Dial("unix", sock, pdConfig(conf, mode, prefix))
		if err != nil {
			t.Fatalf("dial the child: %v\n%s", err, p.c.Output())
		}
		p.sess = sess
		for range nstreams {
			st, err := sess.OpenStream()
			if err != nil {
				t.Fatal(err)
			}
			if _, err := st.Write(pdHello); err != nil {
				t.Fatal(err)
			}
			p.streams = append(p.streams, st)
		}
		return p
	}
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	p.raw = ln
	p.c = proctest.Start(t, proctest.Config{TestName: pdChildTest, Role: "peerdeath", Args: args})
	ln.(*net.UnixListener).SetDeadline(time.Now().Add(childStartTimeout)) // a child that fails never dials
	conn, err := ln.Accept()
	if err != nil {
		t.Fatalf("the child did not dial: %v\n%s", err, p.c.Output())
	}
	if p.sess, err = Server(conn, pdConfig(conf, mode, prefix)); err != nil {
		t.Fatalf("server handshake: %v\n%s", err, p.c.Output())
	}
	for range nstreams {
		st, err := p.sess.AcceptStream()
		if err != nil {
			t.Fatal(err)
		}
		st.SetReadDeadline(time.Now().Add(30 * time.Second))
		hello := make([]byte, len(pdHello))
		if _, err := io.ReadFull(st, hello); err != nil {
			t.Fatal(err)
		}
		st.SetReadDeadline(time.Time{})
		p.streams = append(p.streams, st)
	}
	if _, err := p.c.WaitReady(childStartTimeout); err != nil {
		t.Fatalf("%v\n%s", err, p.c.Output())
	}
	return p
}

// close closes the parent's streams, session and listener.
func (p *pdPeer) close() {
	for _, st := range p.streams {
		st.Close()
	}
	p.sess.Close()
	if p.raw != nil {
		p.raw.Close()
	}
}

// pdFresh checks that a new session to a new child works: the parent dials
// a new echo server child and runs two round trips.
func pdFresh(t *testing.T, mode MemMapType, prefix string) {
	t.Helper()
	p := pdConnect(t, "server", "echo", "default", mode, prefix, 1)
	st := p.streams[0]
	st.SetDeadline(time.Now().Add(30 * time.Second))
	for i, n := range []int{64, 300000} {
		if err := mpRoundTrip(st, mpPayload(n, uint64(i)), i == 1); err != nil {
			t.Errorf("fresh session after the peer's death: %v", err)
		}
	}
	p.close()
	if err := p.c.Stop(30 * time.Second); err != nil {
		t.Errorf("fresh child: %v\n%s", err, p.c.Output())
	}
}

// pdFreshAfter registers, at the start of a top-level test, a check that
// runs after its subtests: a new session to a new child works, in each
// mode, and nothing leaked.
func pdFreshAfter(t *testing.T, modes ...MemMapType) {
	prefix := shmPrefix(t, "pdf")
	check := pdLeakCheck(t, prefix)
	t.Cleanup(func() {
		if t.Failed() {
			return
		}
		for _, mode := range modes {
			pdFresh(t, mode, prefix)
		}
		check("after the fresh sessions")
	})
}

// pdBlockedRead is a Read on st as a pdCall.
func pdBlockedRead(st *Stream) *pdCall {
	return pdGo(fmt.Sprintf("Read on stream %d", st.ID()), func() error {
		_, err := st.Read(make([]byte, 64))
		return err
	})
}

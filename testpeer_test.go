package shmipc

// Test peers shared by the test files: unique names for sockets and
// /dev/shm files, connection pairs, echo servers, a real server with a
// well-behaved session beside the one under test, handshakes run in the
// background, and bounded waits.

import (
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

// ---- names and configuration ----

// peerTimeout bounds every wait of these tests.
const peerTimeout = 5 * time.Second

// bothModes are the two kinds of shared memory: /dev/shm files (which
// protocol version 2 requires) and memfds (version 3 only).
var bothModes = []MemMapType{MemMapTypeDevShmFile, MemMapTypeMemFd}

// modeName names a mode in subtest names.
func modeName(mode MemMapType) string {
	if mode == MemMapTypeMemFd {
		return "v3 memfd"
	}
	return "v2 file"
}

// shmPrefix returns a ShareMemoryPathPrefix no other test or process uses,
// /dev/shm/shmipc_<tag>_<pid>_<random>, and removes whatever is left under it
// when the test ends.
func shmPrefix(t testing.TB, tag string) string {
	t.Helper()
	p := fmt.Sprintf("/dev/shm/shmipc_%s_%d_%08x", tag, os.Getpid(), rand.Uint32())
	t.Cleanup(func() {
		for _, f := range shmFiles(p) {
			_ = os.Remove(f)
		}
	})
	return p
}

// shmFiles lists the files whose path starts with prefix.
func shmFiles(prefix string) []string {
	dir, base := filepath.Dir(prefix), filepath.Base(prefix)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return []string{"readdir " + dir + ": " + err.Error()}
	}
	var out []string
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), base) {
			out = append(out, filepath.Join(dir, e.Name()))
		}
	}
	return out
}

// sockPath is a socket path in a directory of the test's own.
func sockPath(t testing.TB) string {
	return filepath.Join(t.TempDir(), "s.sock")
}

// peerConfig is a small configuration: a 1 MiB buffer region of the
// reference slice sizes (63, 9 and 1 slices), 64-element queues.
func peerConfig(t *testing.T, mode MemMapType, spin time.Duration) *Config {
	t.Helper()
	c := DefaultConfig()
	c.MemMapType = mode
	c.ShareMemoryBufferCap = 1 << 20
	c.BufferSliceSizes = ReferenceSliceSizes()
	c.QueueCap = 64
	c.InitializeTimeout = peerTimeout
	c.MaxFallbackFrameSize = minFallbackFrame
	c.ConsumerSpinTime = spin
	c.ShareMemoryPathPrefix = shmPrefix(t, "peer")
	return c
}

// readerSpin is the ConsumerSpinTime of victims whose corruption must be
// found by a reader polling the queue rather than by a wake-up frame.
const readerSpin = 300 * time.Millisecond

// ---- connections ----

// unixPair returns both ends of a Unix stream connection made through a
// socket of the test's own: the dialing end and the accepted end.
func unixPair(t *testing.T) (dialed, accepted *net.UnixConn) {
	t.Helper()
	ln, err := net.Listen("unix", sockPath(t))
	if err != nil {
		t.Fatal(err)
	}
	d, a := connPair(t, ln)
	return d.(*net.UnixConn), a.(*net.UnixConn)
}

// tcpPair is unixPair over TCP loopback.
func tcpPair(t *testing.T) (dialed, accepted net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return connPair(t, ln)
}

// connPair dials ln, accepts the connection and closes ln. Both ends are
// closed when the test ends.
func connPair(t *testing.T, ln net.Listener) (dialed, accepted net.Conn) {
	t.Helper()
	defer ln.Close()
	ch := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		ch <- c
	}()
	dialed, err := net.Dial(ln.Addr().Network(), ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	accepted = <-ch
	if accepted == nil {
		dialed.Close()
		t.Fatal("accept failed")
	}
	t.Cleanup(func() {
		dialed.Close()
		accepted.Close()
	})
	return dialed, accepted
}

// ---- serving streams ----

// streamAcceptor is a Listener or a Session.
type streamAcceptor interface {
	AcceptStream() (*Stream, error)
}

// serveStreams runs handle on a goroutine of its own for every stream a
// accepts, until accepting fails.
func serveStreams(a streamAcceptor, handle func(*Stream)) {
	for {
		st, err := a.AcceptStream()
		if err != nil {
			return
		}
		go handle(st)
	}
}

// serveStreamsCounted is serveStreams on a goroutine of its own, counting
// it and every handler in wg, so that wg.Wait returns once a has stopped
// accepting and every handler has returned.
func serveStreamsCounted(a streamAcceptor, wg *sync.WaitGroup, handle func(*Stream)) {
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			st, err := a.AcceptStream()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				handle(st)
			}()
		}
	}()
}

// echoStream echoes a stream until it ends, then closes it.
func echoStream(st *Stream) {
	defer st.Close()
	_, _ = io.Copy(st, st)
}

// acceptWithin waits up to within for the next stream a accepts.
func acceptWithin(t testing.TB, a streamAcceptor, within time.Duration) *Stream {
	t.Helper()
	type result struct {
		st  *Stream
		err error
	}
	ch := make(chan result, 1)
	go func() {
		st, err := a.AcceptStream()
		ch <- result{st, err}
	}()
	select {
	case r := <-ch:
		if r.err != nil {
			t.Fatalf("AcceptStream: %v", r.err)
		}
		return r.st
	case <-time.After(within):
		t.Fatalf("no stream accepted within %v", within)
		return nil
	}
}

// startEchoListener listens on a socket of the test's own with conf and
// echoes every stream; the listener is closed when the test ends.
func startEchoListener(t testing.TB, conf *Config) *Listener {
	t.Helper()
	ln, err := Listen("unix", sockPath(t), conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go serveStreams(ln, echoStream)
	return ln
}

// dialEchoSession starts an echo listener with conf and dials it; the
// session and the listener are closed when the test ends.
func dialEchoSession(t testing.TB, conf *Config) *Session {
	t.Helper()
	ln := startEchoListener(t, conf)
	sess, err := Dial("unix", ln.Addr().String(), conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sess.Close() })
	return sess
}

// echoRoundTrip does one echo round trip on a client session.
func echoRoundTrip(s *Session, msg string) error {
	st, err := s.OpenStream()
	if err != nil {
		return fmt.Errorf("OpenStream: %w", err)
	}
	defer st.Close()
	st.SetDeadline(time.Now().Add(peerTimeout))
	if _, err := st.Write([]byte(msg)); err != nil {
		return fmt.Errorf("Write: %w", err)
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(st, got); err != nil {
		return fmt.Errorf("reading the echo: %w", err)
	}
	if string(got) != msg {
		return fmt.Errorf("echo %q, want %q", got, msg)
	}
	return nil
}

// mustEcho does one echo round trip on a client session and fails the test
// if it does not come back.
func mustEcho(t testing.TB, s *Session) {
	t.Helper()
	if err := echoRoundTrip(s, "hello, shmipc"); err != nil {
		t.Fatal(err)
	}
}

// ---- a real server with a good session ----

// testServer is a Listener that echoes every stream, with a well-behaved
// client session for checking that the process still serves others.
type testServer struct {
	conf *Config
	ln   *Listener
	addr string
	good *Session
}

func startTestServer(t *testing.T, spin time.Duration) *testServer {
	t.Helper()
	conf := peerConfig(t, MemMapTypeMemFd, spin)
	ln, err := Listen("unix", filepath.Join(t.TempDir(), "hp.sock"), conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go serveStreams(ln, echoStream)
	env := &testServer{conf: conf, ln: ln, addr: ln.Addr().String()}
	good, err := Dial("unix", env.addr, peerConfig(t, MemMapTypeMemFd, 0))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { good.Close() })
	env.good = good
	if err := echoRoundTrip(good, "warm-up"); err != nil {
		t.Fatalf("good session: %v", err)
	}
	return env
}

// checkGood runs an echo on the well-behaved session after a case.
func (e *testServer) checkGood(t *testing.T) {
	t.Helper()
	if err := echoRoundTrip(e.good, "still fine after "+t.Name()); err != nil {
		t.Errorf("the other session stopped working: %v", err)
	}
}

func (e *testServer) sessionSet() map[*Session]bool { return listenerSessions(e.ln) }

// listenerSessions returns the set of ln's sessions.
func listenerSessions(ln *Listener) map[*Session]bool {
	ln.mu.Lock()
	defer ln.mu.Unlock()
	m := make(map[*Session]bool, len(ln.sessions))
	for s := range ln.sessions {
		m[s] = true
	}
	return m
}

// waitSession returns the session the listener registered after before.
func (e *testServer) waitSession(t *testing.T, before map[*Session]bool) *Session {
	t.Helper()
	var found *Session
	waitUntil(t, "the listener registers a session for the raw client", peerTimeout, func() bool {
		for s := range e.sessionSet() {
			if !before[s] {
				found = s
			}
		}
		return found != nil
	})
	return found
}

// ---- handshakes in the background ----

// handshakeResult is what Client, Server or Dial returned, and how long it
// took.
type handshakeResult struct {
	s    *Session
	err  error
	took time.Duration
}

// startHandshake runs f (Client, Server or Dial) in the background.
func startHandshake(f func() (*Session, error)) <-chan handshakeResult {
	ch := make(chan handshakeResult, 1)
	start := time.Now()
	go func() {
		s, err := f()
		ch <- handshakeResult{s, err, time.Since(start)}
	}()
	return ch
}

// awaitHandshake waits up to within for the result of startHandshake. A
// session it returns is closed when the test ends.
func awaitHandshake(t *testing.T, ch <-chan handshakeResult, within time.Duration) handshakeResult {
	t.Helper()
	select {
	case r := <-ch:
		if r.s != nil {
			t.Cleanup(func() { closeWithin(t, r.s, peerTimeout) })
		}
		return r
	case <-time.After(within):
		t.Fatalf("handshake still running after %v", within)
		return handshakeResult{}
	}
}

// ---- waiting and closing ----

// waitUntil polls cond until it holds, for up to within.
func waitUntil(t testing.TB, what string, within time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, within)
		}
		time.Sleep(time.Millisecond)
	}
}

// waitSessionClosed waits up to within for s to end and returns its error.
func waitSessionClosed(t testing.TB, s *Session, within time.Duration) error {
	t.Helper()
	waitUntil(t, "the "+s.role()+" session ends", within, s.IsClosed)
	return s.Err()
}

// closeWithin closes s and fails the test if Close does not return within
// the given time.
func closeWithin(t testing.TB, s *Session, within time.Duration) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		s.Close()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(within):
		t.Errorf("Session.Close still running after %v", within)
	}
}

// errWithin returns the error ch delivers, and ends the test with what if
// none comes within the given time.
func errWithin(t testing.TB, ch <-chan error, within time.Duration, what string) error {
	t.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(within):
		t.Fatalf("%s after %v", what, within)
		return nil
	}
}

// expectClosedWith waits for a victim session to close and checks that its
// error wraps is (ErrProtocol when nil) and mentions every word of want.
func expectClosedWith(t *testing.T, s *Session, is error, want []string) {
	t.Helper()
	err := waitSessionClosed(t, s, peerTimeout)
	if is == nil {
		is = ErrProtocol
	}
	if !errors.Is(err, ErrSessionClosed) {
		t.Errorf("session error %v: want ErrSessionClosed", err)
	}
	checkVictimError(t, "session error", err, is, want)
}

// checkVictimError checks the error a victim of a hostile peer returned:
// it must wrap is and mention every word of want (in any case).
func checkVictimError(t *testing.T, what string, err, is error, want []string) {
	t.Helper()
	t.Logf("victim: %v", err)
	if !errors.Is(err, is) {
		t.Errorf("%s %v: want %v", what, err, is)
	}
	msg := strings.ToLower(fmt.Sprint(err))
	for _, w := range want {
		if !strings.Contains(msg, strings.ToLower(w)) {
			t.Errorf("%s %q does not mention %q", what, err, w)
		}
	}
}

// Child processes: the test binary re-executed to run one role of a test
// (internal/proctest), for behaviour that needs a real second process.

// childStartTimeout bounds how long a child may take to say it is ready: a
// loaded machine running -race binaries starts them slowly.
const childStartTimeout = 30 * time.Second

// startChild starts a child as conf says and waits until it is ready. It
// returns the child and what its ready line carried after "ready". A child
// that does not get ready fails the test with its output.
func startChild(t testing.TB, conf proctest.Config) (*proctest.Child, string) {
	t.Helper()
	c := proctest.Start(t, conf)
	info, err := c.WaitReady(childStartTimeout)
	if err != nil {
		t.Fatalf("child %s (%s) did not get ready: %v\n%s", conf.TestName, conf.Role, err, c.Output())
	}
	return c, info
}

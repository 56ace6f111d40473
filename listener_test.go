package shmipc

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

const (
	lnChildTest = "TestListenerChild"
	// lnRoleEcho listens on SOCK (Listen) and serves the echo of
	// mpServeEcho until its stdin closes; it may be killed instead.
	lnRoleEcho = "listen-echo"
)

// TestListenerChild is the body of the child processes of this file. In a
// normal run it skips itself.
func TestListenerChild(t *testing.T) {
	switch proctest.Role() {
	case "":
		t.Skip("runs only as the child process of the listener tests")
	case lnRoleEcho:
		conf := clConfig(MemMapTypeMemFd, proctest.MustArg(t, "PREFIX"))
		srv := clStartEcho(t, proctest.MustArg(t, "SOCK"), conf)
		proctest.Ready()
		<-proctest.StdinClosed()
		srv.close(t)
	default:
		t.Fatalf("unknown child role %q", proctest.Role())
	}
}

// lnStartChild starts a child in role on sock and waits until it is ready.
func lnStartChild(t *testing.T, role, sock, prefix string) *proctest.Child {
	t.Helper()
	c, _ := startChild(t, proctest.Config{
		TestName: lnChildTest,
		Role:     role,
		Args:     map[string]string{"SOCK": sock, "PREFIX": prefix},
	})
	return c
}

// lnEchoOnce dials sock and runs one echo round trip on a new stream.
func lnEchoOnce(sock string, conf *Config) error {
	sess, err := Dial("unix", sock, conf)
	if err != nil {
		return err
	}
	defer sess.Close()
	st, err := sess.OpenStream()
	if err != nil {
		return err
	}
	defer st.Close()
	st.SetDeadline(time.Now().Add(10 * time.Second))
	return mpRoundTrip(st, mpPayload(100, 1), false)
}

// TestListenTakesOverStaleSocket: a server process is SIGKILLed and leaves
// its socket file behind; a new Listen on the path succeeds (nobody listens
// there, so the file is stale) and serves clients.
func TestListenTakesOverStaleSocket(t *testing.T) {
	prefix := shmPrefix(t, "ln")
	sock := filepath.Join(t.TempDir(), "s.sock")
	c := lnStartChild(t, lnRoleEcho, sock, prefix)
	if err := c.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := c.Wait(10 * time.Second); err == nil {
		t.Fatal("the killed child exited cleanly")
	}
	if fi, err := os.Lstat(sock); err != nil || fi.Mode().Type() != os.ModeSocket {
		t.Fatalf("the killed server left no socket file at %s (%v): nothing to test", sock, err)
	}

	conf := clConfig(MemMapTypeMemFd, prefix)
	srv := clStartEcho(t, sock, conf) // Listen; fails the test on error
	if err := lnEchoOnce(sock, conf); err != nil {
		t.Errorf("echo through the new listener: %v", err)
	}
	srv.close(t)
	if _, err := os.Lstat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket file after Listener.Close: %v, want it removed", err)
	}
}

// TestListenRefusesLiveSocket: Listen on the path of a live server (another
// process) fails with EADDRINUSE and leaves that server working.
func TestListenRefusesLiveSocket(t *testing.T) {
	prefix := shmPrefix(t, "ln")
	sock := filepath.Join(t.TempDir(), "s.sock")
	c := lnStartChild(t, lnRoleEcho, sock, prefix)
	conf := clConfig(MemMapTypeMemFd, prefix)

	ln, err := Listen("unix", sock, conf)
	if err == nil {
		ln.Close()
		t.Fatal("Listen on a live server's socket succeeded")
	}
	if !errors.Is(err, syscall.EADDRINUSE) || !strings.Contains(err.Error(), "live server") {
		t.Errorf("Listen on a live server's socket: %v; want EADDRINUSE naming the live server", err)
	}
	if err := lnEchoOnce(sock, conf); err != nil {
		t.Errorf("echo with the live server after the refused Listen: %v\n%s", err, c.Output())
	}
	if err := c.Stop(20 * time.Second); err != nil {
		t.Errorf("child server: %v\n%s", err, c.Output())
	}
}

// TestListenRefusesNonSocketFile: a file at the address that is not a
// socket is never removed.
func TestListenRefusesNonSocketFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "not-a-socket")
	if err := os.WriteFile(path, []byte("keep me"), 0o600); err != nil {
		t.Fatal(err)
	}
	ln, err := Listen("unix", path, clConfig(MemMapTypeMemFd, shmPrefix(t, "ln")))
	if err == nil {
		ln.Close()
		t.Fatal("Listen over a regular file succeeded")
	}
	if !errors.Is(err, syscall.EADDRINUSE) {
		t.Errorf("Listen over a regular file: %v, want EADDRINUSE", err)
	}
	if b, err := os.ReadFile(path); err != nil || string(b) != "keep me" {
		t.Errorf("the regular file after Listen: %q, %v; want it untouched", b, err)
	}
}

// lnFlakyListener is a net.Listener whose first failures Accept calls fail
// with err before it passes on to the real listener.
type lnFlakyListener struct {
	net.Listener
	failures atomic.Int32
	err      error
}

func (l *lnFlakyListener) Accept() (net.Conn, error) {
	if l.failures.Add(-1) >= 0 {
		return nil, l.err
	}
	return l.Listener.Accept()
}

// lnRecorder is a slog.Handler that keeps the records it is given.
type lnRecorder struct {
	mu      sync.Mutex
	records []slog.Record
}

func (h *lnRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (h *lnRecorder) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *lnRecorder) WithGroup(string) slog.Handler            { return h }
func (h *lnRecorder) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	h.records = append(h.records, r.Clone())
	h.mu.Unlock()
	return nil
}

// matching returns the records at level whose message contains msg and one
// of whose attributes' values contains attr.
func (h *lnRecorder) matching(level slog.Level, msg, attr string) []slog.Record {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []slog.Record
	for _, r := range h.records {
		if r.Level != level || !strings.Contains(r.Message, msg) {
			continue
		}
		r.Attrs(func(a slog.Attr) bool {
			if strings.Contains(a.Value.String(), attr) {
				out = append(out, r)
				return false
			}
			return true
		})
	}
	return out
}

// TestListenerRetriesAcceptErrors: Accept failing with ENFILE (the system
// is out of file descriptors for a moment) does not stop the listener: it
// logs each failure as a warning, tries again, and serves the client that
// connected meanwhile.
func TestListenerRetriesAcceptErrors(t *testing.T) {
	prefix := shmPrefix(t, "ln")
	sock := filepath.Join(t.TempDir(), "s.sock")
	raw, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	const failures = 3
	flaky := &lnFlakyListener{Listener: raw, err: &net.OpError{
		Op: "accept", Net: "unix", Addr: raw.Addr(), Err: os.NewSyscallError("accept4", syscall.ENFILE),
	}}
	flaky.failures.Store(failures)
	logs := &lnRecorder{}
	conf := clConfig(MemMapTypeMemFd, prefix)
	conf.Logger = slog.New(logs)
	ln := NewListener(flaky, conf)
	served := make(chan error, 1)
	go func() { served <- ln.Serve(func(st *Stream) { _ = mpServeEcho(st) }) }()

	clientConf := clConfig(MemMapTypeMemFd, prefix)
	clientConf.InitializeTimeout = 10 * time.Second // fails the echo if nobody accepts
	if err := lnEchoOnce(sock, clientConf); err != nil {
		t.Errorf("echo while Accept had failed %d times: %v", failures, err)
	}
	if got := logs.matching(slog.LevelWarn, "accept", syscall.ENFILE.Error()); len(got) != failures {
		t.Errorf("%d warnings about the failed Accept, want %d (one per failure)", len(got), failures)
	}
	if err := ln.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	select {
	case err := <-served:
		if !errors.Is(err, ErrListenerClosed) {
			t.Errorf("Serve returned %v, want ErrListenerClosed", err)
		}
	case <-time.After(10 * time.Second):
		t.Error("Serve did not return 10s after Close")
	}
}

// lnServeOne accepts streams on ln and echoes each (mpServeEcho) until
// Accept fails; accept receives every stream as it is accepted and errs the
// handlers' errors.
func lnServeOne(ln *Listener) (accepted <-chan *Stream, errs <-chan error) {
	acc := make(chan *Stream, 16)
	ec := make(chan error, 16)
	go func() {
		for {
			st, err := ln.AcceptStream()
			if err != nil {
				close(acc)
				return
			}
			acc <- st
			go func() { ec <- mpServeEcho(st) }()
		}
	}()
	return acc, ec
}

// lnLive is a listener (closed with CloseAll when the test ends), a client
// session, and one stream on it that has done a round trip with a
// lnServeOne handler; srv is the server's session.
type lnLive struct {
	ln          *Listener
	sock        string
	conf        *Config
	sess        *Session
	live        *Stream
	accepted    <-chan *Stream
	handlerErrs <-chan error
	srv         *Session
}

func lnStartLive(t *testing.T) *lnLive {
	t.Helper()
	l := &lnLive{
		conf: clConfig(MemMapTypeMemFd, shmPrefix(t, "ln")),
		sock: filepath.Join(t.TempDir(), "s.sock"),
	}
	var err error
	if l.ln, err = Listen("unix", l.sock, l.conf); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.ln.CloseAll() })
	if l.sess, err = Dial("unix", l.sock, l.conf); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.sess.Close() })
	l.accepted, l.handlerErrs = lnServeOne(l.ln)
	if l.live, err = l.sess.OpenStream(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.live.Close() })
	l.live.SetDeadline(time.Now().Add(10 * time.Second))
	if err := mpRoundTrip(l.live, mpPayload(100, 1), false); err != nil {
		t.Fatal(err)
	}
	l.srv = (<-l.accepted).Session()
	return l
}

// TestListenerCloseStopsAcceptingOnly: Close behaves as a net.Listener's
// Close. Streams already accepted keep working, a stream opened and not
// accepted is closed, so is a stream opened after Close, nobody can connect
// any more, and the session ends once its last stream is closed. This is
// what grpc.Server.GracefulStop needs: it closes its listener and then
// waits for the calls in progress.
func TestListenerCloseStopsAcceptingOnly(t *testing.T) {
	l := lnStartLive(t)
	ln, sock, conf, sess, live, accepted, handlerErrs, srvSess := l.ln, l.sock, l.conf, l.sess, l.live, l.accepted, l.handlerErrs, l.srv

	if err := ln.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if _, ok := <-accepted; ok {
		t.Error("a stream was accepted after Close")
	}
	if _, err := ln.Accept(); !errors.Is(err, ErrListenerClosed) || !errors.Is(err, net.ErrClosed) {
		t.Errorf("Accept after Close: %v, want ErrListenerClosed, matching net.ErrClosed", err)
	}
	if _, err := os.Lstat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket file after Close: %v, want it removed", err)
	}
	if s, err := Dial("unix", sock, conf); err == nil {
		s.Close()
		t.Error("Dial after Close succeeded")
	}

	// The accepted stream works on, in both directions, several times.
	for i := range 3 {
		if err := mpRoundTrip(live, mpPayload(1000*(i+1), uint64(i)), i%2 == 0); err != nil {
			t.Fatalf("round trip %d on the accepted stream after Close: %v", i, err)
		}
	}
	if srvSess.IsClosed() || sess.IsClosed() {
		t.Fatal("the session ended while it had an open stream")
	}

	// A stream opened after Close is closed by the server: its reader gets
	// io.EOF, and the accepted stream is not disturbed.
	late, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	late.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := late.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	if _, err := late.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("read on a stream opened after Close: %v, want io.EOF", err)
	}
	late.Close()
	if err := mpRoundTrip(live, mpPayload(10, 9), false); err != nil {
		t.Fatalf("round trip on the accepted stream after a refused one: %v", err)
	}

	// The client closes its last stream: the handler returns and the
	// session ends on both sides.
	live.Close()
	if err := <-handlerErrs; err != nil {
		t.Errorf("handler: %v", err)
	}
	lnWaitClosed(t, "server session", srvSess)
	lnWaitClosed(t, "client session", sess)
	if err := sess.Err(); !errors.Is(err, ErrPeerClosed) {
		t.Errorf("client session ended with %v, want ErrPeerClosed", err)
	}
}

// TestListenerCloseQueuedAndIdle: at Close, a stream opened and not yet
// accepted is closed (its client reads io.EOF), and a session with no
// stream ends at once.
func TestListenerCloseQueuedAndIdle(t *testing.T) {
	prefix := shmPrefix(t, "ln")
	conf := clConfig(MemMapTypeMemFd, prefix)
	sock := filepath.Join(t.TempDir(), "s.sock")
	ln, err := Listen("unix", sock, conf)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.CloseAll()
	queuedSess, err := Dial("unix", sock, conf)
	if err != nil {
		t.Fatal(err)
	}
	defer queuedSess.Close()
	idleSess, err := Dial("unix", sock, conf)
	if err != nil {
		t.Fatal(err)
	}
	defer idleSess.Close()
	queued, err := queuedSess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer queued.Close()
	queued.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := queued.Write([]byte("nobody accepts this")); err != nil {
		t.Fatal(err)
	}
	// The server has the stream once its session counts it.
	waitUntil(t, "the stream reached the server", 10*time.Second, func() bool {
		for _, s := range ln.liveSessions() {
			if s.Stats().ActiveStreams == 1 {
				return true
			}
		}
		return false
	})

	if err := ln.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if _, err := queued.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("read on a stream that was never accepted: %v, want io.EOF", err)
	}
	lnWaitClosed(t, "the session whose only stream was never accepted", queuedSess)
	lnWaitClosed(t, "the session with no stream", idleSess)
}

// TestListenerCloseAll: CloseAll ends the sessions at once, open streams
// and all, on both sides.
func TestListenerCloseAll(t *testing.T) {
	l := lnStartLive(t)
	ln, st, handlerErrs, srvSess := l.ln, l.live, l.handlerErrs, l.srv

	// Close first, then CloseAll: CloseAll ends what Close left running.
	if err := ln.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if err := ln.CloseAll(); err != nil {
		t.Errorf("CloseAll: %v", err)
	}
	if !srvSess.IsClosed() {
		t.Error("a session of the listener is open after CloseAll returned")
	}
	if err := <-handlerErrs; !errors.Is(err, ErrSessionClosed) {
		t.Errorf("handler blocked in a read: %v, want ErrSessionClosed", err)
	}
	if _, err := st.Read(make([]byte, 1)); !errors.Is(err, ErrPeerClosed) {
		t.Errorf("client read after CloseAll: %v, want ErrPeerClosed", err)
	}
}

// lnWaitClosed waits up to 10 s for s to end.
func lnWaitClosed(t *testing.T, what string, s *Session) {
	t.Helper()
	select {
	case <-s.closed:
	case <-time.After(10 * time.Second):
		t.Errorf("%s still open 10s after Close", what)
	}
}

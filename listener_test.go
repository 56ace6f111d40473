package shmipc

import (
	"context"
	"errors"
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

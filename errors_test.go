package shmipc

import (
	"errors"
	"net"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// refusedSocket returns the path of a socket file nobody listens on.
func refusedSocket(t *testing.T) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "refused.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	ln.Close()
	return sock
}

// TestErrorsSayEachThingOnce checks the messages of a refused dial and of
// failed listens, word for word: one prefix, the operation, the address and
// the cause, once each.
func TestErrorsSayEachThingOnce(t *testing.T) {
	sock := refusedSocket(t)
	missing := filepath.Join(t.TempDir(), "no", "such", "dir.sock")
	live := startEchoListener(t, DefaultConfig()).Addr().String()

	_, dialErr := Dial("unix", sock, nil)
	_, listenErr := Listen("unix", missing, nil)
	_, liveErr := Listen("unix", live, nil)
	for _, tc := range []struct {
		err  error
		want string
		is   error
	}{
		{dialErr, "shmipc: dial unix " + sock + ": connect: connection refused", syscall.ECONNREFUSED},
		{listenErr, "shmipc: listen unix " + missing + ": bind: no such file or directory", syscall.ENOENT},
		{liveErr, "shmipc: listen unix " + live + ": bind: address already in use: a live server listens there", syscall.EADDRINUSE},
	} {
		if tc.err == nil {
			t.Errorf("no error, want %q", tc.want)
			continue
		}
		if got := tc.err.Error(); got != tc.want {
			t.Errorf("error %q, want %q", got, tc.want)
		}
		if !errors.Is(tc.err, tc.is) {
			t.Errorf("error %q does not wrap %v", tc.err, tc.is)
		}
	}
}

// TestManagerErrorSaysEachThingOnce: a manager whose server refuses says
// "shmipc: " once and the address once, and wraps both its own sentinel
// and the cause.
func TestManagerErrorSaysEachThingOnce(t *testing.T) {
	sock := refusedSocket(t)
	m, err := NewSessionManager(SessionManagerConfig{Network: "unix", Address: sock})
	if err == nil {
		defer m.Close()
		_, err = m.GetStream()
	}
	if err == nil {
		t.Fatal("no error from a manager whose server refuses")
	}
	msg := err.Error()
	t.Log(msg)
	for _, word := range []string{"shmipc: ", sock, "dial", "connection refused"} {
		if n := strings.Count(msg, word); n != 1 {
			t.Errorf("%q says %q %d times, want once", msg, word, n)
		}
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("%v does not wrap ECONNREFUSED", err)
	}
}

// TestOncePrefixed: the errors a message quotes lose their prefix; its own
// stays.
func TestOncePrefixed(t *testing.T) {
	err := errorf("%w: %w (%w)", ErrSessionClosed, ErrProtocol, ErrQueueFull)
	if got, want := err.Error(), "shmipc: session closed: protocol violation (IO queue full)"; got != want {
		t.Errorf("%q, want %q", got, want)
	}
	for _, e := range []error{ErrSessionClosed, ErrProtocol, ErrQueueFull} {
		if !errors.Is(err, e) {
			t.Errorf("%v does not wrap %v", err, e)
		}
	}
}

package shmipc

// Test peers shared by the tests that play one side of a session by hand:
// unique /dev/shm names, a small configuration, a real server with an echo
// handler and a well-behaved session, and bounded waits for a session to
// start or end.

import (
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// hpTimeout bounds every wait of these tests.
const hpTimeout = 5 * time.Second

// hpReaderSpin is the ConsumerSpinTime of victims whose corruption must be
// found by a reader polling the queue rather than by a wake-up frame.
const hpReaderSpin = 300 * time.Millisecond

const hpMagic = 0x7758

var hpSeq atomic.Uint32

// hpModes: version 2 over /dev/shm files and version 3 over memfds.
var hpModes = []MemMapType{MemMapTypeDevShmFile, MemMapTypeMemFd}

// hpPrefix returns /dev/shm/shmipc_hp_<pid>_<rand> and removes whatever is
// left under it when the test ends.
func hpPrefix(t *testing.T) string {
	t.Helper()
	p := fmt.Sprintf("/dev/shm/shmipc_hp_%d_%08x", os.Getpid(), rand.Uint32())
	t.Cleanup(func() {
		m, _ := filepath.Glob(p + "_*")
		for _, f := range m {
			os.Remove(f)
		}
	})
	return p
}

// hpConfig is a small configuration: a 1 MiB buffer region of the
// reference slice sizes (63, 9 and 1 slices), 64-element queues.
func hpConfig(t *testing.T, mode MemMapType, spin time.Duration) *Config {
	t.Helper()
	c := DefaultConfig()
	c.MemMapType = mode
	c.ShareMemoryBufferCap = 1 << 20
	c.BufferSliceSizes = ReferenceSliceSizes()
	c.QueueCap = 64
	c.InitializeTimeout = hpTimeout
	c.MaxFallbackFrameSize = minFallbackFrame
	c.ConsumerSpinTime = spin
	c.ShareMemoryPathPrefix = hpPrefix(t)
	return c
}

// ---- the real server side: a Listener with an echo handler and a good
// client session ----

type hpServerEnv struct {
	conf *Config
	ln   *Listener
	addr string
	good *Session
}

func hpStartServer(t *testing.T, spin time.Duration) *hpServerEnv {
	t.Helper()
	conf := hpConfig(t, MemMapTypeMemFd, spin)
	ln, err := Listen("unix", filepath.Join(t.TempDir(), "hp.sock"), conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			st, err := ln.AcceptStream()
			if err != nil {
				return
			}
			go func() {
				defer st.Close()
				io.Copy(st, st)
			}()
		}
	}()
	env := &hpServerEnv{conf: conf, ln: ln, addr: ln.Addr().String()}
	good, err := Dial("unix", env.addr, hpConfig(t, MemMapTypeMemFd, 0))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { good.Close() })
	env.good = good
	if err := hpEcho(good, "warm-up"); err != nil {
		t.Fatalf("good session: %v", err)
	}
	return env
}

// hpEcho does one echo round trip on a client session.
func hpEcho(s *Session, msg string) error {
	st, err := s.OpenStream()
	if err != nil {
		return fmt.Errorf("OpenStream: %w", err)
	}
	defer st.Close()
	st.SetDeadline(time.Now().Add(hpTimeout))
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

// checkGood runs an echo on the well-behaved session after a case.
func (e *hpServerEnv) checkGood(t *testing.T) {
	t.Helper()
	if err := hpEcho(e.good, "still fine after "+t.Name()); err != nil {
		t.Errorf("the other session stopped working: %v", err)
	}
}

func (e *hpServerEnv) sessionSet() map[*Session]bool {
	e.ln.mu.Lock()
	defer e.ln.mu.Unlock()
	m := make(map[*Session]bool, len(e.ln.sessions))
	for s := range e.ln.sessions {
		m[s] = true
	}
	return m
}

// waitSession returns the session the listener registered after before.
func (e *hpServerEnv) waitSession(t *testing.T, before map[*Session]bool) *Session {
	t.Helper()
	deadline := time.Now().Add(hpTimeout)
	for {
		for s := range e.sessionSet() {
			if !before[s] {
				return s
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the listener registered no session for the raw client within %v", hpTimeout)
		}
		time.Sleep(time.Millisecond)
	}
}

// ---- hostile server ----

type hpResult struct {
	s   *Session
	err error
}

func hpGo(f func() (*Session, error)) <-chan hpResult {
	ch := make(chan hpResult, 1)
	go func() {
		s, err := f()
		ch <- hpResult{s, err}
	}()
	return ch
}

func hpAwait(t *testing.T, ch <-chan hpResult) hpResult {
	t.Helper()
	select {
	case r := <-ch:
		if r.s != nil {
			t.Cleanup(func() { hpCloseBounded(t, r.s) })
		}
		return r
	case <-time.After(hpTimeout):
		t.Fatalf("handshake still running after %v", hpTimeout)
		return hpResult{}
	}
}

func hpExpectClosed(t *testing.T, s *Session, is error, want []string) {
	t.Helper()
	deadline := time.Now().Add(hpTimeout)
	for !s.IsClosed() {
		if time.Now().After(deadline) {
			t.Fatalf("the victim session is still open %v after the corruption", hpTimeout)
		}
		time.Sleep(time.Millisecond)
	}
	err := s.Err()
	t.Logf("victim: %v", err)
	if is == nil {
		is = ErrProtocol
	}
	if !errors.Is(err, ErrSessionClosed) || !errors.Is(err, is) {
		t.Errorf("session error %v: want ErrSessionClosed wrapping %v", err, is)
	}
	msg := strings.ToLower(fmt.Sprint(err))
	for _, w := range want {
		if !strings.Contains(msg, strings.ToLower(w)) {
			t.Errorf("session error %q does not mention %q", err, w)
		}
	}
}

// hpCloseBounded closes s and fails if that hangs.
func hpCloseBounded(t *testing.T, s *Session) {
	done := make(chan struct{})
	go func() {
		s.Close()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(hpTimeout):
		t.Errorf("Session.Close still running after %v", hpTimeout)
	}
}

func hpModeName(mode MemMapType) string {
	if mode == MemMapTypeMemFd {
		return "v3 memfd"
	}
	return "v2 file"
}

func hpUnixPair(t *testing.T) (dialed, accepted *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conn := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "hp-socketpair")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c.(*net.UnixConn)
	}
	return conn(fds[0]), conn(fds[1])
}

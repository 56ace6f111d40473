package shmipc

import (
	"encoding/binary"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"
)

// streamTestTimeout bounds every blocking step of these tests, so that a lost
// wake-up fails the test instead of hanging it.
const streamTestTimeout = 20 * time.Second

// streamTestSizes are message sizes around the slice sizes of the default
// configuration (8172, 32748 and 131052 data bytes per slice).
var streamTestSizes = []int{1, 64, 4096, 8172, 8173, 32748, 131052, 131053, 300000, 1 << 20, 4 << 20}

// forEachStreamMode runs test as a subtest for each transport of the
// matrix: a Unix socket with memfd regions and with /dev/shm file regions.
func forEachStreamMode(t *testing.T, test func(t *testing.T, mode MemMapType)) {
	for _, mode := range bothModes {
		t.Run(mode.String(), func(t *testing.T) { test(t, mode) })
	}
}

// streamTestConfig is the default configuration with its own region names, so
// that leftover files can be found and concurrent test runs do not collide.
func streamTestConfig(t *testing.T, mode MemMapType) *Config {
	conf := DefaultConfig()
	conf.MemMapType = mode
	conf.ShareMemoryPathPrefix = shmPrefix(t, "st")
	// A loaded machine (CI runs suites side by side, -race) can take more
	// than the default second for a handshake.
	conf.InitializeTimeout = 10 * time.Second
	return conf
}

// streamTestPair is a client session and the server session it is connected
// to.
type streamTestPair struct {
	client *Session
	server *Session
}

// newStreamTestPair connects a client and a server session over a Unix socket
// in t.TempDir(). tweak, if not nil, adjusts the configuration of both sides.
// Both sessions are closed when the test ends.
func newStreamTestPair(t *testing.T, mode MemMapType, tweak func(*Config)) *streamTestPair {
	t.Helper()
	conf := streamTestConfig(t, mode)
	if tweak != nil {
		tweak(conf)
	}
	serverConf := *conf
	sock := filepath.Join(t.TempDir(), "s.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	type result struct {
		s   *Session
		err error
	}
	accepted := make(chan result, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			accepted <- result{nil, err}
			return
		}
		s, err := Server(c, &serverConf)
		accepted <- result{s, err}
	}()
	client, err := Dial("unix", sock, conf)
	if err != nil {
		t.Fatalf("Dial (%v): %v", mode, err)
	}
	t.Cleanup(func() { client.Close() })
	var r result
	select {
	case r = <-accepted:
	case <-time.After(streamTestTimeout):
		t.Fatal("server handshake did not finish")
	}
	if r.err != nil {
		t.Fatalf("Server (%v): %v", mode, r.err)
	}
	t.Cleanup(func() { r.s.Close() })
	return &streamTestPair{client: client, server: r.s}
}

// openStreamT opens a client stream that is closed when the test ends. Its
// read deadline keeps a broken test from hanging.
func openStreamT(t *testing.T, s *Session) *Stream {
	t.Helper()
	st, err := s.OpenStream()
	if err != nil {
		t.Fatalf("OpenStream: %v", err)
	}
	st.SetReadDeadline(time.Now().Add(streamTestTimeout))
	t.Cleanup(func() { st.Close() })
	return st
}

// acceptStreamT waits for the next stream on a server session.
func acceptStreamT(t *testing.T, s *Session) *Stream {
	t.Helper()
	st := acceptWithin(t, s, streamTestTimeout)
	st.SetReadDeadline(time.Now().Add(streamTestTimeout))
	t.Cleanup(func() { st.Close() })
	return st
}

// streamPattern returns n pseudo-random bytes; each seed gives other bytes.
func streamPattern(n int, seed uint64) []byte {
	var key [32]byte
	binary.LittleEndian.PutUint64(key[:], seed)
	p := make([]byte, n)
	rand.NewChaCha8(key).Read(p)
	return p
}

// waitFreeListsFull waits until every slice of s's buffer region is back on
// its free list. The peer frees asynchronously, hence the polling.
func waitFreeListsFull(t *testing.T, s *Session) {
	t.Helper()
	var want []int32
	for _, l := range s.buf.Lists() {
		want = append(want, int32(l.Count))
	}
	deadline := time.Now().Add(2 * time.Second)
	for {
		got := freeCounts(s.buf)
		if slices.Equal(got, want) {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("free counts of the buffer region are %v, want %v: slices leaked", got, want)
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// readUntilError reads st until a read fails and returns what it read and
// the error.
func readUntilError(st *Stream) ([]byte, error) {
	var out []byte
	buf := make([]byte, 64<<10)
	for {
		n, err := st.Read(buf)
		out = append(out, buf[:n]...)
		if err != nil {
			return out, err
		}
	}
}

// writeAll writes each message with its own Write.
func writeAll(t *testing.T, st *Stream, msgs [][]byte) {
	t.Helper()
	for i, m := range msgs {
		if n, err := st.Write(m); err != nil || n != len(m) {
			t.Fatalf("Write of message %d (%d bytes): wrote %d, %v", i, len(m), n, err)
		}
	}
}

func requireErrorIs(t *testing.T, err, target error, what string) {
	t.Helper()
	if !errors.Is(err, target) {
		t.Fatalf("%s: got error %v, want one wrapping %v", what, err, target)
	}
}

func requireTimeout(t *testing.T, err error, what string) {
	t.Helper()
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("%s: got error %v, want one matching os.ErrDeadlineExceeded", what, err)
	}
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("%s: error %v is not a net.Error with Timeout() true", what, err)
	}
}

// waitResult waits for a blocked call to report its error.
func waitResult(t *testing.T, ch <-chan error, what string) error {
	t.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(5 * time.Second):
		t.Fatalf("%s is still blocked after 5s", what)
		return nil
	}
}

// firstDiff returns the index of the first byte where a and b differ, or the
// length of the shorter one.
func firstDiff(a, b []byte) int {
	i := 0
	for i < len(a) && i < len(b) && a[i] == b[i] {
		i++
	}
	return i
}

// noSpin turns spinning off, so that a reader waiting for data sleeps
// until its data comes with a wake-up.
func noSpin(c *Config) { c.ConsumerSpinTime = 0 }

// exchangedPair returns a pair without spinning and a stream open on both
// sides, after one request and reply on it.
func exchangedPair(t *testing.T) (p *streamTestPair, cli, srv *Stream) {
	t.Helper()
	p = newStreamTestPair(t, MemMapTypeMemFd, noSpin)
	cli, err := p.client.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	srv, err = p.server.AcceptStream()
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 5)
	if _, err := io.ReadFull(srv, buf); err != nil {
		t.Fatal(err)
	}
	if _, err := srv.Write(buf); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(cli, buf); err != nil {
		t.Fatal(err)
	}
	return p, cli, srv
}

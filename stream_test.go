package shmipc

import (
	"encoding/binary"
	"errors"
	"io"
	"math"
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

// Stream ids never wrap: a session that has given out its last id refuses
// to open more, and a SessionManager carries on with a new session.

// nearLastID makes client session s give out the ids from math.MaxUint32-left+1
// on, as if it had opened nearly 2^32 streams.
func nearLastID(s *Session, left uint32) {
	s.mu.Lock()
	s.nextID = math.MaxUint32 - left
	s.mu.Unlock()
}

// TestStreamIDsDoNotWrap: the last ids work end to end, and then OpenStream
// fails with ErrStreamIDsExhausted instead of starting again from a low id
// the server may still know.
func TestStreamIDsDoNotWrap(t *testing.T) {
	p := newStreamTestPair(t, MemMapTypeMemFd, nil)
	nearLastID(p.client, 2)
	for _, want := range []uint32{math.MaxUint32 - 1, math.MaxUint32} {
		st, err := p.client.OpenStream()
		if err != nil {
			t.Fatalf("OpenStream for id %d: %v", want, err)
		}
		defer st.Close()
		if st.ID() != want {
			t.Fatalf("stream id %d, want %d", st.ID(), want)
		}
		if _, err := st.Write([]byte("ping")); err != nil {
			t.Fatal(err)
		}
		srv := acceptWithin(t, p.server, 10*time.Second)
		defer srv.Close()
		if srv.ID() != want {
			t.Fatalf("server accepted id %d, want %d", srv.ID(), want)
		}
		buf := make([]byte, 4)
		srv.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.ReadFull(srv, buf); err != nil || string(buf) != "ping" {
			t.Fatalf("server read %q, %v", buf, err)
		}
	}
	st, err := p.client.OpenStream()
	if err == nil {
		st.Close()
		t.Fatalf("OpenStream after id %d gave id %d; want ErrStreamIDsExhausted", uint32(math.MaxUint32), st.ID())
	}
	if !errors.Is(err, ErrStreamIDsExhausted) {
		t.Fatalf("OpenStream after the last id: %v, want ErrStreamIDsExhausted", err)
	}
	if p.client.IsClosed() {
		t.Fatalf("the session ended: %v; its open streams should go on", p.client.Err())
	}
}

// TestSessionManagerRenewsExhaustedSession: when its session runs out of
// ids, GetStream goes on with a stream on a new session; the old session's
// streams go on working until they are put back (then they are closed, not
// pooled), and the old session ends with the last of them.
func TestSessionManagerRenewsExhaustedSession(t *testing.T) {
	prefix := shmPrefix(t, "sid")
	sock := filepath.Join(t.TempDir(), "s.sock")
	srv := clStartEcho(t, sock, mpConfig(MemMapTypeMemFd, prefix))
	defer srv.close(t)
	m, err := NewSessionManager(SessionManagerConfig{
		Config:  mpConfig(MemMapTypeMemFd, prefix),
		Network: "unix",
		Address: sock,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	old := m.Sessions()[0]
	nearLastID(old, 1)
	last, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	if last.Session() != old || last.ID() != math.MaxUint32 {
		t.Fatalf("first stream: id %d on session %p, want the last id on %p", last.ID(), last.Session(), old)
	}
	if err := mpRoundTrip(last, []byte("last id"), false); err != nil {
		t.Fatal(err)
	}

	var streams []*Stream
	for i := range 3 {
		st, err := m.GetStream()
		if err != nil {
			t.Fatalf("GetStream %d after the last id: %v", i, err)
		}
		streams = append(streams, st)
		if st.Session() == old {
			t.Fatalf("GetStream %d after the last id: stream %d on the exhausted session", i, st.ID())
		}
		if err := mpRoundTrip(st, []byte("new session"), false); err != nil {
			t.Fatalf("stream %d on the new session: %v", i, err)
		}
	}
	if ss := m.Sessions(); len(ss) != 1 || ss[0] == old || ss[0] != streams[0].Session() {
		t.Fatalf("the manager's sessions after the renewal: %v, want only the new one", ss)
	}
	if old.IsClosed() {
		t.Fatalf("the old session ended while a stream was open on it: %v", old.Err())
	}
	if err := mpRoundTrip(last, []byte("old session, still open"), false); err != nil {
		t.Fatalf("the stream left on the old session: %v", err)
	}
	m.PutBack(last)
	select {
	case <-old.closed:
	case <-time.After(10 * time.Second):
		t.Fatalf("the old session did not end after its last stream was put back")
	}
	for _, st := range streams {
		m.PutBack(st)
	}
	if n := m.IdleStreams(); n != len(streams) {
		t.Errorf("%d idle streams, want the %d put back on the new session", n, len(streams))
	}
	st, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	if err := mpRoundTrip(st, []byte("pooled"), false); err != nil {
		t.Fatal(err)
	}
	m.PutBack(st)
}

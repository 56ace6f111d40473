package shmipc

import (
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"testing"
	"time"
)

// aqServerStreams opens n streams on the client of p, sends a byte on each
// and returns them with their server ends, taken from the server session.
func aqServerStreams(t *testing.T, p *streamTestPair, n int) (client, server []*Stream) {
	t.Helper()
	for range n {
		c := openStreamT(t, p.client)
		if _, err := c.Write([]byte{1}); err != nil {
			t.Fatal(err)
		}
		client = append(client, c)
		server = append(server, acceptStreamT(t, p.server))
	}
	return client, server
}

// aqPop pops with a bound, so that a broken queue fails instead of hanging.
func aqPop(t *testing.T, q *streamQueue) (*Stream, error) {
	t.Helper()
	closed := make(chan struct{})
	timer := time.AfterFunc(5*time.Second, func() { close(closed) })
	defer timer.Stop()
	return q.pop(closed, func() error { return errors.New("pop: nothing queued") })
}

// aqWantPeerClosed checks that the server closed the stream whose client end
// is c: what the client reads ends with io.EOF.
func aqWantPeerClosed(t *testing.T, c *Stream, what string) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadAll(c); err != nil {
		t.Errorf("%s: the client's read ends with %v, want io.EOF (the server closed the stream)", what, err)
	}
}

// TestAcceptQueueLimitPerSession: push refuses a stream whose session
// already has limit streams waiting, without queueing it, while streams of
// other sessions are still taken; once one is popped the session may queue
// another.
func TestAcceptQueueLimitPerSession(t *testing.T) {
	a := newStreamTestPair(t, MemMapTypeMemFd, aqSmallRegion)
	b := newStreamTestPair(t, MemMapTypeMemFd, aqSmallRegion)
	_, sa := aqServerStreams(t, a, 4)
	_, sb := aqServerStreams(t, b, 1)

	var q streamQueue
	q.init()
	const limit = 3
	for i := range limit {
		if err := q.push(sa[i], limit); err != nil {
			t.Fatalf("push %d of %d: %v", i+1, limit, err)
		}
	}
	err := q.push(sa[limit], limit)
	if !errors.Is(err, errTooManyPending) {
		t.Fatalf("push beyond the limit: %v, want errTooManyPending", err)
	}
	if want := fmt.Sprint(limit); !containsWord(err.Error(), want) {
		t.Errorf("error %q does not name the bound %s", err, want)
	}
	if err := q.push(sb[0], limit); err != nil {
		t.Fatalf("another session's stream refused: %v", err)
	}
	want := []*Stream{sa[0], sa[1], sa[2], sb[0]}
	for i, w := range want {
		got, err := aqPop(t, &q)
		if err != nil || got != w {
			t.Fatalf("pop %d: stream %v, %v; want stream %d of session %p", i, got, err, w.ID(), w.Session())
		}
		if i == 0 { // one of session a's streams taken: room for one more
			if err := q.push(sa[limit], limit); err != nil {
				t.Fatalf("push after a pop: %v", err)
			}
		}
	}
	if got, err := aqPop(t, &q); err != nil || got != sa[limit] {
		t.Fatalf("last pop: %v, %v; want the stream pushed after a pop", got, err)
	}
	if err := q.push(sa[0], 0); err != nil { // limit 0: unbounded
		t.Fatal(err)
	}
}

// containsWord reports whether s contains w not adjacent to other digits.
func containsWord(s, w string) bool {
	for i := 0; i+len(w) <= len(s); i++ {
		if s[i:i+len(w)] != w {
			continue
		}
		before := i == 0 || s[i-1] < '0' || s[i-1] > '9'
		after := i+len(w) == len(s) || s[i+len(w)] < '0' || s[i+len(w)] > '9'
		if before && after {
			return true
		}
	}
	return false
}

// TestAcceptQueueClose: close closes the queued streams, and a stream pushed
// after close is closed at once instead of being kept where nobody will
// ever accept (or close) it.
func TestAcceptQueueClose(t *testing.T) {
	p := newStreamTestPair(t, MemMapTypeMemFd, aqSmallRegion)
	client, server := aqServerStreams(t, p, 2)

	var q streamQueue
	q.init()
	if err := q.push(server[0], 0); err != nil {
		t.Fatal(err)
	}
	q.close()
	aqWantPeerClosed(t, client[0], "stream queued at close")

	err := q.push(server[1], 0)
	if !errors.Is(err, errAcceptClosed) {
		t.Errorf("push after close: %v, want errAcceptClosed", err)
	}
	aqWantPeerClosed(t, client[1], "stream pushed after close")
	if _, err := server[1].Read(make([]byte, 1)); !errors.Is(err, ErrStreamClosed) {
		t.Errorf("server end of the stream pushed after close: Read returns %v, want ErrStreamClosed", err)
	}
	if st, err := aqPop(t, &q); err == nil {
		t.Errorf("pop after close returned stream %d", st.ID())
	}
	if n := p.server.Stats().ActiveStreams; n != 0 {
		t.Errorf("server session has %d open streams, want 0", n)
	}
}

// aqSmallRegion makes each session's buffer region as small as allowed: the
// tests here open many sessions.
func aqSmallRegion(c *Config) {
	c.ShareMemoryBufferCap = minBufferCap
	c.BufferSliceSizes = ReferenceSliceSizes()
}

// TestListenerStreamAfterClose: a session whose handshake ends just after
// the listener closed is closed by Listener.serve once the handshake
// returns, but its receive loop may hand the listener a stream before that.
// That stream must be closed (the client sees io.EOF), not queued where
// nobody accepts or closes it, keeping the session's region mapped for
// good. The session is made here as Listener.serve makes it, after Close,
// and left open, so that the stream certainly reaches the closed listener.
func TestListenerStreamAfterClose(t *testing.T) {
	prefix := shmPrefix(t, "aq")
	conf := clConfig(MemMapTypeMemFd, prefix)
	ln, err := Listen("unix", filepath.Join(t.TempDir(), "s.sock"), conf)
	if err != nil {
		t.Fatal(err)
	}
	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	clientConn, serverConn := ucConnPair(t)
	type result struct {
		s   *Session
		err error
	}
	ch := make(chan result, 1)
	go func() {
		s, err := handshake(serverConn, conf, false, func(s *Session) { ln.adopt(s, serverConn) })
		ch <- result{s, err}
	}()
	client, err := Client(clientConn, conf)
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	r := <-ch
	if r.err != nil {
		t.Fatal(r.err)
	}
	defer r.s.Close()

	st, err := client.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Write([]byte{1}); err != nil {
		t.Fatal(err)
	}
	aqWantPeerClosed(t, st, "stream that reached the listener after Close")
	st.Close()
	client.Close()
	r.s.Close()
	mpWaitGone(t, "regions after both sessions closed", "self", prefix, 5*time.Second)
}

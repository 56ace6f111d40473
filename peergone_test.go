package shmipc

import (
	"errors"
	"io"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// A server that stops reading its end of the connection (shutdown of its
// reading side) but keeps it open: the client's write that needs a wake-up
// fails with an error wrapping ErrSessionClosed and ErrPeerClosed, and so
// does every send after it; what the server publishes afterwards still
// reaches the client's reader; and the session ends with ErrPeerClosed
// within about peerGoneGrace, though the socket never ends.
func TestWriteToPeerThatStoppedReading(t *testing.T) {
	p, sess := acceptRawVictim(t, MemMapTypeMemFd, 0)
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if err := p.conn.CloseRead(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	var werr error
	for i := 0; i < 100 && werr == nil; i++ {
		// The first write sets the server's working flag, which it never
		// clears: clear it, so that each write needs a wake-up.
		atomic.StoreUint32(p.recv.u32(queueFlagOff), 0)
		_, werr = st.Write([]byte("request"))
	}
	if !errors.Is(werr, ErrSessionClosed) || !errors.Is(werr, ErrPeerClosed) {
		t.Fatalf("writes to a server that stopped reading: %v; want an error wrapping ErrSessionClosed and ErrPeerClosed", werr)
	}
	if _, err := st.Write([]byte("more")); !errors.Is(err, ErrPeerClosed) {
		t.Errorf("a write after the failed one: %v; want ErrPeerClosed", err)
	}
	if sess.IsClosed() {
		t.Fatal("the session ended at the failed write; the peer's data still to come would be lost")
	}

	p.publish(st.ID(), p.msg("reply"), statusOpened)
	st.SetReadDeadline(time.Now().Add(peerTimeout))
	got := make([]byte, 5)
	if _, err := io.ReadFull(st, got); err != nil || string(got) != "reply" {
		t.Fatalf("reading what the server sent after the failed write: %q, %v", got, err)
	}

	err = waitSessionClosed(t, sess, peerGoneGrace+peerTimeout)
	if !errors.Is(err, ErrSessionClosed) || !errors.Is(err, ErrPeerClosed) {
		t.Errorf("the session ended with %v; want an error wrapping ErrSessionClosed and ErrPeerClosed", err)
	}
	if d := time.Since(start); d < peerGoneGrace/2 {
		t.Errorf("the session ended %v after the failed write, before the grace of %v", d, peerGoneGrace)
	}
}

// A client that stops reading its end of the connection while the server
// starts a hot restart: the HotRestart frame's write fails, which does not
// end the server's session at once. A message the client publishes after
// that still reaches the server, another session of the listener is
// unaffected, and the session ends
// with ErrPeerClosed within about peerGoneGrace, though the socket never
// ends.
func TestHotRestartToPeerThatStoppedReading(t *testing.T) {
	env := startTestServer(t, 0)
	p, victim := connectRawClient(t, env, MemMapTypeMemFd)
	c := &hpCtx{t: t, p: p, victim: victim, id: 2}
	if err := c.roundTrip("before", 0); err != nil {
		t.Fatalf("echo before the client stopped reading: %v", err)
	}
	if err := p.conn.CloseRead(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := env.ln.HotRestart(hrEpoch); err != nil {
		t.Fatalf("HotRestart: %v", err)
	}
	// A Unix socket whose peer has shut down its reading side fails every
	// write at once (EPIPE).
	e := victim.sendErr.Load()
	if e == nil || !strings.Contains((*e).Error(), "send HotRestart") {
		t.Fatalf("the HotRestart frame to a client that stopped reading: session %v, send error %v; want the write to have failed", victim.Err(), e)
	}
	if victim.IsClosed() {
		t.Fatalf("the session ended at the failed write (%v): the client's data still to come would be lost", victim.Err())
	}
	// The echo cannot answer (sending to the client has stopped), but it
	// receives.
	in := victim.Stats().BytesIn
	c.publish(c.id, p.msg("after"), 0)
	waitUntil(t, "the server receives a message sent after the failed write", peerTimeout, func() bool {
		return victim.Stats().BytesIn == in+uint64(len("after"))
	})
	if err := echoRoundTrip(env.good, "another session"); err != nil {
		t.Fatalf("another session of the listener: %v", err)
	}
	err := waitSessionClosed(t, victim, peerGoneGrace+peerTimeout)
	if !errors.Is(err, ErrSessionClosed) || !errors.Is(err, ErrPeerClosed) {
		t.Errorf("the session ended with %v; want an error wrapping ErrSessionClosed and ErrPeerClosed", err)
	}
	if d := time.Since(start); d < peerGoneGrace/2 {
		t.Errorf("the session ended %v after the failed write, before the grace of %v", d, peerGoneGrace)
	}
	if env.good.IsClosed() {
		t.Errorf("the other session ended: %v", env.good.Err())
	}
}

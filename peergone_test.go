package shmipc

import (
	"errors"
	"io"
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

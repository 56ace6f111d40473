package shmipc

import (
	"errors"
	"fmt"
	"io"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/shm"
)

// A server that stops reading its end of the connection (shutdown of its
// reading side) but keeps it open: the wake-up after a client's write fails,
// and the writes after it fail with an error wrapping ErrSessionClosed and
// ErrPeerClosed. The write whose wake-up failed had put its message on the
// queue, where a polling server could take it: it returns nil, and the
// server finds there exactly the messages of the writes that returned nil.
// What the server publishes afterwards still reaches the client's reader;
// and the session ends with ErrPeerClosed within about peerGoneGrace,
// though the socket never ends.
func TestWriteToPeerThatStoppedReading(t *testing.T) {
	waitsInParallel(t)
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
	var (
		werr error
		sent []string
	)
	for i := 0; i < 100 && werr == nil; i++ {
		// The first write sets the server's working flag, which it never
		// clears: clear it, so that each write needs a wake-up.
		atomic.StoreUint32(p.recv.u32(queueFlagOff), 0)
		msg := fmt.Sprintf("request %d", i)
		if _, werr = st.Write([]byte(msg)); werr == nil {
			sent = append(sent, msg)
		}
	}
	if !errors.Is(werr, ErrSessionClosed) || !errors.Is(werr, ErrPeerClosed) {
		t.Fatalf("writes to a server that stopped reading: %v; want an error wrapping ErrSessionClosed and ErrPeerClosed", werr)
	}
	if len(sent) == 0 {
		t.Fatal("the first write failed; its message reached the queue before its wake-up failed, so it counts as written")
	}
	for _, want := range sent {
		e, err := p.waitElem()
		if err != nil {
			t.Fatalf("the message of a write that returned nil (%q): %v", want, err)
		}
		if got, err := p.readMsg(e.Offset); err != nil || got != want {
			t.Fatalf("the server reads %q, %v; want %q", got, err, want)
		}
	}
	if e, ok := p.recv.pop(); ok {
		t.Errorf("a write that failed left element %+v on the queue", e)
	}
	if _, err := st.Write([]byte("more")); !errors.Is(err, ErrPeerClosed) {
		t.Errorf("a write after the failed one: %v; want ErrPeerClosed", err)
	}
	if sess.IsClosed() {
		t.Fatal("the session ended at the failed write; the peer's data still to come would be lost")
	}

	p.publish(st.ID(), p.msg("reply"), shm.StatusOpened)
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
// unaffected, and the session ends with ErrPeerClosed within about
// peerGoneGrace, though the socket never ends.
func TestHotRestartToPeerThatStoppedReading(t *testing.T) {
	waitsInParallel(t)
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
	var sendErr error
	if e := victim.sendErr.Load(); e != nil {
		sendErr = *e
	}
	if sendErr == nil || !strings.Contains(sendErr.Error(), "send HotRestart") {
		t.Fatalf("the HotRestart frame to a client that stopped reading: session %v, send error %v; want the write to have failed", victim.Err(), sendErr)
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

// A peer that publishes data and a close on a stream without a wake-up (the
// working flag was up: it counted on our side draining anyway) and then
// closes its end of the connection: the end of the socket does not drop
// them, whether we read the end as EOF or as ECONNRESET (the peer left
// frames of ours unread). The reader gets every byte, then io.EOF, and the
// session ends with ErrPeerClosed. No reader of ours polls here (ConsumerSpinTime 0), so only
// the drain at the end of the socket (drainBefore) can deliver them.
func TestPeerPublishesThenCloses(t *testing.T) {
	for _, tc := range []struct {
		streams int
		reset   bool // leave our frames unread: we read ECONNRESET, not EOF
	}{{1, false}, {8, false}, {1, true}, {8, true}} {
		streams := tc.streams
		t.Run(fmt.Sprintf("streams=%d/reset=%v", streams, tc.reset), func(t *testing.T) {
			p, sess := acceptRawVictim(t, MemMapTypeMemFd, 0)
			sts := make([]*Stream, streams)
			for i := range sts {
				sts[i] = openPinged(t, p, sess)
			}
			type result struct {
				data string
				err  error
			}
			results := make(chan result, streams)
			for _, st := range sts {
				go func() {
					b, err := io.ReadAll(st)
					results <- result{string(b), err}
				}()
			}
			// The working flag up, as a draining consumer leaves it: a
			// correct producer then publishes without a Polling frame.
			atomic.StoreUint32(p.send.u32(queueFlagOff), 1)
			for i, st := range sts {
				p.send.put(st.ID(), p.msg(fmt.Sprintf("last words %d", i)), shm.StatusOpened)
				p.send.put(st.ID(), 0, shm.StatusClosed)
			}
			if !tc.reset {
				// Read what we sent (Polling frames) first: a socket closed
				// with nothing unread ends with EOF on our side.
				p.conn.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
				_, _ = io.Copy(io.Discard, p.conn)
			}
			p.conn.Close()
			for range sts {
				select {
				case r := <-results:
					if r.err != nil || !strings.HasPrefix(r.data, "last words ") {
						t.Errorf("a stream's reader got %q, %v; want its last words, then io.EOF", r.data, r.err)
					}
				case <-time.After(peerTimeout):
					t.Fatal("a reader still waits after the peer closed")
				}
			}
			err := waitSessionClosed(t, sess, peerTimeout)
			if !errors.Is(err, ErrPeerClosed) {
				t.Errorf("the session ended with %v; want ErrPeerClosed", err)
			}
			if want := map[bool]string{false: "EOF", true: "reset"}[tc.reset]; err != nil && !strings.Contains(err.Error(), want) {
				t.Errorf("the session ended with %v; want the end of the socket read as %s", err, want)
			}
		})
	}
}

package shmipc

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/shm"
)

// Config.MaxStreams: a client holds at most MaxStreams streams open; a
// server ends a session whose client has more than twice as many open.

// TestMaxStreamsConcurrentOpenClose: goroutines of a client share
// MaxStreams 1, each opening a stream as soon as OpenStream lets it,
// writing and closing it. The client never holds more than one, so the
// server's session lives on: a close goes out before its stream frees the
// client's place.
func TestMaxStreamsConcurrentOpenClose(t *testing.T) {
	for _, goroutines := range []int{1, 4} {
		mzModes(t, func(t *testing.T) {
			p := newStreamTestPair(t, MemMapTypeMemFd, func(c *Config) { c.MaxStreams = 1 })
			go serveStreams(p.server, func(st *Stream) {
				st.SetReadDeadline(time.Now().Add(mzTimeout))
				io.Copy(io.Discard, st)
				st.Close()
			})
			deadline := time.Now().Add(shortOr(2*time.Second, 100*time.Millisecond)) // tens of thousands of rounds with -short too
			var wg sync.WaitGroup
			rounds := make([]int, goroutines)
			for g := range goroutines {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for time.Now().Before(deadline) && p.server.Err() == nil {
						st, err := p.client.OpenStream()
						if errors.Is(err, ErrLimitExceeded) {
							continue
						}
						if err != nil {
							return
						}
						st.Write([]byte("x"))
						st.Close()
						rounds[g]++
					}
				}()
			}
			wg.Wait()
			t.Logf("%d goroutines: rounds %v", goroutines, rounds)
			if err := p.server.Err(); err != nil {
				t.Fatalf("server session ended: %v", err)
			}
			if err := p.client.Err(); err != nil {
				t.Fatalf("client session ended: %v", err)
			}
		})
	}
}

// TestMaxStreamsCloseFrameOvertaken: a stream that went over the socket
// (a message larger than the region) announces its close in a frame, which
// the client's next stream, through the queue, can overtake. The client
// kept within MaxStreams 1, so the server's session lives on.
func TestMaxStreamsCloseFrameOvertaken(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: rounds kept up for seconds")
	}
	mzModes(t, func(t *testing.T) {
		p := newStreamTestPair(t, MemMapTypeMemFd, func(c *Config) {
			c.MaxStreams = 1
			c.ShareMemoryBufferCap = 1 << 20
			c.BufferSliceSizes = ReferenceSliceSizes()
		})
		big := bytes.Repeat([]byte("y"), 2<<20) // larger than the region
		go serveStreams(p.server, func(st *Stream) {
			st.SetReadDeadline(time.Now().Add(mzTimeout))
			io.Copy(io.Discard, st)
			st.Close()
		})
		for i := range 100 {
			st, err := p.client.OpenStream()
			if err != nil {
				t.Fatalf("round %d: OpenStream: %v (server: %v)", i, err, p.server.Err())
			}
			st.SetDeadline(time.Now().Add(mzTimeout))
			if _, err := st.Write(big); err != nil {
				t.Fatalf("round %d: Write: %v (server: %v)", i, err, p.server.Err())
			}
			st.Close()
			b, err := p.client.OpenStream()
			if err != nil {
				t.Fatalf("round %d: OpenStream of the next: %v (server: %v)", i, err, p.server.Err())
			}
			b.Write([]byte("x"))
			b.Close()
		}
		time.Sleep(100 * time.Millisecond)
		if err := p.server.Err(); err != nil {
			t.Fatalf("server session ended: %v", err)
		}
	})
}

// TestMaxStreamsHostileClientBounded: a client that ignores its own bound
// (OpenStream's count is bypassed) and opens stream after stream without
// closing any has its session ended by the server with ErrLimitExceeded
// once it has more than twice MaxStreams open.
func TestMaxStreamsHostileClientBounded(t *testing.T) {
	mzModes(t, func(t *testing.T) {
		const limit = 4
		p := newStreamTestPair(t, MemMapTypeMemFd, func(c *Config) { c.MaxStreams = limit })
		go serveStreams(p.server, func(st *Stream) {
			st.SetReadDeadline(time.Now().Add(mzTimeout))
			io.Copy(io.Discard, st)
			st.Close()
		})
		var held []*Stream
		defer func() {
			for _, st := range held {
				st.Close()
			}
		}()
		for range 4 * limit {
			st, err := p.client.OpenStream()
			if err != nil {
				break
			}
			held = append(held, st)
			if _, err := st.Write([]byte("x")); err != nil {
				break
			}
			// Forget it on this side only, as a client that keeps no count
			// would: the server still has it open.
			p.client.mu.Lock()
			delete(p.client.streams, st.id)
			p.client.index[st.id%streamIndexSize].CompareAndSwap(st, nil)
			p.client.mu.Unlock()
		}
		select {
		case <-p.server.closed:
		case <-time.After(mzTimeout):
			t.Fatalf("server session still up with %d streams open by its client, MaxStreams %d", 4*limit, limit)
		}
		if err := p.server.Err(); !errors.Is(err, ErrLimitExceeded) {
			t.Errorf("server session ended with %v, want ErrLimitExceeded", err)
		}
	})
}

// TestMaxStreamsPendingCloseCounts: a close published on the queue that
// waits for the socket (closeAfterSocket) means the client no longer holds
// that stream. Here the client closed stream 3 before it opened 5 (over
// the socket) and 7 (through the queue), so it never held more than two:
// twice MaxStreams 1, which the server accepts. The drain that precedes
// stream 5's frame finds 3's close (which then waits for the socket bytes
// received so far, 5's close frame among them) and 7's message.
func TestMaxStreamsPendingCloseCounts(t *testing.T) {
	conf := peerConfig(t, MemMapTypeMemFd, 0)
	conf.MaxStreams = 1
	ln, err := Listen("unix", filepath.Join(t.TempDir(), "ms.sock"), conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	got := make(chan string, 3)
	go serveStreams(ln, func(st *Stream) {
		st.SetReadDeadline(time.Now().Add(peerTimeout))
		b, _ := io.ReadAll(st)
		got <- string(b)
		st.Close()
	})
	env := &testServer{conf: conf, ln: ln, addr: ln.Addr().String()}
	p, victim := connectRawClient(t, env, MemMapTypeMemFd)

	// No wake-up: the server finds these in the drain before frame 5.
	p.send.put(3, p.msg("three"), shm.StatusOpened)
	p.send.put(3, 0, shm.StatusClosed)
	p.send.put(7, p.msg("seven"), shm.StatusOpened)
	frames := rawFallbackFrame(p.version, 0, 5, shm.StatusOpened, "five")
	frames = append(frames, rawFrame(12, rawMagic, p.version, 2, 0, 0, 0, 5)...)
	p.write(frames)
	// 7 ends with a close through the queue and a wake-up.
	p.publish(7, 0, shm.StatusClosed)

	want := map[string]bool{"three": true, "five": true, "seven": true}
	for range 3 {
		select {
		case s := <-got:
			if !want[s] {
				t.Errorf("a stream read %q", s)
			}
			delete(want, s)
		case <-victim.closed:
			t.Fatalf("server session ended: %v", victim.Err())
		case <-time.After(peerTimeout):
			t.Fatalf("streams still to end: %v (server: %v)", want, victim.Err())
		}
	}
	if err := victim.Err(); err != nil {
		t.Fatalf("server session ended: %v", err)
	}
}

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

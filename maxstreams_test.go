package shmipc

import (
	"bytes"
	"errors"
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

package shmipc

// Peer death across real processes: the child (this test binary re-executed
// by internal/proctest, running TestPeerDeathChild) is a shmipc server or
// client, and the parent SIGKILLs it at a chosen point: during the
// handshake, while it streams large messages, while it holds slices it
// read, while the parent is blocked on a full queue or region, and at 100
// random points of a mixed workload. Each time the survivor's blocked calls
// must fail promptly (the target is 100 ms after the socket closes; the
// tests assert 2 s and log the latency), nothing may leak (goroutines, fds,
// mappings, /dev/shm files), and a new session to a new child must work.

import (
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

// TestPeerDeathHandshake kills a child stalled in the handshake, as a raw
// server or client, and checks the parent's Dial, Server or Listener.
func TestPeerDeathHandshake(t *testing.T) {
	if proctest.IsChild() {
		t.Skip()
	}
	pdFreshAfter(t, MemMapTypeMemFd, MemMapTypeDevShmFile)
	for _, stage := range []string{"accept", "exchange", "ackfd"} {
		t.Run("child-server/"+stage, func(t *testing.T) {
			prefix := shmPrefix(t, "pd")
			check := pdLeakCheck(t, prefix)
			sock := filepath.Join(t.TempDir(), "s.sock")
			c := pdStart(t, pdArgs(sock, prefix, MemMapTypeMemFd, "raw-server", "", "default", "STAGE", stage))
			dial := pdGo("Dial", func() error {
				s, err := Dial("unix", sock, pdConfig("default", MemMapTypeMemFd, prefix))
				if err == nil {
					s.Close()
				}
				return err
			})
			pdExpectLine(t, c, "stalled")
			waitBlocked(t, "(*Session).runHandshake", 1) // Dial waits for the server
			pdKill(t, c, pdHandshakeFailed, dial)
			check("after the killed handshake")
		})
	}
	// File mode has no answer to wait for: the session is up at once, and
	// the dead server's death ends it.
	t.Run("child-server/accept/file", func(t *testing.T) {
		prefix := shmPrefix(t, "pd")
		check := pdLeakCheck(t, prefix)
		sock := filepath.Join(t.TempDir(), "s.sock")
		c := pdStart(t, pdArgs(sock, prefix, MemMapTypeDevShmFile, "raw-server", "", "default", "STAGE", "accept"))
		sess, err := Dial("unix", sock, pdConfig("default", MemMapTypeDevShmFile, prefix))
		if err != nil {
			t.Fatal(err)
		}
		st, err := sess.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Write([]byte("hello")); err != nil {
			t.Fatal(err)
		}
		pdExpectLine(t, c, "stalled")
		read := pdBlockedRead(st)
		waitBlocked(t, "(*Stream).awaitReadable", 1)
		pdKill(t, c, pdSessionGone, read)
		st.Close()
		sess.Close()
		check("after the killed file-mode server")
	})
	for _, stage := range []string{"exchange", "paths", "partial", "mapped"} {
		t.Run("child-client/"+stage, func(t *testing.T) {
			prefix := shmPrefix(t, "pd")
			check := pdLeakCheck(t, prefix)
			sock := filepath.Join(t.TempDir(), "s.sock")
			raw, err := net.Listen("unix", sock)
			if err != nil {
				t.Fatal(err)
			}
			defer raw.Close()
			conf := pdConfig("default", MemMapTypeMemFd, prefix)
			sessCh := make(chan *Session, 1)
			call := pdGo("Server", func() error {
				conn, err := raw.Accept()
				if err != nil {
					return err
				}
				s, err := Server(conn, conf)
				if err != nil {
					return err
				}
				sessCh <- s
				return nil
			})
			c := proctest.Start(t, proctest.Config{TestName: pdChildTest, Role: "peerdeath",
				Args: pdArgs(sock, prefix, MemMapTypeMemFd, "raw-client", "", "default", "STAGE", stage)})
			pdExpectLine(t, c, "stalled")
			if stage == "mapped" {
				<-call.done
				if call.err != nil {
					t.Fatalf("handshake with the raw client: %v", call.err)
				}
				s := <-sessCh
				acc := pdGo("AcceptStream", func() error { _, err := s.AcceptStream(); return err })
				waitBlocked(t, "(*streamQueue).pop", 1)
				pdKill(t, c, pdSessionGone, acc)
				s.Close()
			} else {
				waitBlocked(t, "(*Session).runHandshake", 1) // Server waits for the client
				pdKill(t, c, pdHandshakeFailed, call)
			}
			raw.Close()
			check("after the killed client handshake")
		})
	}
	// A Listener runs handshakes on its own goroutines: the one of a killed
	// client must end, and the listener must keep serving.
	t.Run("listener/exchange", func(t *testing.T) {
		prefix := shmPrefix(t, "pd")
		check := pdLeakCheck(t, prefix)
		sock := filepath.Join(t.TempDir(), "s.sock")
		ln, err := Listen("unix", sock, pdConfig("default", MemMapTypeMemFd, prefix))
		if err != nil {
			t.Fatal(err)
		}
		c := proctest.Start(t, proctest.Config{TestName: pdChildTest, Role: "peerdeath",
			Args: pdArgs(sock, prefix, MemMapTypeMemFd, "raw-client", "", "default", "STAGE", "exchange")})
		pdExpectLine(t, c, "stalled")
		var pending int
		for range 100 {
			ln.mu.Lock()
			pending = len(ln.pending)
			ln.mu.Unlock()
			if pending > 0 {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		if pending != 1 {
			t.Fatalf("listener has %d pending handshakes, want 1", pending)
		}
		killed := time.Now()
		c.Kill()
		for {
			ln.mu.Lock()
			pending = len(ln.pending)
			ln.mu.Unlock()
			if pending == 0 {
				break
			}
			if time.Since(killed) > pdBound {
				t.Fatalf("listener still has %d pending handshakes %v after the client was killed", pending, pdBound)
			}
			time.Sleep(time.Millisecond)
		}
		t.Logf("pending handshake dropped %v after SIGKILL", time.Since(killed).Round(10*time.Microsecond))
		<-c.Done()
		// The same listener serves a new client.
		c2 := proctest.Start(t, proctest.Config{TestName: pdChildTest, Role: "peerdeath",
			Args: pdArgs(sock, prefix, MemMapTypeMemFd, "client", "echo", "default")})
		st := acceptWithin(t, ln, 10*time.Second)
		st.SetDeadline(time.Now().Add(30 * time.Second))
		hello := make([]byte, len(pdHello))
		if _, err := io.ReadFull(st, hello); err != nil {
			t.Fatal(err)
		}
		// The child serves the echo on the stream it opened.
		if err := mpRoundTrip(st, mpPayload(1000, 5), false); err != nil {
			t.Errorf("fresh client on the listener: %v", err)
		}
		st.Close()
		if err := c2.Stop(30 * time.Second); err != nil {
			t.Errorf("fresh child: %v\n%s", err, c2.Output())
		}
		ln.Close()
		check("after the killed client handshake on a listener")
	})
}

// TestPeerDeathMidWrite kills a child that streams large messages on four
// streams while the parent reads and verifies them.
func TestPeerDeathMidWrite(t *testing.T) {
	if proctest.IsChild() {
		t.Skip()
	}
	pdFreshAfter(t, MemMapTypeMemFd, MemMapTypeDevShmFile)
	for _, tc := range []struct {
		side string
		mode MemMapType
	}{{"server", MemMapTypeMemFd}, {"server", MemMapTypeDevShmFile}, {"client", MemMapTypeMemFd}, {"client", MemMapTypeDevShmFile}} {
		t.Run("child-"+tc.side+"/"+tc.mode.String(), func(t *testing.T) {
			prefix := shmPrefix(t, "pd")
			check := pdLeakCheck(t, prefix)
			p := pdConnect(t, tc.side, "stream", "default", tc.mode, prefix, 4)
			var calls []*pdCall
			var verified sync.Map
			for _, st := range p.streams {
				calls = append(calls, pdGo(fmt.Sprintf("reader of stream %d", st.ID()), func() error {
					r := &skReader{st: st, rng: rand.New(rand.NewPCG(uint64(st.ID()), 0))}
					for {
						if _, _, err := r.next(); err != nil {
							verified.Store(st.ID(), r.seq)
							if errors.Is(err, errSkCorrupt) {
								t.Errorf("%v", err)
							}
							return err
						}
					}
				}))
			}
			pdExpectLine(t, p.c, "streaming")
			// Killed at a random moment of the streaming: 20-100 ms in,
			// 10-40 ms with -short.
			time.Sleep(shortOr(time.Duration(20+rand.IntN(80)), time.Duration(10+rand.IntN(30))) * time.Millisecond)
			pdKill(t, p.c, pdSessionGone, calls...)
			var msgs []string
			verified.Range(func(k, v any) bool { msgs = append(msgs, fmt.Sprintf("stream %v: %v", k, v)); return true })
			t.Logf("messages verified before the death: %s", strings.Join(msgs, ", "))
			// Writes on the dead session fail at once.
			if _, err := p.streams[0].Write([]byte("x")); !errors.Is(err, ErrSessionClosed) {
				t.Errorf("Write after the peer died: %v, want ErrSessionClosed", err)
			}
			p.close()
			check("after killing a streaming child")
		})
	}
}

// TestPeerDeathHoldingSlices: the child reads 8 messages with ReadBytes and
// never releases them, sends 8 back, and is killed while the parent holds
// those (read with ReadBytes) and is blocked in a read. The bytes the parent
// holds must stay intact after the death, until it closes the stream.
func TestPeerDeathHoldingSlices(t *testing.T) {
	if proctest.IsChild() {
		t.Skip()
	}
	pdFreshAfter(t, MemMapTypeMemFd, MemMapTypeDevShmFile)
	for _, tc := range []struct {
		side string
		mode MemMapType
	}{{"server", MemMapTypeMemFd}, {"client", MemMapTypeMemFd}, {"client", MemMapTypeDevShmFile}} {
		t.Run("child-"+tc.side+"/"+tc.mode.String(), func(t *testing.T) {
			prefix := shmPrefix(t, "pd")
			check := pdLeakCheck(t, prefix)
			p := pdConnect(t, tc.side, "hold", "default", tc.mode, prefix, 1)
			st := p.streams[0]
			rng := rand.New(rand.NewPCG(1, 2))
			for i := range 8 {
				if err := skSend(st, uint32(i), skBody(rng, 100<<10), 0, skViaWriteBytes, nil); err != nil {
					t.Fatal(err)
				}
			}
			line := pdExpectLine(t, p.c, "held")
			r := &skReader{st: st, hold: true, rng: rand.New(rand.NewPCG(5, 6))}
			for range 8 {
				if _, _, err := r.next(); err != nil {
					t.Fatal(err)
				}
			}
			// The held slices, as the reader sees them: re-read through the
			// zero-copy segments before and after the death.
			snapshot := func() [][]byte {
				st.mu.Lock()
				defer st.mu.Unlock()
				var out [][]byte
				for _, seg := range st.reader.segs[:st.reader.done] {
					out = append(out, seg.Data)
				}
				return out
			}
			before := snapshot()
			var beforeCopy [][]byte
			for _, b := range before {
				beforeCopy = append(beforeCopy, slices.Clone(b))
			}
			t.Logf("child: %s; parent holds %d segments", line, len(before))
			read := pdGo("ReadBytes", func() error { _, err := st.BufferReader().ReadBytes(1); return err })
			waitBlocked(t, "(*Stream).awaitReadable", 1)
			pdKill(t, p.c, pdSessionGone, read)
			for i, b := range before {
				if string(b) != string(beforeCopy[i]) {
					t.Errorf("held segment %d changed after the peer's death", i)
				}
			}
			if _, ours, _ := clMaps("self", prefix); len(ours) == 0 && tc.mode == MemMapTypeDevShmFile {
				t.Errorf("the region is unmapped while the stream still holds slices")
			}
			p.close()
			check("after killing a child holding slices")
		})
	}
}

// TestPeerDeathBlockedWriter stops the child (SIGSTOP: it reads nothing any
// more, not even its queue) while the parent writes with a small
// configuration (16-element queue, 1 MiB region), so the parent's writes
// block: on the full queue (small messages) or on the full region and then
// the full socket (large messages, as fallback data). Then the child is
// killed.
func TestPeerDeathBlockedWriter(t *testing.T) {
	if proctest.IsChild() {
		t.Skip()
	}
	if testing.Short() {
		t.Skip("-short: waits out write timeouts")
	}
	pdFreshAfter(t, MemMapTypeMemFd)
	for _, tc := range []struct {
		side, what string
		size       int
		fallback   bool
	}{
		{"server", "queue-full", 64, false},
		{"client", "queue-full", 64, false},
		{"server", "region-full", 100 << 10, false},
		{"server", "socket-full", 100 << 10, true},
		{"client", "socket-full", 100 << 10, true},
	} {
		t.Run("child-"+tc.side+"/"+tc.what, func(t *testing.T) {
			prefix := shmPrefix(t, "pd")
			check := pdLeakCheck(t, prefix)
			// With FallbackWhenFull a full region sends fallback data, so
			// the writer ends up blocked on the socket.
			kind := "small"
			if tc.fallback {
				kind = "small-fwf"
			}
			p := pdConnect(t, tc.side, "sink", kind, MemMapTypeMemFd, prefix, 2)
			if err := p.c.Signal(syscall.SIGSTOP); err != nil {
				t.Fatal(err)
			}
			defer p.c.Signal(syscall.SIGCONT)
			time.Sleep(20 * time.Millisecond)
			var calls []*pdCall
			var mu sync.Mutex
			sent := map[uint32]int{}
			for _, st := range p.streams {
				calls = append(calls, pdGo(fmt.Sprintf("writer on stream %d", st.ID()), func() error {
					rng := rand.New(rand.NewPCG(uint64(st.ID()), 1))
					for seq := uint32(0); ; seq++ {
						err := skSend(st, seq, skBody(rng, tc.size), 0, skViaWriteBytes, nil)
						if err != nil {
							return err
						}
						mu.Lock()
						sent[st.ID()]++
						mu.Unlock()
					}
				}))
				calls = append(calls, pdBlockedRead(st))
			}
			// Wait until the writers are stuck: nothing sent for 300 ms.
			last, stuckSince := -1, time.Now()
			for time.Since(stuckSince) < 300*time.Millisecond {
				time.Sleep(20 * time.Millisecond)
				mu.Lock()
				n := 0
				for _, v := range sent {
					n += v
				}
				mu.Unlock()
				if n != last {
					last, stuckSince = n, time.Now()
				}
			}
			t.Logf("writers stuck after %d messages of %d bytes", last, tc.size)
			pdKill(t, p.c, pdSessionGone, calls...)
			p.close()
			check("after killing a stopped child")
		})
	}
}

package shmipc

// The server's side against a raw client: the bytes it answers, what it
// rejects, a stalled client, the listener going on after rejections, and
// bad frames right after the handshake.

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/wire"
	"golang.org/x/sys/unix"
)

// TestServerRejectsBadFirstHeader: the server closes the connection at
// once, without answering, on a first header it has no handler for.
func TestServerRejectsBadFirstHeader(t *testing.T) {
	cases := []struct {
		name   string
		header []byte
		is     error // a wire error the failure must wrap, if any
	}{
		{"bad magic", rawFrame(8, 0x1234, 3, 4), wire.ErrBadMagic},
		{"byte-swapped magic", rawFrame(8, 0x5877, 3, 4), wire.ErrBadMagic},
		{"version 0", rawFrame(8, 0x7758, 0, 4), wire.ErrBadVersion},
		{"version 1", rawFrame(8, 0x7758, 1, 0), wire.ErrBadVersion},
		{"version 4", rawFrame(8, 0x7758, 4, 4), wire.ErrBadVersion},
		{"version 255", rawFrame(8, 0x7758, 255, 4), wire.ErrBadVersion},
		{"v3 type 10", rawFrame(8, 0x7758, 3, 10), wire.ErrBadType},
		{"v3 type 255", rawFrame(8, 0x7758, 3, 255), wire.ErrBadType},
		{"v3 starts with ShareMemoryByMemfd", rawFrame(8, 0x7758, 3, 5), nil},
		{"v3 starts with ShareMemoryByFilePath", rawFrame(8, 0x7758, 3, 0), nil},
		{"v3 starts with Polling", rawFrame(8, 0x7758, 3, 1), nil},
		{"v3 starts with AckShareMemory", rawFrame(8, 0x7758, 3, 6), nil},
		{"v3 exchange with a payload", rawFrame(20, 0x7758, 3, 4), wire.ErrBadLength},
		{"v3 exchange of length 0", rawFrame(0, 0x7758, 3, 4), wire.ErrBadLength},
		{"v2 starts with ExchangeProtoVersion", rawFrame(8, 0x7758, 2, 4), nil},
		{"v2 starts with Polling", rawFrame(8, 0x7758, 2, 1), nil},
		{"v2 path message too short", rawFrame(8, 0x7758, 2, 0), wire.ErrBadLength},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			conf := hsConfig(t, MemMapTypeMemFd)
			raw, sc := unixPair(t)
			ch := startHandshake(func() (*Session, error) { return Server(sc, conf) })
			hsWrite(t, raw, c.header)
			r := awaitHandshake(t, ch, 2*time.Second)
			if r.err == nil {
				t.Fatal("Server accepted the handshake")
			}
			if !errors.Is(r.err, ErrHandshake) {
				t.Errorf("error %v does not wrap ErrHandshake", r.err)
			}
			if hsIsTimeout(r.err) {
				t.Errorf("error %v is a timeout; the header alone is enough to reject", r.err)
			}
			if c.is != nil && !errors.Is(r.err, c.is) {
				t.Errorf("error %v does not wrap %v", r.err, c.is)
			}
			if got := hsExpectClosed(t, raw, 2*time.Second); len(got) != 0 {
				t.Errorf("server sent % x before closing; want nothing", got)
			}
		})
	}
}

// TestServerRejectsBadPaths: a version-2 path message naming files the
// server must not map fails the handshake and leaves the files alone.
func TestServerRejectsBadPaths(t *testing.T) {
	outside := filepath.Join(t.TempDir(), "victim")
	if err := os.WriteFile(outside, make([]byte, 4<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name             string
		queuePath, bPath func(prefix string) string
	}{
		{"missing files",
			func(p string) string { return p + "_nope_queue_0" },
			func(p string) string { return p + "_nope_buffer" }},
		{"outside the prefix directory",
			func(string) string { return outside },
			func(string) string { return outside }},
		{"relative path",
			func(string) string { return "shm_queue_0" },
			func(string) string { return "shm_buffer" }},
		{"dot-dot path",
			func(p string) string { return "/dev/shm/../" + strings.TrimPrefix(outside, "/") },
			func(p string) string { return "/dev/shm/../" + strings.TrimPrefix(outside, "/") }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			conf := hsConfig(t, MemMapTypeDevShmFile)
			raw, sc := unixPair(t)
			ch := startHandshake(func() (*Session, error) { return Server(sc, conf) })
			hsWrite(t, raw, rawPathFrame(2, 0, c.queuePath(conf.ShareMemoryPathPrefix), c.bPath(conf.ShareMemoryPathPrefix)))
			r := awaitHandshake(t, ch, 2*time.Second)
			if r.err == nil || !errors.Is(r.err, ErrHandshake) {
				t.Fatalf("Server: %v, want an error wrapping ErrHandshake", r.err)
			}
			if got := hsExpectClosed(t, raw, 2*time.Second); len(got) != 0 {
				t.Errorf("server sent % x", got)
			}
			if fi, err := os.Stat(outside); err != nil || fi.Size() != 4<<20 {
				t.Errorf("file outside the prefix directory touched: %v", err)
			}
		})
	}
}

// TestServerHandshakeBytes plays the client by hand and checks every byte
// the server answers (docs/protocol.md §4.1, §4.2).
func TestServerHandshakeBytes(t *testing.T) {
	waitsInParallel(t)
	t.Run("v3 memfd", func(t *testing.T) {
		conf := hsConfig(t, MemMapTypeMemFd)
		rr := createRawRegions(t, conf, MemMapTypeMemFd, rawLayout{})
		raw, sc := unixPair(t)
		ch := startHandshake(func() (*Session, error) { return Server(sc, conf) })
		hsWrite(t, raw, hsExchangeV3)
		if got := hsReadExactly(t, raw, 8); !bytes.Equal(got, hsExchangeV3) {
			t.Fatalf("exchange reply % x, want % x", got, hsExchangeV3)
		}
		hsWrite(t, raw, rawPathFrame(3, 5, rr.queuePath, rr.bufPath))
		if got := hsReadExactly(t, raw, 8); !bytes.Equal(got, hsAckReadyV3) {
			t.Fatalf("reply to ShareMemoryByMemfd % x, want % x", got, hsAckReadyV3)
		}
		if _, _, err := raw.WriteMsgUnix([]byte{0}, unix.UnixRights(rr.bufFd, rr.queueFd), nil); err != nil {
			t.Fatal(err)
		}
		if got := hsReadExactly(t, raw, 8); !bytes.Equal(got, hsAckShmV3) {
			t.Fatalf("reply to the fds % x, want % x", got, hsAckShmV3)
		}
		r := awaitHandshake(t, ch, 5*time.Second)
		if r.err != nil {
			t.Fatalf("Server: %v", r.err)
		}
		if r.s.isClient || r.s.version != 3 {
			t.Errorf("session: isClient %v, version %d", r.s.isClient, r.s.version)
		}
		// The server mapped the very regions the raw client created.
		if got := r.s.queueRegion.Mem(); len(got) != len(rr.queue.Mem()) {
			t.Errorf("server queue region of %d bytes, client's is %d", len(got), len(rr.queue.Mem()))
		} else {
			rr.queue.Mem()[len(got)-1] = 0x5A
			if got[len(got)-1] != 0x5A {
				t.Error("server queue region does not share memory with the client's")
			}
			rr.queue.Mem()[len(got)-1] = 0
		}
		if len(r.s.buf.Region().Mem()) != len(rr.buf.Mem()) {
			t.Errorf("server buffer region of %d bytes, client's is %d", len(r.s.buf.Region().Mem()), len(rr.buf.Mem()))
		}
	})
	t.Run("v3 file", func(t *testing.T) {
		conf := hsConfig(t, MemMapTypeDevShmFile)
		rr := createRawRegions(t, conf, MemMapTypeDevShmFile, rawLayout{})
		raw, sc := unixPair(t)
		ch := startHandshake(func() (*Session, error) { return Server(sc, conf) })
		hsWrite(t, raw, hsExchangeV3)
		if got := hsReadExactly(t, raw, 8); !bytes.Equal(got, hsExchangeV3) {
			t.Fatalf("exchange reply % x, want % x", got, hsExchangeV3)
		}
		hsWrite(t, raw, rawPathFrame(3, 0, rr.queuePath, rr.bufPath))
		if got := hsReadExactly(t, raw, 8); !bytes.Equal(got, hsAckShmV3) {
			t.Fatalf("reply to ShareMemoryByFilePath % x, want % x", got, hsAckShmV3)
		}
		r := awaitHandshake(t, ch, 5*time.Second)
		if r.err != nil {
			t.Fatalf("Server: %v", r.err)
		}
		if r.s.version != 3 {
			t.Errorf("session version %d, want 3", r.s.version)
		}
	})
	t.Run("v2 file", func(t *testing.T) {
		conf := hsConfig(t, MemMapTypeDevShmFile)
		rr := createRawRegions(t, conf, MemMapTypeDevShmFile, rawLayout{})
		raw, sc := unixPair(t)
		ch := startHandshake(func() (*Session, error) { return Server(sc, conf) })
		hsWrite(t, raw, rawPathFrame(2, 0, rr.queuePath, rr.bufPath))
		r := awaitHandshake(t, ch, 5*time.Second)
		if r.err != nil {
			t.Fatalf("Server: %v", r.err)
		}
		if r.s.version != 2 || r.s.isClient {
			t.Errorf("session: version %d, isClient %v", r.s.version, r.s.isClient)
		}
		hsExpectNothing(t, raw, 100*time.Millisecond)
		// The client going away ends the session with EOF, not a protocol
		// error, and the server removes the region files (docs/protocol.md §4.5).
		raw.Close()
		waitSessionClosed(t, r.s, 2*time.Second)
		if err := r.s.Err(); !errors.Is(err, ErrSessionClosed) || !errors.Is(err, ErrPeerClosed) || errors.Is(err, io.EOF) || errors.Is(err, ErrProtocol) {
			t.Errorf("session error %v: want ErrSessionClosed wrapping ErrPeerClosed (and not io.EOF)", err)
		}
		// Close waits for the teardown, and keeps the original cause.
		r.s.Close()
		if err := r.s.Err(); !errors.Is(err, ErrPeerClosed) {
			t.Errorf("session error after Close %v: want the original cause, ErrPeerClosed", err)
		}
		for _, p := range []string{rr.bufPath, rr.queuePath} {
			if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("%s still exists after the server session ended (%v)", p, err)
			}
		}
	})
	for _, nfds := range []int{1, 3} {
		t.Run(fmt.Sprintf("v3 memfd with %d fds", nfds), func(t *testing.T) {
			conf := hsConfig(t, MemMapTypeMemFd)
			rr := createRawRegions(t, conf, MemMapTypeMemFd, rawLayout{})
			raw, sc := unixPair(t)
			ch := startHandshake(func() (*Session, error) { return Server(sc, conf) })
			hsWrite(t, raw, hsExchangeV3)
			hsReadExactly(t, raw, 8)
			hsWrite(t, raw, rawPathFrame(3, 5, rr.queuePath, rr.bufPath))
			if got := hsReadExactly(t, raw, 8); !bytes.Equal(got, hsAckReadyV3) {
				t.Fatalf("reply % x, want % x", got, hsAckReadyV3)
			}
			fds := []int{rr.bufFd, rr.queueFd, rr.bufFd}[:nfds]
			if _, _, err := raw.WriteMsgUnix([]byte{0}, unix.UnixRights(fds...), nil); err != nil {
				t.Fatal(err)
			}
			r := awaitHandshake(t, ch, 2*time.Second)
			if r.err == nil || !errors.Is(r.err, ErrHandshake) || hsIsTimeout(r.err) {
				t.Fatalf("Server: %v; want an ErrHandshake that is not a timeout", r.err)
			}
			if !strings.Contains(r.err.Error(), "fd") {
				t.Errorf("error %q does not mention the fds", r.err)
			}
			if got := hsExpectClosed(t, raw, 2*time.Second); len(got) != 0 {
				t.Errorf("server sent % x after a bad fd message", got)
			}
		})
	}
}

// TestServerHandshakeStalledPeer: a client that stops talking makes Server
// fail with a timeout after InitializeTimeout.
//
// What the client says before it stops is in the socket before Server
// starts, and the server's replies are read once it has failed: the stall
// is the same however late the test's goroutine runs.
func TestServerHandshakeStalledPeer(t *testing.T) {
	cases := []struct {
		name    string
		said    func(rr *rawRegions) []byte // by the client before it stops
		replies int                         // 8-byte replies the server sends meanwhile
	}{
		{"silent", func(*rawRegions) []byte { return nil }, 0},
		{"half a header", func(*rawRegions) []byte { return hsExchangeV3[:4] }, 0},
		{"v2 path message cut short", func(rr *rawRegions) []byte {
			f := rawPathFrame(2, 0, rr.queuePath, rr.bufPath)
			return f[:len(f)-3]
		}, 0},
		{"after the version exchange", func(*rawRegions) []byte { return hsExchangeV3 }, 1},
		{"no fds after AckReadyRecvFD", func(rr *rawRegions) []byte {
			return append(slices.Clone(hsExchangeV3), rawPathFrame(3, 5, rr.queuePath, rr.bufPath)...)
		}, 2},
	}
	// Every case's handshake starts at once, so that their timeouts run
	// together; each is then checked in a subtest of its own.
	const timeout = 200 * time.Millisecond
	handshakes := make([]<-chan handshakeResult, len(cases))
	raws := make([]*net.UnixConn, len(cases))
	for i, c := range cases {
		conf := hsConfig(t, MemMapTypeMemFd)
		conf.InitializeTimeout = timeout
		rr := createRawRegions(t, conf, MemMapTypeMemFd, rawLayout{})
		raw, sc := unixPair(t)
		if said := c.said(rr); len(said) > 0 {
			hsWrite(t, raw, said)
		}
		raws[i] = raw
		handshakes[i] = startHandshake(func() (*Session, error) { return Server(sc, conf) })
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			raw := raws[i]
			r := awaitHandshake(t, handshakes[i], 3*time.Second)
			if r.err == nil {
				t.Fatal("Server succeeded with a stalled client")
			}
			if !errors.Is(r.err, ErrHandshake) || !hsIsTimeout(r.err) {
				t.Errorf("error %v: want ErrHandshake and a timeout", r.err)
			}
			if r.took >= 3*time.Second {
				t.Errorf("Server took %v with InitializeTimeout %v", r.took, timeout)
			}
			for range c.replies {
				hsReadExactly(t, raw, 8)
			}
			hsExpectClosed(t, raw, 2*time.Second)
		})
	}
}

// TestListenerSurvivesRejectedHandshakes: bad and stalled connections do not
// stop a Listener from serving good clients.
func TestListenerSurvivesRejectedHandshakes(t *testing.T) {
	for _, mode := range bothModes {
		t.Run(mode.String(), func(t *testing.T) {
			conf := hsConfig(t, mode)
			ln, err := Listen("unix", sockPath(t), conf)
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			go serveStreams(ln, echoStream)
			dialRaw := func() net.Conn {
				c, err := net.Dial("unix", ln.Addr().String())
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { c.Close() })
				return c
			}
			stalled := dialRaw() // handshake pending for InitializeTimeout (5s)
			for _, h := range [][]byte{rawFrame(8, 0xBEEF, 3, 4), rawFrame(8, 0x7758, 4, 4)} {
				bad := dialRaw()
				hsWrite(t, bad, h)
				if got := hsExpectClosed(t, bad, 2*time.Second); len(got) != 0 {
					t.Errorf("listener answered % x with % x", h, got)
				}
			}
			for i := 0; i < 2; i++ {
				r := awaitHandshake(t, startHandshake(func() (*Session, error) {
					return Dial("unix", ln.Addr().String(), conf)
				}), 3*time.Second)
				if r.err != nil {
					t.Fatalf("Dial after rejected handshakes: %v", r.err)
				}
				mustEcho(t, r.s)
				r.s.Close()
			}
			ln.Close()
			// Closing the listener drops the pending handshake too.
			hsExpectClosed(t, stalled, 2*time.Second)
		})
	}
}

// TestServerRunningPhaseBadFrames: after a good version-2 handshake done by
// a raw client, a bad frame ends the server session with ErrProtocol and an
// error that names the problem (docs/protocol.md §3).
func TestServerRunningPhaseBadFrames(t *testing.T) {
	cases := []struct {
		name  string
		frame []byte
		want  []string // substrings of the session error
	}{
		{"type 10", rawFrame(8, 0x7758, 2, 10), []string{"type", "10"}},
		{"type 200", rawFrame(8, 0x7758, 2, 200), []string{"type", "200"}},
		{"Polling of length 12", append(rawFrame(12, 0x7758, 2, 1), 0, 0, 0, 0), []string{"Polling", "12"}},
		{"Polling of length 0", rawFrame(0, 0x7758, 2, 1), []string{"Polling", "0"}},
		{"StreamClose of length 8", rawFrame(8, 0x7758, 2, 2), []string{"StreamClose", "8"}},
		{"FallbackData of length 15", append(rawFrame(15, 0x7758, 2, 3), 0, 0, 0, 1, 0, 0, 0), []string{"FallbackData", "15"}},
		{"FallbackData of length 8", rawFrame(8, 0x7758, 2, 3), []string{"FallbackData", "8"}},
		{"FallbackData over the limit", rawFrame(64<<20+1, 0x7758, 2, 3), []string{"FallbackData", fmt.Sprint(64<<20 + 1)}},
		{"FallbackData for stream 0", append(rawFrame(17, 0x7758, 2, 3), 0, 0, 0, 0, 0, 0, 0, 0, 'x'), []string{"stream id 0"}},
		{"bad magic", rawFrame(8, 0x7759, 2, 1), []string{"magic"}},
		{"version 0", rawFrame(8, 0x7758, 0, 1), []string{"version"}},
		{"HotRestart to the server", append(rawFrame(16, 0x7758, 2, 8), make([]byte, 8)...), []string{"HotRestart"}},
		{"ExchangeProtoVersion", rawFrame(8, 0x7758, 2, 4), []string{"ExchangeProtoVersion"}},
		{"ShareMemoryByFilePath again", rawPathFrame(2, 0, "/dev/shm/a", "/dev/shm/b"), []string{"ShareMemoryByFilePath"}},
		{"AckShareMemory", rawFrame(8, 0x7758, 2, 6), []string{"AckShareMemory"}},
	}
	for _, c := range cases {
		for _, split := range []bool{false, true} {
			name := c.name
			if split {
				name += "/separate writes"
			}
			t.Run(name, func(t *testing.T) {
				conf := hsConfig(t, MemMapTypeDevShmFile)
				rr := createRawRegions(t, conf, MemMapTypeDevShmFile, rawLayout{})
				raw, sc := unixPair(t)
				ch := startHandshake(func() (*Session, error) { return Server(sc, conf) })
				hsWrite(t, raw, rawPathFrame(2, 0, rr.queuePath, rr.bufPath))
				r := awaitHandshake(t, ch, 5*time.Second)
				if r.err != nil {
					t.Fatalf("Server: %v", r.err)
				}
				// Valid frames first: they must not end the session. A server
				// accepts HotRestartAck (docs/protocol.md §3.2).
				// A second Polling frame ends them: once the server has
				// counted two, it has acted on them all.
				good := append(append([]byte(nil), hsPollingV2...), hsStreamCloseV2...)
				good = append(good, rawFrame(16, 0x7758, 2, 9)...)
				good = append(good, 0, 0, 0, 0, 0, 0, 0, 1)
				good = append(good, hsPollingV2...)
				if split {
					hsWrite(t, raw, good)
					waitUntil(t, "the valid frames acted on", 2*time.Second, func() bool {
						return r.s.Stats().WakeupsReceived >= 2 || r.s.IsClosed()
					})
					if r.s.IsClosed() {
						t.Fatalf("valid frames closed the session: %v", r.s.Err())
					}
					hsWrite(t, raw, c.frame)
				} else {
					hsWrite(t, raw, append(good, c.frame...))
				}
				waitSessionClosed(t, r.s, 2*time.Second)
				err := r.s.Err()
				if !errors.Is(err, ErrProtocol) || !errors.Is(err, ErrSessionClosed) {
					t.Errorf("session error %v: want ErrSessionClosed and ErrProtocol", err)
				}
				for _, s := range c.want {
					if err != nil && !strings.Contains(err.Error(), s) {
						t.Errorf("session error %q does not mention %q", err, s)
					}
				}
				if _, aerr := r.s.AcceptStream(); aerr == nil {
					t.Error("AcceptStream succeeded on a closed session")
				}
				if got := hsExpectClosed(t, raw, 2*time.Second); len(got) != 0 {
					t.Errorf("server sent % x before closing", got)
				}
			})
		}
	}
}

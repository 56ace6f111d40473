package shmipc

// The client's side of the handshake against a raw server: the bytes it
// sends in each mode, bad or stalled replies, region files removed on
// failure, and memfd refused over TCP.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/shm"
	"golang.org/x/sys/unix"
)

// TestClientHandshakeBytesMemfd plays the server by hand and checks every
// byte the client sends in a version-3 memfd handshake (docs/protocol.md §4.2).
func TestClientHandshakeBytesMemfd(t *testing.T) {
	for _, replyVersion := range []uint8{3, 4} {
		t.Run(fmt.Sprintf("server replies version %d", replyVersion), func(t *testing.T) {
			conf := hsConfig(t, MemMapTypeMemFd)
			cc, raw := unixPair(t)
			ch := startHandshake(func() (*Session, error) { return Client(cc, conf) })

			if got := hsReadExactly(t, raw, 8); !bytes.Equal(got, hsExchangeV3) {
				t.Fatalf("first frame % x, want % x", got, hsExchangeV3)
			}
			hsWrite(t, raw, rawFrame(8, 0x7758, replyVersion, 4))

			h, queuePath, bufPath := hsReadPathFrame(t, raw)
			if want := rawFrame(uint32(12+len(queuePath)+len(bufPath)), 0x7758, 3, 5); !bytes.Equal(h, want) {
				t.Fatalf("ShareMemoryByMemfd header % x, want % x", h, want)
			}
			hsCheckClientPaths(t, conf, queuePath, bufPath)
			if files := hsRegionFiles(t, conf.ShareMemoryPathPrefix); len(files) != 0 {
				t.Errorf("memfd client created files %v", files)
			}

			hsWrite(t, raw, hsAckReadyV3)
			raw.SetReadDeadline(time.Now().Add(5 * time.Second))
			data := make([]byte, 16)
			oob := make([]byte, unix.CmsgSpace(8*4))
			n, oobn, flags, _, err := raw.ReadMsgUnix(data, oob)
			if err != nil {
				t.Fatalf("ReadMsgUnix: %v", err)
			}
			if n != 1 || data[0] != 0 {
				t.Errorf("fd message data % x, want exactly 00", data[:n])
			}
			if flags&unix.MSG_CTRUNC != 0 {
				t.Errorf("control data truncated")
			}
			if oobn != unix.CmsgSpace(8) {
				t.Errorf("control data of %d bytes, want CMSG_SPACE(8) = %d", oobn, unix.CmsgSpace(8))
			}
			msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
			if err != nil {
				t.Fatal(err)
			}
			var fds []int
			for i := range msgs {
				if msgs[i].Header.Level != unix.SOL_SOCKET || msgs[i].Header.Type != unix.SCM_RIGHTS {
					t.Errorf("control message %d: level %d type %d", i, msgs[i].Header.Level, msgs[i].Header.Type)
					continue
				}
				got, err := unix.ParseUnixRights(&msgs[i])
				if err != nil {
					t.Fatal(err)
				}
				fds = append(fds, got...)
			}
			defer shm.CloseFds(fds...)
			if len(msgs) != 1 || len(fds) != 2 {
				t.Fatalf("%d control messages with %d fds, want 1 with 2", len(msgs), len(fds))
			}
			// Buffer fd first, then queue fd, both fully initialised.
			var st unix.Stat_t
			if err := unix.Fstat(fds[0], &st); err != nil || st.Size != int64(conf.ShareMemoryBufferCap) {
				t.Errorf("first fd: size %d, %v; want the buffer region of %d bytes", st.Size, err, conf.ShareMemoryBufferCap)
			}
			head := make([]byte, 8)
			if _, err := unix.Pread(fds[0], head, 0); err != nil {
				t.Fatal(err)
			}
			if lists := binary.LittleEndian.Uint16(head); lists != uint16(len(conf.BufferSliceSizes)) {
				t.Errorf("buffer region says %d lists, want %d", lists, len(conf.BufferSliceSizes))
			}
			qSize := shm.QueueRegionSize(conf.QueueCap)
			if err := unix.Fstat(fds[1], &st); err != nil || st.Size != int64(qSize) {
				t.Errorf("second fd: size %d, %v; want the queue region of %d bytes", st.Size, err, qSize)
			}
			for _, off := range []int64{queueCapOff, int64(qSize/2 + queueCapOff)} {
				if _, err := unix.Pread(fds[1], head[:4], off); err != nil {
					t.Fatal(err)
				}
				if c := binary.LittleEndian.Uint32(head); c != conf.QueueCap {
					t.Errorf("queue capacity at %d is %d, want %d", off, c, conf.QueueCap)
				}
			}

			select {
			case r := <-ch:
				t.Fatalf("Client returned before AckShareMemory: %v", r.err)
			default:
			}
			hsWrite(t, raw, hsAckShmV3)
			r := awaitHandshake(t, ch, 5*time.Second)
			if r.err != nil {
				t.Fatalf("Client: %v", r.err)
			}
			if !r.s.isClient || r.s.version != 3 {
				t.Errorf("session: isClient %v, version %d", r.s.isClient, r.s.version)
			}
			r.s.Close()
			if got := hsExpectClosed(t, raw, 2*time.Second); len(got) != 0 {
				t.Errorf("client sent % x after the handshake, want nothing", got)
			}
		})
	}
}

// TestClientHandshakeBytesFileMode checks that a file-mode client sends one
// version-2 ShareMemoryByFilePath frame naming files it created, and does not
// wait for any reply (docs/protocol.md §4.1).
func TestClientHandshakeBytesFileMode(t *testing.T) {
	waitsInParallel(t)
	conf := hsConfig(t, MemMapTypeDevShmFile)
	cc, raw := unixPair(t)
	// The raw server neither reads nor writes until Client has returned.
	r := awaitHandshake(t, startHandshake(func() (*Session, error) { return Client(cc, conf) }), 5*time.Second)
	if r.err != nil {
		t.Fatalf("Client: %v", r.err)
	}
	if r.s.version != 2 {
		t.Errorf("session version %d, want 2", r.s.version)
	}
	h, queuePath, bufPath := hsReadPathFrame(t, raw)
	if want := rawFrame(uint32(12+len(queuePath)+len(bufPath)), 0x7758, 2, 0); !bytes.Equal(h, want) {
		t.Fatalf("ShareMemoryByFilePath header % x, want % x", h, want)
	}
	hsCheckClientPaths(t, conf, queuePath, bufPath)
	for _, f := range []struct {
		path string
		size int64
	}{{bufPath, int64(conf.ShareMemoryBufferCap)}, {queuePath, int64(shm.QueueRegionSize(conf.QueueCap))}} {
		fi, err := os.Lstat(f.path)
		if err != nil {
			t.Fatalf("region file named in the handshake: %v", err)
		}
		if !fi.Mode().IsRegular() || fi.Size() != f.size {
			t.Errorf("%s: mode %v size %d, want a regular file of %d bytes", f.path, fi.Mode(), fi.Size(), f.size)
		}
	}
	b, err := os.ReadFile(bufPath)
	if err != nil {
		t.Fatal(err)
	}
	if lists := binary.LittleEndian.Uint16(b); lists != uint16(len(conf.BufferSliceSizes)) {
		t.Errorf("buffer file says %d lists, want %d", lists, len(conf.BufferSliceSizes))
	}
	hsExpectNothing(t, raw, 100*time.Millisecond)
	r.s.Close()
	for _, p := range []string{bufPath, queuePath} {
		if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s still exists after the client session closed (%v)", p, err)
		}
	}
	if got := hsExpectClosed(t, raw, 2*time.Second); len(got) != 0 {
		t.Errorf("client sent % x after the handshake, want nothing", got)
	}
}

// TestClientHandshakeFailureRemovesFiles: a file-mode client whose
// handshake fails removes the region files it created (docs/protocol.md §4.5).
func TestClientHandshakeFailureRemovesFiles(t *testing.T) {
	conf := hsConfig(t, MemMapTypeDevShmFile)
	cc, raw := unixPair(t)
	raw.Close()
	r := awaitHandshake(t, startHandshake(func() (*Session, error) { return Client(cc, conf) }), 2*time.Second)
	if r.err == nil {
		t.Fatal("Client succeeded with a closed peer")
	}
	if !errors.Is(r.err, ErrHandshake) {
		t.Errorf("error %v does not wrap ErrHandshake", r.err)
	}
	if files := hsRegionFiles(t, conf.ShareMemoryPathPrefix); len(files) != 0 {
		t.Errorf("failed client handshake left region files %v", files)
	}

	// A prefix in a directory that does not exist fails cleanly too.
	conf = hsConfig(t, MemMapTypeDevShmFile)
	conf.ShareMemoryPathPrefix = filepath.Join(t.TempDir(), "missing", "shmipc")
	cc, raw = unixPair(t)
	r = awaitHandshake(t, startHandshake(func() (*Session, error) { return Client(cc, conf) }), 2*time.Second)
	if r.err == nil || !errors.Is(r.err, ErrHandshake) {
		t.Errorf("Client with a missing prefix directory: %v, want ErrHandshake", r.err)
	}
	if got := hsExpectClosed(t, raw, 2*time.Second); len(got) != 0 {
		t.Errorf("client sent % x", got)
	}
}

// TestClientHandshakeBadServerReplies: a server reply the client cannot use
// fails the handshake at once, not by timeout.
func TestClientHandshakeBadServerReplies(t *testing.T) {
	cases := []struct {
		name  string
		reply []byte
	}{
		{"exchange with version 2", rawFrame(8, 0x7758, 2, 4)},
		{"exchange with version 1", rawFrame(8, 0x7758, 1, 4)},
		{"exchange with bad magic", rawFrame(8, 0x7757, 3, 4)},
		{"exchange with version 0", rawFrame(8, 0x7758, 0, 4)},
		{"AckShareMemory instead of exchange", hsAckShmV3},
		{"exchange with a payload", rawFrame(20, 0x7758, 3, 4)},
		{"type 10", rawFrame(8, 0x7758, 3, 10)},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			conf := hsConfig(t, MemMapTypeMemFd)
			cc, raw := unixPair(t)
			ch := startHandshake(func() (*Session, error) { return Client(cc, conf) })
			if got := hsReadExactly(t, raw, 8); !bytes.Equal(got, hsExchangeV3) {
				t.Fatalf("first frame % x", got)
			}
			hsWrite(t, raw, c.reply)
			r := awaitHandshake(t, ch, 2*time.Second)
			if r.err == nil {
				t.Fatal("Client accepted the reply")
			}
			if !errors.Is(r.err, ErrHandshake) || hsIsTimeout(r.err) {
				t.Errorf("error %v: want ErrHandshake and no timeout", r.err)
			}
			if got := hsExpectClosed(t, raw, 2*time.Second); len(got) != 0 {
				t.Errorf("client sent % x after a bad reply", got)
			}
		})
	}
}

// TestClientHandshakeStalledPeer: a server that stops answering makes Client
// fail with a timeout after InitializeTimeout.
//
// What the server says before it stops is in the socket before Client
// starts: the stall is the same however late the test's goroutine runs.
// The client's messages stay in the socket for the test to read.
func TestClientHandshakeStalledPeer(t *testing.T) {
	cases := []struct {
		name string
		said []byte // by the server before it stops
		read func(t *testing.T, raw *net.UnixConn)
	}{
		{"silent", nil, func(t *testing.T, raw *net.UnixConn) {}},
		{"no AckReadyRecvFD", hsExchangeV3, func(t *testing.T, raw *net.UnixConn) {
			hsReadExactly(t, raw, 8)
			hsReadPathFrame(t, raw)
		}},
		{"no AckShareMemory", append(slices.Clone(hsExchangeV3), hsAckReadyV3...), func(t *testing.T, raw *net.UnixConn) {
			hsReadExactly(t, raw, 8)
			hsReadPathFrame(t, raw)
			raw.SetReadDeadline(time.Now().Add(5 * time.Second))
			oob := make([]byte, unix.CmsgSpace(8*4))
			_, oobn, _, _, err := raw.ReadMsgUnix(make([]byte, 1), oob)
			if err != nil {
				t.Fatal(err)
			}
			msgs, _ := unix.ParseSocketControlMessage(oob[:oobn])
			for i := range msgs {
				fds, _ := unix.ParseUnixRights(&msgs[i])
				shm.CloseFds(fds...)
			}
		}},
	}
	// Every case's handshake starts at once, so that their timeouts run
	// together; each is then checked in a subtest of its own.
	const timeout = 200 * time.Millisecond
	handshakes := make([]<-chan handshakeResult, len(cases))
	raws := make([]*net.UnixConn, len(cases))
	for i, c := range cases {
		conf := hsConfig(t, MemMapTypeMemFd)
		conf.InitializeTimeout = timeout
		cc, raw := unixPair(t)
		if len(c.said) > 0 {
			hsWrite(t, raw, c.said)
		}
		raws[i] = raw
		handshakes[i] = startHandshake(func() (*Session, error) { return Client(cc, conf) })
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			raw := raws[i]
			c.read(t, raw)
			r := awaitHandshake(t, handshakes[i], 3*time.Second)
			if r.err == nil {
				t.Fatal("Client succeeded with a stalled server")
			}
			if !errors.Is(r.err, ErrHandshake) || !hsIsTimeout(r.err) {
				t.Errorf("error %v: want ErrHandshake and a timeout", r.err)
			}
			if r.took >= 3*time.Second {
				t.Errorf("Client took %v with InitializeTimeout %v", r.took, timeout)
			}
			hsExpectClosed(t, raw, 2*time.Second)
		})
	}
}

// TestClientMemfdOverTCP: memfd regions cannot cross TCP; the client says so
// at once instead of hanging.
func TestClientMemfdOverTCP(t *testing.T) {
	conf := hsConfig(t, MemMapTypeMemFd)
	cc, raw := tcpPair(t)
	r := awaitHandshake(t, startHandshake(func() (*Session, error) { return Client(cc, conf) }), 2*time.Second)
	if r.err == nil {
		t.Fatal("Client in memfd mode over TCP succeeded")
	}
	if !errors.Is(r.err, ErrHandshake) || hsIsTimeout(r.err) {
		t.Errorf("error %v: want ErrHandshake, not a timeout", r.err)
	}
	if msg := r.err.Error(); !strings.Contains(msg, "memfd") || !strings.Contains(strings.ToLower(msg), "unix") {
		t.Errorf("error %q does not explain that memfd needs a Unix socket", msg)
	}
	if got := hsExpectClosed(t, raw, 2*time.Second); len(got) != 0 {
		t.Errorf("client sent % x over TCP", got)
	}

	// Dial refuses before connecting.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	dr := awaitHandshake(t, startHandshake(func() (*Session, error) {
		return Dial("tcp", ln.Addr().String(), conf)
	}), 2*time.Second)
	if dr.err == nil || !errors.Is(dr.err, ErrInvalidConfig) {
		t.Errorf("Dial tcp in memfd mode: %v, want ErrInvalidConfig", dr.err)
	}
}

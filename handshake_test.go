package shmipc

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/wire"
	"golang.org/x/sys/unix"
)

// Frames a raw peer sends or expects, written out byte by byte
// (PROTOCOL.md §2) rather than built with package wire.
var (
	hsExchangeV3    = []byte{0x00, 0x00, 0x00, 0x08, 0x77, 0x58, 0x03, 0x04}
	hsAckShmV3      = []byte{0x00, 0x00, 0x00, 0x08, 0x77, 0x58, 0x03, 0x06}
	hsAckReadyV3    = []byte{0x00, 0x00, 0x00, 0x08, 0x77, 0x58, 0x03, 0x07}
	hsPollingV2     = []byte{0x00, 0x00, 0x00, 0x08, 0x77, 0x58, 0x02, 0x01}
	hsStreamCloseV2 = []byte{0x00, 0x00, 0x00, 0x0c, 0x77, 0x58, 0x02, 0x02, 0x00, 0x00, 0x00, 0x63}
)

// hsRegionFiles lists the files under prefix.
func hsRegionFiles(t *testing.T, prefix string) []string {
	t.Helper()
	m, err := filepath.Glob(prefix + "_*")
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// hsConfig is a small configuration with a private path prefix.
func hsConfig(t *testing.T, mode MemMapType) *Config {
	t.Helper()
	c := DefaultConfig()
	c.MemMapType = mode
	c.ShareMemoryBufferCap = 2 << 20
	c.BufferSliceSizes = ReferenceSliceSizes()
	c.QueueCap = 1024
	c.InitializeTimeout = 5 * time.Second
	c.ShareMemoryPathPrefix = shmPrefix(t, "hs")
	return c
}

func hsReadExactly(t *testing.T, c net.Conn, n int) []byte {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	b := make([]byte, n)
	if _, err := io.ReadFull(c, b); err != nil {
		t.Fatalf("raw peer reading %d bytes: %v", n, err)
	}
	return b
}

func hsWrite(t *testing.T, c net.Conn, b []byte) {
	t.Helper()
	c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write(b); err != nil {
		t.Fatalf("raw peer writing % x: %v", b, err)
	}
}

// hsExpectClosed reads from c until the peer closes the connection, which must
// happen within the given time, and returns what was received meanwhile.
func hsExpectClosed(t *testing.T, c net.Conn, within time.Duration) []byte {
	t.Helper()
	start := time.Now()
	c.SetReadDeadline(start.Add(within))
	var got []byte
	buf := make([]byte, 4096)
	for {
		n, err := c.Read(buf)
		got = append(got, buf[:n]...)
		if err == nil {
			continue
		}
		if errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) {
			return got
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("connection still open %v after it should have been closed (received % x)", time.Since(start), got)
		}
		t.Fatalf("raw peer read: %v", err)
	}
}

// hsExpectNothing checks that nothing arrives on c for a short while.
func hsExpectNothing(t *testing.T, c net.Conn, d time.Duration) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(d))
	buf := make([]byte, 64)
	n, err := c.Read(buf)
	if n > 0 || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("raw peer received % x, %v; want nothing", buf[:n], err)
	}
}

// hsReadPathFrame reads a path message and decodes it by hand.
func hsReadPathFrame(t *testing.T, c net.Conn) (h []byte, queuePath, bufPath string) {
	t.Helper()
	h = hsReadExactly(t, c, 8)
	if !bytes.Equal(h[4:6], []byte{0x77, 0x58}) {
		t.Fatalf("path message header % x has the wrong magic", h)
	}
	length := binary.BigEndian.Uint32(h)
	if length < 12 || length > 1<<17 {
		t.Fatalf("path message header % x has length %d", h, length)
	}
	p := hsReadExactly(t, c, int(length)-8)
	qLen := int(binary.BigEndian.Uint16(p))
	if 2+qLen+2 > len(p) {
		t.Fatalf("path payload % x: queue path length %d too long", p, qLen)
	}
	queuePath = string(p[2 : 2+qLen])
	bLen := int(binary.BigEndian.Uint16(p[2+qLen:]))
	if 4+qLen+bLen != len(p) {
		t.Fatalf("path payload of %d bytes holds %d+%d path bytes", len(p), qLen, bLen)
	}
	bufPath = string(p[4+qLen:])
	return h, queuePath, bufPath
}

// hsCheckClientPaths checks the names a client chose (PROTOCOL.md §3, with the
// random part this implementation adds).
func hsCheckClientPaths(t *testing.T, conf *Config, queuePath, bufPath string) {
	t.Helper()
	pre := fmt.Sprintf("%s_%d_", conf.ShareMemoryPathPrefix, os.Getpid())
	if !strings.HasPrefix(queuePath, pre) || !strings.HasSuffix(queuePath, "_queue_0") {
		t.Errorf("queue path %q, want %s..._queue_0", queuePath, pre)
	}
	if !strings.HasPrefix(bufPath, pre) || !strings.HasSuffix(bufPath, "_buffer") {
		t.Errorf("buffer path %q, want %s..._buffer", bufPath, pre)
	}
	if strings.TrimSuffix(queuePath, "_queue_0") != strings.TrimSuffix(bufPath, "_buffer") {
		t.Errorf("queue path %q and buffer path %q do not share a prefix", queuePath, bufPath)
	}
}

func hsIsTimeout(err error) bool {
	return errors.Is(err, ErrTimeout) || errors.Is(err, os.ErrDeadlineExceeded)
}

// hsWaitNoFiles waits for every region file under prefix to be removed.
func hsWaitNoFiles(t *testing.T, prefix string, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		left := hsRegionFiles(t, prefix)
		if len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("region files left %v after the sessions closed: %v", within, left)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// hsCheckFiles checks that a file-mode session has exactly its two
// region files.
func hsCheckFiles(t *testing.T, conf *Config) {
	t.Helper()
	files := hsRegionFiles(t, conf.ShareMemoryPathPrefix)
	var buffers, queues int
	for _, f := range files {
		switch {
		case strings.HasSuffix(f, "_buffer"):
			buffers++
		case strings.HasSuffix(f, "_queue_0"):
			queues++
		}
	}
	if conf.MemMapType == MemMapTypeMemFd {
		if len(files) != 0 {
			t.Errorf("memfd session created files %v", files)
		}
		return
	}
	if buffers != 1 || queues != 1 || len(files) != 2 {
		t.Errorf("file-mode session has region files %v, want one buffer and one queue", files)
	}
}

// TestHandshakeEcho runs both versions of the handshake between this
// package's client and server, then one echo round trip.
func TestHandshakeEcho(t *testing.T) {
	cases := []struct {
		name    string
		network string
		mode    MemMapType
		version uint8
	}{
		{"unix/memfd", "unix", MemMapTypeMemFd, 3},
		{"unix/file", "unix", MemMapTypeDevShmFile, 2},
		{"tcp/file", "tcp", MemMapTypeDevShmFile, 2},
	}
	for _, c := range cases {
		t.Run(c.name+"/listener", func(t *testing.T) {
			conf := hsConfig(t, c.mode)
			addr := "127.0.0.1:0"
			if c.network == "unix" {
				addr = sockPath(t)
			}
			ln, err := Listen(c.network, addr, conf)
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			go serveStreams(ln, echoStream)
			r := awaitHandshake(t, startHandshake(func() (*Session, error) {
				return Dial(c.network, ln.Addr().String(), conf)
			}), 5*time.Second)
			if r.err != nil {
				t.Fatalf("Dial: %v", r.err)
			}
			if !r.s.isClient || r.s.version != c.version {
				t.Errorf("client session: isClient %v, version %d; want true, %d", r.s.isClient, r.s.version, c.version)
			}
			hsCheckFiles(t, conf)
			mustEcho(t, r.s)
			mustEcho(t, r.s)
			r.s.Close()
			ln.Close()
			hsWaitNoFiles(t, conf.ShareMemoryPathPrefix, 3*time.Second)
		})
		t.Run(c.name+"/direct", func(t *testing.T) {
			conf := hsConfig(t, c.mode)
			var cc, sc net.Conn
			if c.network == "unix" {
				cc, sc = unixPair(t)
			} else {
				cc, sc = tcpPair(t)
			}
			srvCh := startHandshake(func() (*Session, error) { return Server(sc, conf) })
			cr := awaitHandshake(t, startHandshake(func() (*Session, error) { return Client(cc, conf) }), 5*time.Second)
			if cr.err != nil {
				t.Fatalf("Client: %v", cr.err)
			}
			sr := awaitHandshake(t, srvCh, 5*time.Second)
			if sr.err != nil {
				t.Fatalf("Server: %v", sr.err)
			}
			if sr.s.isClient || sr.s.version != c.version || cr.s.version != c.version {
				t.Errorf("versions: client %d, server %d (server isClient %v); want %d", cr.s.version, sr.s.version, sr.s.isClient, c.version)
			}
			hsCheckFiles(t, conf)
			go func() {
				st, err := sr.s.AcceptStream()
				if err != nil {
					return
				}
				defer st.Close()
				io.Copy(st, st)
			}()
			mustEcho(t, cr.s)
			cr.s.Close()
			// The server session notices that the client went away.
			waitSessionClosed(t, sr.s, 3*time.Second)
			if err := sr.s.Err(); !errors.Is(err, ErrSessionClosed) || errors.Is(err, ErrProtocol) {
				t.Errorf("server session error after the client closed: %v", err)
			}
			sr.s.Close()
			hsWaitNoFiles(t, conf.ShareMemoryPathPrefix, 3*time.Second)
		})
	}
}

// TestClientHandshakeBytesMemfd plays the server by hand and checks every
// byte the client sends in a version-3 memfd handshake (PROTOCOL.md §1.5).
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
			defer closeFds(fds...)
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
			qSize := queueRegionSize(conf.QueueCap)
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
// wait for any reply (PROTOCOL.md §1.4).
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
	}{{bufPath, int64(conf.ShareMemoryBufferCap)}, {queuePath, int64(queueRegionSize(conf.QueueCap))}} {
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
// handshake fails removes the region files it created (PROTOCOL.md §1.6).
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
// the server answers (PROTOCOL.md §1.4, §1.5).
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
		if got := r.s.queueRegion.mem; len(got) != len(rr.queue.mem) {
			t.Errorf("server queue region of %d bytes, client's is %d", len(got), len(rr.queue.mem))
		} else {
			rr.queue.mem[len(got)-1] = 0x5A
			if got[len(got)-1] != 0x5A {
				t.Error("server queue region does not share memory with the client's")
			}
			rr.queue.mem[len(got)-1] = 0
		}
		if len(r.s.buf.mem) != len(rr.buf.mem) {
			t.Errorf("server buffer region of %d bytes, client's is %d", len(r.s.buf.mem), len(rr.buf.mem))
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
		// error, and the server removes the region files (PROTOCOL.md §1.6).
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
				closeFds(fds...)
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

func TestConfigVerify(t *testing.T) {
	if err := DefaultConfig().Verify(); err != nil {
		t.Fatalf("DefaultConfig().Verify() = %v", err)
	}
	if err := hsConfig(t, MemMapTypeDevShmFile).Verify(); err != nil {
		t.Fatalf("file-mode test config: %v", err)
	}
	var nilConf *Config
	if err := nilConf.Verify(); !errors.Is(err, ErrInvalidConfig) {
		t.Errorf("nil config: %v", err)
	}
	cases := []struct {
		name   string
		change func(c *Config)
	}{
		{"QueueCap 0", func(c *Config) { c.QueueCap = 0 }},
		{"QueueCap 100", func(c *Config) { c.QueueCap = 100 }},
		{"QueueCap 8200", func(c *Config) { c.QueueCap = 8200 }},
		{"QueueCap 8", func(c *Config) { c.QueueCap = 8 }},
		{"buffer cap 1 MiB - 1", func(c *Config) { c.ShareMemoryBufferCap = 1<<20 - 1 }},
		{"buffer cap 0", func(c *Config) { c.ShareMemoryBufferCap = 0 }},
		{"slice size 8190", func(c *Config) {
			c.BufferSliceSizes = []SizePercentPair{{8190, 50}, {32748, 30}, {131052, 20}}
		}},
		{"slice size 2", func(c *Config) { c.BufferSliceSizes = []SizePercentPair{{2, 100}} }},
		{"slice size 0", func(c *Config) { c.BufferSliceSizes = []SizePercentPair{{0, 50}, {4096, 50}} }},
		{"duplicate sizes", func(c *Config) { c.BufferSliceSizes = []SizePercentPair{{4096, 50}, {4096, 50}} }},
		{"duplicate sizes unsorted", func(c *Config) {
			c.BufferSliceSizes = []SizePercentPair{{8192, 30}, {4096, 40}, {8192, 30}}
		}},
		{"percentages 90", func(c *Config) {
			c.BufferSliceSizes = []SizePercentPair{{8172, 50}, {32748, 30}, {131052, 10}}
		}},
		{"percentages 110", func(c *Config) {
			c.BufferSliceSizes = []SizePercentPair{{8172, 60}, {32748, 30}, {131052, 20}}
		}},
		{"percentages 0", func(c *Config) { c.BufferSliceSizes = []SizePercentPair{{4096, 0}} }},
		{"no slice sizes", func(c *Config) { c.BufferSliceSizes = nil }},
		{"InitializeTimeout 0", func(c *Config) { c.InitializeTimeout = 0 }},
		{"InitializeTimeout negative", func(c *Config) { c.InitializeTimeout = -time.Second }},
		{"ConnectionWriteTimeout 0", func(c *Config) { c.ConnectionWriteTimeout = 0 }},
		{"unknown MemMapType", func(c *Config) { c.MemMapType = 7 }},
		{"empty prefix", func(c *Config) { c.ShareMemoryPathPrefix = "" }},
		{"file-mode prefix relative", func(c *Config) {
			c.MemMapType = MemMapTypeDevShmFile
			c.ShareMemoryPathPrefix = "shmipc_relative"
		}},
		{"file-mode prefix with ..", func(c *Config) {
			c.MemMapType = MemMapTypeDevShmFile
			c.ShareMemoryPathPrefix = "/dev/shm/../tmp/shmipc"
		}},
		{"file-mode prefix too long", func(c *Config) {
			c.MemMapType = MemMapTypeDevShmFile
			c.ShareMemoryPathPrefix = "/dev/shm/" + strings.Repeat("p", 200)
		}},
		{"memfd prefix too long for the handshake", func(c *Config) {
			c.ShareMemoryPathPrefix = "/dev/shm/" + strings.Repeat("p", 70000)
		}},
		// A free list never hands out its last slice: one slice is none.
		{"one slice in the only class", func(c *Config) {
			c.ShareMemoryBufferCap = 1 << 20
			c.BufferSliceSizes = []SizePercentPair{{1<<20 - 1024, 100}}
		}},
		{"one slice in each class", func(c *Config) {
			c.ShareMemoryBufferCap = 1 << 20
			c.BufferSliceSizes = []SizePercentPair{{300 << 10, 50}, {400 << 10, 50}}
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			conf := DefaultConfig()
			c.change(conf)
			err := conf.Verify()
			if !errors.Is(err, ErrInvalidConfig) {
				t.Fatalf("Verify() = %v, want ErrInvalidConfig", err)
			}
			if _, err := Listen("unix", sockPath(t), conf); !errors.Is(err, ErrInvalidConfig) {
				t.Errorf("Listen: %v, want ErrInvalidConfig", err)
			}
			if _, err := Dial("unix", sockPath(t), conf); !errors.Is(err, ErrInvalidConfig) {
				t.Errorf("Dial: %v, want ErrInvalidConfig", err)
			}
		})
	}
	// Client and Server reject it too, and close the connection.
	bad := DefaultConfig()
	bad.QueueCap = 100
	for _, side := range []string{"client", "server"} {
		a, b := unixPair(t)
		f := Client
		if side == "server" {
			f = Server
		}
		r := awaitHandshake(t, startHandshake(func() (*Session, error) { return f(a, bad) }), 2*time.Second)
		if !errors.Is(r.err, ErrInvalidConfig) {
			t.Errorf("%s with QueueCap 100: %v, want ErrInvalidConfig", side, r.err)
		}
		if got := hsExpectClosed(t, b, 2*time.Second); len(got) != 0 {
			t.Errorf("%s with an invalid config sent % x", side, got)
		}
	}
}

// TestServerRunningPhaseBadFrames: after a good version-2 handshake done by
// a raw client, a bad frame ends the server session with ErrProtocol and an
// error that names the problem (PROTOCOL.md §2).
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
				// accepts HotRestartAck (PROTOCOL.md §2.2).
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

// TestIsTimeout: a deadline error however wrapped is a timeout, other errors
// are not, and telling costs no allocation (a kicked socket read asks).
func TestIsTimeout(t *testing.T) {
	kicked := error(&net.OpError{Op: "raw-read", Net: "unix", Err: os.ErrDeadlineExceeded})
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{kicked, true},
		{fmt.Errorf("reading a frame: %w", kicked), true},
		{fmt.Errorf("%w: %w", ErrHandshake, kicked), true}, // Unwrap() []error
		{fmt.Errorf("%w: %w", ErrHandshake, io.EOF), false},
		{os.ErrDeadlineExceeded, true},
		{io.EOF, false},
		{&net.OpError{Op: "read", Net: "unix", Err: syscall.ECONNRESET}, false},
		{nil, false},
	} {
		if got := isTimeout(tc.err); got != tc.want {
			t.Errorf("isTimeout(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
	if n := testing.AllocsPerRun(100, func() { isTimeout(kicked) }); n != 0 {
		t.Errorf("isTimeout allocates %v times per call", n)
	}
}

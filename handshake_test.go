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
	"strings"
	"syscall"
	"testing"
	"time"
)

// Frames a raw peer sends or expects, written out byte by byte
// (docs/protocol.md §3) rather than built with package wire.
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

// hsCheckClientPaths checks the names a client chose (docs/protocol.md §5, with the
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

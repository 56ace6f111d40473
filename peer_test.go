package shmipc

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestAllowedPeerUIDs checks that a server refuses a client whose user id is
// not allowed, before any handshake, and accepts one that is.
func TestAllowedPeerUIDs(t *testing.T) {
	self := uint32(os.Getuid())
	for _, tc := range []struct {
		name    string
		allowed []uint32
		ok      bool
	}{
		{"anyone", nil, true},
		{"self allowed", []uint32{12345, self}, true},
		{"self not allowed", []uint32{self + 1}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sock := filepath.Join(t.TempDir(), "p.sock")
			srvConf := DefaultConfig()
			srvConf.AllowedPeerUIDs = tc.allowed
			ln, err := Listen("unix", sock, srvConf)
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			conf := DefaultConfig()
			conf.InitializeTimeout = 5 * time.Second
			sess, err := Dial("unix", sock, conf)
			if tc.ok {
				if err != nil {
					t.Fatalf("Dial: %v", err)
				}
				sess.Close()
				return
			}
			if err == nil {
				sess.Close()
				t.Fatal("Dial succeeded for a user that is not allowed")
			}
			if !errors.Is(err, ErrHandshake) {
				t.Fatalf("Dial error %v does not wrap ErrHandshake", err)
			}
		})
	}
}

// TestSocketFileMode checks that Listen gives the socket file owner-only
// permissions by default, and the configured ones otherwise.
func TestSocketFileMode(t *testing.T) {
	for _, mode := range []os.FileMode{0, 0o660} {
		sock := filepath.Join(t.TempDir(), "m.sock")
		conf := DefaultConfig()
		want := conf.SocketFileMode
		if mode != 0 {
			conf.SocketFileMode, want = mode, mode
		}
		ln, err := Listen("unix", sock, conf)
		if err != nil {
			t.Fatal(err)
		}
		fi, err := os.Stat(sock)
		ln.Close()
		if err != nil {
			t.Fatal(err)
		}
		if got := fi.Mode().Perm(); got != want {
			t.Errorf("socket file mode %v, want %v", got, want)
		}
	}
}

// TestShareMemoryFileMode checks the permissions of region files in file mode.
func TestShareMemoryFileMode(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "f.sock")
	conf := DefaultConfig()
	conf.MemMapType = MemMapTypeDevShmFile
	conf.ShareMemoryBufferCap = 2 << 20
	conf.BufferSliceSizes = ReferenceSliceSizes()
	conf.ShareMemoryPathPrefix = shmPrefix(t, "perm")
	ln, err := Listen("unix", sock, conf)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	sess, err := Dial("unix", sock, conf)
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	files, _ := filepath.Glob(conf.ShareMemoryPathPrefix + "_*")
	if len(files) != 2 {
		t.Fatalf("found %d region files, want 2: %v", len(files), files)
	}
	for _, f := range files {
		fi, err := os.Stat(f)
		if err != nil {
			t.Fatal(err)
		}
		if got := fi.Mode().Perm(); got != 0o600 {
			t.Errorf("%s: mode %v, want 0600", f, got)
		}
	}
}

// TestPeerOf checks the identity a server gets for its peer: uid and pid
// over a Unix socket, the uid alone over TCP loopback (IPv4, IPv6, and an
// IPv4 client of a dual-stack listener: our end is an IPv6 socket with a
// mapped address, the client's end is in /proc/net/tcp), and an error for a
// connection that is no socket.
func TestPeerOf(t *testing.T) {
	self := peerID{uid: uint32(os.Getuid()), pid: int32(os.Getpid())}
	for _, tc := range []struct {
		name, network, listen, dial string
		want                        peerID
	}{
		{"unix", "unix", filepath.Join(t.TempDir(), "p.sock"), "", self},
		{"tcp4", "tcp4", "127.0.0.1:0", "", peerID{uid: self.uid}},
		{"tcp6", "tcp6", "[::1]:0", "", peerID{uid: self.uid}},
		{"dual-stack", "tcp", "[::]:0", "127.0.0.1", peerID{uid: self.uid}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ln, err := net.Listen(tc.network, tc.listen)
			if err != nil {
				if tc.network != "unix" {
					t.Skipf("no %s loopback here: %v", tc.network, err)
				}
				t.Fatal(err)
			}
			defer ln.Close()
			addr := ln.Addr().String()
			if tc.dial != "" {
				addr = net.JoinHostPort(tc.dial, strconv.Itoa(ln.Addr().(*net.TCPAddr).Port))
			}
			c, err := net.Dial(ln.Addr().Network(), addr)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			sc, err := ln.Accept()
			if err != nil {
				t.Fatal(err)
			}
			defer sc.Close()
			got, err := peerOf(sc)
			if err != nil || got != tc.want {
				t.Errorf("peerOf(%v <- %v) = %v, %v; want %v", sc.LocalAddr(), sc.RemoteAddr(), got, err, tc.want)
			}
		})
	}
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if got, err := peerOf(a); !errors.Is(err, errNoPeerID) {
		t.Errorf("peerOf(net.Pipe) = %v, %v; want an error wrapping errNoPeerID", got, err)
	}
}

// TestFileModeNeedsPeerUID checks that a server refuses file-mode regions on
// a connection that cannot tell who the client is, even when the files are
// valid, with a handshake error that says why.
func TestFileModeNeedsPeerUID(t *testing.T) {
	conf := peerConfig(t, MemMapTypeDevShmFile, 0)
	r := createRawRegions(t, conf, MemMapTypeDevShmFile, rawLayout{})
	client, server := net.Pipe()
	defer client.Close()
	go func() { _, _ = client.Write(rawPathFrame(2, 0, r.queuePath, r.bufPath)) }()
	s, err := Server(server, conf)
	if err == nil {
		s.Close()
		t.Fatal("the server mapped file-mode regions for a client it cannot identify")
	}
	if !errors.Is(err, ErrHandshake) || !errors.Is(err, errNoPeerID) || !strings.Contains(err.Error(), "file-mode regions need the client's user id") {
		t.Errorf("Server error %q; want ErrHandshake wrapping errNoPeerID, naming file mode", err)
	}
}

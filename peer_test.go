package shmipc

import (
	"errors"
	"os"
	"path/filepath"
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
	conf.ShareMemoryPathPrefix = filepath.Join("/dev/shm", "shmipc_perm_"+filepath.Base(t.TempDir()))
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

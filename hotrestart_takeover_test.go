package shmipc

// ListenTakeover without a hot restart: the old server's Close, and socket
// paths too long for the temporary name.

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestTakeoverSurvivesOldClose: a server started with Listen whose path a
// new server took over with ListenTakeover closes without a hot restart
// (stopping gracefully, or giving up on HotRestart). Its Close must leave
// the new server's socket file, and Close of the new one removes it.
func TestTakeoverSurvivesOldClose(t *testing.T) {
	sock := sockPath(t)
	conf := smTestConfig()
	conf.ShareMemoryPathPrefix = shmPrefix(t, "takeover")
	v1, err := Listen("unix", sock, conf)
	if err != nil {
		t.Fatal(err)
	}
	defer v1.CloseAll()
	go serveStreams(v1, echoStream)
	v2, err := ListenTakeover(sock, conf)
	if err != nil {
		t.Fatal(err)
	}
	defer v2.CloseAll()
	go serveStreams(v2, echoStream)
	if err := v1.Close(); err != nil {
		t.Fatal(err)
	}
	s, err := Dial("unix", sock, conf)
	if err != nil {
		t.Fatalf("dial after the old server's Close: %v", err)
	}
	mustEcho(t, s)
	s.Close()
	if got := v2.Addr().String(); got != sock {
		t.Errorf("the new listener's address is %q, want %q", got, sock)
	}
	if err := v2.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the socket file after the last server's Close: %v; want it removed", err)
	}
}

// TestTakeoverLongPath takes over a socket path with room left for its
// own name but not for ListenTakeover's longer temporary one.
func TestTakeoverLongPath(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s.sock")
	if room := 100 - len(sock); room > 0 {
		dir := filepath.Join(filepath.Dir(sock), strings.Repeat("d", room))
		if err := os.Mkdir(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		sock = filepath.Join(dir, "s.sock")
	}
	conf := smTestConfig()
	conf.ShareMemoryPathPrefix = shmPrefix(t, "takeover")
	v1, err := Listen("unix", sock, conf)
	if err != nil {
		t.Fatalf("Listen on a path of %d bytes: %v", len(sock), err)
	}
	defer v1.CloseAll()
	v2, err := ListenTakeover(sock, conf)
	if err != nil {
		t.Fatalf("ListenTakeover of the same %d-byte path: %v", len(sock), err)
	}
	defer v2.CloseAll()
	go serveStreams(v2, echoStream)
	if got := v2.Addr().String(); got != sock {
		t.Errorf("the new listener's address is %q, want %q", got, sock)
	}
	s, err := Dial("unix", sock, conf)
	if err != nil {
		t.Fatalf("dial the new server: %v", err)
	}
	defer s.Close()
	mustEcho(t, s)
	if fi, err := os.Stat(sock); err != nil || fi.Mode().Perm() != conf.SocketFileMode {
		t.Errorf("the socket file: %v, %v; want mode %v", fi.Mode(), err, conf.SocketFileMode)
	}
}

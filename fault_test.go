package shmipc

import (
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestShrunkRegionFaultsAreErrors truncates a file-mode buffer region after
// the handshake, as a peer that created it could. Touching the lost pages
// must end the sessions with an error naming a memory fault, not crash the
// process, and other sessions must keep working.
func TestShrunkRegionFaultsAreErrors(t *testing.T) {
	conf := DefaultConfig()
	conf.MemMapType = MemMapTypeDevShmFile
	conf.ShareMemoryBufferCap = 4 << 20
	conf.BufferSliceSizes = ReferenceSliceSizes()
	conf.ShareMemoryPathPrefix = shmPrefix(t, "fault")
	ln := startEchoListener(t, conf)
	good, err := Dial("unix", ln.Addr().String(), conf)
	if err != nil {
		t.Fatal(err)
	}
	defer good.Close()
	before, _ := filepath.Glob(conf.ShareMemoryPathPrefix + "_*_buffer")

	victim, err := Dial("unix", ln.Addr().String(), conf)
	if err != nil {
		t.Fatal(err)
	}
	defer victim.Close()
	after, _ := filepath.Glob(conf.ShareMemoryPathPrefix + "_*_buffer")
	var victimBuf string
	for _, f := range after {
		if !contains(before, f) {
			victimBuf = f
		}
	}
	if victimBuf == "" {
		t.Fatalf("cannot tell the victim's buffer file among %v", after)
	}
	// A version-2 client does not wait for the server to map the regions:
	// one round trip first, so that the server has them when they shrink.
	st, err := victim.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	st.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := st.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(st, make([]byte, 4)); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(victimBuf, 4096); err != nil {
		t.Fatal(err)
	}
	msg := bytes.Repeat([]byte("x"), 300000)
	st.SetDeadline(time.Now().Add(5 * time.Second))
	_, werr := st.Write(msg)
	var rerr error
	if werr == nil {
		_, rerr = io.ReadFull(st, make([]byte, len(msg)))
	}
	err = errors.Join(werr, rerr)
	if err == nil {
		t.Fatal("writing into a shrunk region succeeded")
	}
	if !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "memory fault") {
		t.Fatalf("error %v does not wrap ErrProtocol naming a memory fault", err)
	}
	st.Close()

	// The other session is unaffected.
	gst, err := good.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer gst.Close()
	gst.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := gst.Write([]byte("still here")); err != nil {
		t.Fatal(err)
	}
	reply := make([]byte, 10)
	if _, err := io.ReadFull(gst, reply); err != nil || string(reply) != "still here" {
		t.Fatalf("other session: %q, %v", reply, err)
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// TestRequireSealedMemory checks that a server with RequireSealedMemory
// accepts this package's sealed memfds and refuses file-mode regions.
func TestRequireSealedMemory(t *testing.T) {
	dir := t.TempDir()
	srv := DefaultConfig()
	srv.RequireSealedMemory = true
	ln, err := Listen("unix", filepath.Join(dir, "s.sock"), srv)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	sess, err := Dial("unix", filepath.Join(dir, "s.sock"), nil)
	if err != nil {
		t.Fatalf("sealed memfds refused: %v", err)
	}
	sess.Close()

	conf := DefaultConfig()
	conf.MemMapType = MemMapTypeDevShmFile
	conf.ShareMemoryBufferCap = 2 << 20
	conf.BufferSliceSizes = ReferenceSliceSizes()
	conf.ShareMemoryPathPrefix = shmPrefix(t, "seal")
	sess, err = Dial("unix", filepath.Join(dir, "s.sock"), conf)
	if err != nil {
		t.Fatal(err) // version 2 has no reply: the client learns when the session ends
	}
	defer sess.Close()
	select {
	case <-sess.closed:
	case <-time.After(5 * time.Second):
		t.Fatal("a file-mode session to a server requiring sealed memory stayed up")
	}
}

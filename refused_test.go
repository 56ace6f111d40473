package shmipc

// Slices of a message for a stream the server refuses go back to the buffer
// region: a client's sessions share one region (region_pool.go), so a slice
// lost with one session is lost to the others.

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

// TestRefusedChild is the server process of TestRefusedStreamFreesSlices: a
// listener on SOCK with Config.MaxPendingAccepts PENDING and MaxStreams
// STREAMS that accepts nothing until the file GO exists, then reads every
// stream to its end and closes it.
func TestRefusedChild(t *testing.T) {
	if proctest.Role() == "" {
		t.Skip("runs only as the child process of TestRefusedStreamFreesSlices")
	}
	conf := DefaultConfig()
	var err error
	if conf.MaxPendingAccepts, err = strconv.Atoi(proctest.MustArg(t, "PENDING")); err != nil {
		t.Fatal(err)
	}
	if conf.MaxStreams, err = strconv.Atoi(proctest.MustArg(t, "STREAMS")); err != nil {
		t.Fatal(err)
	}
	ln, err := Listen("unix", proctest.MustArg(t, "SOCK"), conf)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	gate := proctest.MustArg(t, "GO")
	go func() {
		for {
			if _, err := os.Stat(gate); err == nil {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		serveStreams(ln, func(st *Stream) {
			defer st.Close()
			_, _ = io.Copy(io.Discard, st)
		})
	}()
	proctest.Ready()
	<-proctest.StdinClosed()
}

// TestRefusedStreamFreesSlices: two sessions of this process share a buffer
// region with a server process; the first opens one stream more than the
// server takes (Config.MaxPendingAccepts, or MaxStreams), each with a
// message in shared memory, and the server ends that session. Once the
// server has read the streams it did take, every slice is free again, as
// the session that goes on sees it.
func TestRefusedStreamFreesSlices(t *testing.T) {
	for _, tc := range []struct {
		name             string
		pending, streams int
	}{
		{"MaxPendingAccepts", 2, 1 << 16},
		{"MaxStreams", 1 << 12, 1}, // more than twice 1 open
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			sock, gate := filepath.Join(dir, "refused.sock"), filepath.Join(dir, "go")
			c, _ := startChild(t, proctest.Config{TestName: "TestRefusedChild", Role: "server", Args: map[string]string{
				"SOCK": sock, "GO": gate, "PENDING": strconv.Itoa(tc.pending), "STREAMS": strconv.Itoa(tc.streams),
			}})
			defer c.Stop(10 * time.Second)
			conf := peerConfig(t, MemMapTypeMemFd, 0)
			conf.ShareMemoryBufferCap = 4 << 20
			a, err := Dial("unix", sock, conf)
			if err != nil {
				t.Fatal(err)
			}
			defer a.Close()
			b, err := Dial("unix", sock, conf)
			if err != nil {
				t.Fatal(err)
			}
			defer b.Close()
			if a.buf != b.buf {
				t.Fatal("the two sessions do not share a buffer region")
			}
			before := fmt.Sprint(freeCounts(b.buf))
			for i := range 3 {
				st, err := a.OpenStream()
				if err != nil {
					t.Fatal(err)
				}
				if _, err := st.Write([]byte("message on stream " + strconv.Itoa(i))); err != nil {
					t.Fatalf("write on stream %d: %v", i, err)
				}
			}
			waitUntil(t, "the server ends the session with one stream too many", 10*time.Second, a.IsClosed)
			if err := os.WriteFile(gate, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			a.Close()
			var after string
			deadline := time.Now().Add(5 * time.Second)
			for after != before && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
				after = fmt.Sprint(freeCounts(b.buf))
			}
			if after != before {
				t.Errorf("free slices of the shared region: %s before, %s after the refused session ended", before, after)
			}
			if b.IsClosed() {
				t.Errorf("the other session ended: %v", b.Err())
			}
		})
	}
}

package shmipc

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

// The child process of TestStreamCloseThenSessionEnd.
const (
	eoChildTest = "TestEndOrderChild"
	eoRole      = "close-then-end"
)

// eoPayload is what session i's stream carries: sizes from 1 byte to 64
// KiB, so that some messages take one slice and some several.
func eoPayload(i int) []byte {
	return mpPayload(1+(i*7919)%(64<<10), uint64(i))
}

// TestStreamCloseThenSessionEnd: a peer process that writes on a stream,
// reads the echo, closes the stream and at once closes its session, many
// times over. Each stream's reader must get all of its data and then
// io.EOF: the stream was closed before the session ended, so it ended
// cleanly, whatever the order in which the close (on the IO queue) and the
// end of the connection (on the socket) are noticed. Every third session
// ends with its stream still open: that reader gets all of its data too,
// then the session's error, never a clean io.EOF.
func TestStreamCloseThenSessionEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: waits out timeouts of seconds")
	}
	const sessions = 150
	prefix := shmPrefix(t, "eo")
	sock := filepath.Join(t.TempDir(), "s.sock")
	ln, err := Listen("unix", sock, mpConfig(MemMapTypeMemFd, prefix))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()

	type result struct {
		data []byte
		err  error
	}
	var (
		mu      sync.Mutex
		results []result
		wg      sync.WaitGroup
	)
	serveStreamsCounted(ln, &wg, func(st *Stream) {
		defer st.Close()
		data, err := eoEchoAll(st)
		mu.Lock()
		results = append(results, result{data, err})
		mu.Unlock()
	})

	c, _ := startChild(t, proctest.Config{
		TestName: eoChildTest,
		Role:     eoRole,
		Args:     map[string]string{"SOCK": sock, "PREFIX": prefix, "N": strconv.Itoa(sessions)},
	})
	if err := c.Wait(60 * time.Second); err != nil {
		t.Fatalf("child: %v\n%s", err, c.Output())
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		mu.Lock()
		n := len(results)
		mu.Unlock()
		if n == sessions {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d streams ended", n, sessions)
		}
		time.Sleep(10 * time.Millisecond)
	}
	ln.Close() // ends the accept loop, which wg counts too
	wg.Wait()

	index := make(map[string]int, sessions) // payload → session
	for i := range sessions {
		index[string(eoPayload(i))] = i
	}
	var bad []string
	for _, r := range results {
		i, ok := index[string(r.data)]
		switch {
		case !ok:
			bad = append(bad, fmt.Sprintf("read %d bytes that no stream sent, then %v", len(r.data), r.err))
		case eoLeftOpen(i) && (r.err == nil || !errors.Is(r.err, ErrSessionClosed)):
			bad = append(bad, fmt.Sprintf("session %d (stream left open): read all, then %v, want ErrSessionClosed", i, r.err))
		case !eoLeftOpen(i) && r.err != nil:
			bad = append(bad, fmt.Sprintf("session %d (stream closed): read all, then %v, want io.EOF", i, r.err))
		}
		delete(index, string(r.data))
	}
	if len(bad) > 0 {
		t.Errorf("%d of %d streams did not end as they should; first: %s", len(bad), sessions, bad[0])
	}
}

// eoLeftOpen reports whether session i ends with its stream open.
func eoLeftOpen(i int) bool { return i%3 == 2 }

// eoEchoAll echoes what it reads on st until the end of the stream, and
// returns all it read and the error that ended it (nil for io.EOF).
func eoEchoAll(st *Stream) ([]byte, error) {
	var all []byte
	buf := make([]byte, 16<<10)
	for {
		n, err := st.Read(buf)
		all = append(all, buf[:n]...)
		if n > 0 {
			if _, werr := st.Write(buf[:n]); werr != nil {
				return all, fmt.Errorf("echo: %w", werr)
			}
		}
		if err == io.EOF {
			return all, nil
		}
		if err != nil {
			return all, err
		}
	}
}

// TestEndOrderChild is the child of TestStreamCloseThenSessionEnd. In a
// normal run it skips itself.
func TestEndOrderChild(t *testing.T) {
	if proctest.Role() != eoRole {
		t.Skip("runs only as the child process of TestStreamCloseThenSessionEnd")
	}
	sock := proctest.MustArg(t, "SOCK")
	conf := mpConfig(MemMapTypeMemFd, proctest.MustArg(t, "PREFIX"))
	n, err := strconv.Atoi(proctest.MustArg(t, "N"))
	if err != nil {
		t.Fatal(err)
	}
	proctest.Ready()
	for i := range n {
		sess, err := Dial("unix", sock, conf)
		if err != nil {
			t.Fatal(err)
		}
		st, err := sess.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		p := eoPayload(i)
		if _, err := st.Write(p); err != nil {
			t.Fatalf("session %d: write: %v", i, err)
		}
		if _, err := io.ReadFull(st, make([]byte, len(p))); err != nil {
			t.Fatalf("session %d: read the echo: %v", i, err)
		}
		if !eoLeftOpen(i) {
			if err := st.Close(); err != nil {
				t.Fatalf("session %d: close stream: %v", i, err)
			}
		}
		if err := sess.Close(); err != nil && !errors.Is(err, ErrSessionClosed) {
			t.Fatalf("session %d: close: %v", i, err)
		}
	}
}

// Data a client sends on a stream before it sees that the server closed the
// stream is dropped: it must not reach the server application as a new
// stream (implicit open, docs/protocol.md §9.2, is for ids the server has not
// closed), and the session goes on.
func TestLateDataAfterServerClose(t *testing.T) {
	conf := DefaultConfig()
	sess, accepted := bpPair(t, conf)
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := st.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	srv := <-accepted
	if _, err := io.ReadFull(srv, make([]byte, 5)); err != nil {
		t.Fatal(err)
	}

	// Hold the client's receive loop, so that the close the server
	// publishes on the client's queue stays there and the client goes on
	// sending on a stream the server has closed.
	release := holdReceive(t, sess)
	if err := srv.Close(); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if _, err := st.Write([]byte("late")); err != nil {
			release()
			t.Fatalf("write before the client saw the close: %v", err)
		}
	}
	release() // the receive loop drains what waited: the close

	// No stream is accepted for 300 ms (100 ms with -short: a ghost
	// stream, which the server would see before the new stream below,
	// would also be the next one accepted there and fail that check).
	select {
	case ghost := <-accepted:
		buf := make([]byte, 12)
		n, _ := io.ReadAtLeast(ghost, buf, 1)
		t.Fatalf("the server accepted stream %d carrying %q, data sent on the stream it had closed", ghost.ID(), buf[:n])
	case <-time.After(shortOr(300*time.Millisecond, 100*time.Millisecond)):
	}
	// The client sees the close; the session still carries new streams.
	st.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := st.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("read on the stream the server closed: %v, want io.EOF", err)
	}
	st2, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st2.Close()
	if _, err := st2.Write([]byte("next")); err != nil {
		t.Fatal(err)
	}
	srv2 := <-accepted
	defer srv2.Close()
	got := make([]byte, 4)
	if _, err := io.ReadFull(srv2, got); err != nil || string(got) != "next" {
		t.Fatalf("new stream after late data: %q, %v", got, err)
	}
}

// A stream whose Write overlaps the end of its session, and that is never
// closed, must not keep the session's shared memory mapped: the writer lets
// go of it when it finishes. (Only a stream holding received data needs
// Close for that.)
func TestWriteOverlappingSessionEndLetsGo(t *testing.T) {
	conf := peerConfig(t, MemMapTypeDevShmFile, 0)
	ln := startEchoListener(t, conf)
	sess, err := Dial("unix", ln.Addr().String(), conf)
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(st, make([]byte, 5)); err != nil {
		t.Fatal(err)
	}
	mapped := func() int {
		maps, err := os.ReadFile("/proc/self/maps")
		if err != nil {
			t.Fatal(err)
		}
		return strings.Count(string(maps), conf.ShareMemoryPathPrefix)
	}
	if mapped() == 0 {
		t.Fatalf("no mapping of %s* in this process", conf.ShareMemoryPathPrefix)
	}

	st.lockWriter() // a Write in progress while the session ends
	ln.CloseAll()
	waitSessionClosed(t, sess, peerTimeout)
	<-sess.loopDone
	if mapped() == 0 {
		t.Fatal("the regions were unmapped while a writer of the session was busy")
	}
	st.unlockWriter()
	waitUntil(t, "every region of the session is unmapped, its stream never closed", peerTimeout, func() bool { return mapped() == 0 })
}

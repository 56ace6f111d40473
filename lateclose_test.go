package shmipc

import (
	"io"
	"os"
	"strings"
	"testing"
	"time"
)

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

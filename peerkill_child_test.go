package shmipc

// The child process of the peer-kill tests: it writes what its seed says
// and kills itself.

import (
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

// TestPeerKillChild is the child of TestPeerKilledAfterWrites and
// TestPeerKilledWhileRepliedTo. In a normal run it skips itself.
func TestPeerKillChild(t *testing.T) {
	if proctest.Role() != pkRole {
		t.Skip("runs only as the child process of TestPeerKilledAfterWrites")
	}
	sock := proctest.MustArg(t, "SOCK")
	conf := pkChildConfig(proctest.MustArg(t, "PREFIX"))
	seed, err := strconv.ParseUint(proctest.MustArg(t, "SEED"), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	first, err := strconv.Atoi(proctest.MustArg(t, "FIRST"))
	if err != nil {
		t.Fatal(err)
	}

	// Dial the sessions, and open a sink stream on every other one.
	type writing struct {
		i, k    int
		st      *Stream
		sizes   []int
		content []byte
	}
	var streams []writing
	var sinks []*Stream
	for i := first; i < first+pkSessionsPerChild; i++ {
		sess, err := Dial("unix", sock, conf)
		if err != nil {
			t.Fatalf("session %d: %v", i, err)
		}
		if pkReset(i) {
			sink, err := sess.OpenStream()
			if err != nil {
				t.Fatal(err)
			}
			if _, err := sink.Write(pkHeader(i, pkSink)); err != nil {
				t.Fatalf("session %d: sink header: %v", i, err)
			}
			sinks = append(sinks, sink)
		}
		for k := range pkStreams(i) {
			st, err := sess.OpenStream()
			if err != nil {
				t.Fatal(err)
			}
			streams = append(streams, writing{i, k, st, pkSizes(seed, i, k), pkContent(seed, i, k)})
		}
	}
	// The parent's first frame on each sink has been handed to the stream
	// (Peek keeps it unread); say so, so that the parent sends the rest.
	for _, sink := range sinks {
		_ = sink.SetReadDeadline(time.Now().Add(30 * time.Second))
		if _, err := sink.BufferReader().Peek(1); err != nil {
			t.Fatalf("sink stream %d: waiting for the parent's first frame: %v", sink.ID(), err)
		}
		if _, err := sink.Write([]byte{pkAck}); err != nil {
			t.Fatalf("sink stream %d: acknowledgement: %v", sink.ID(), err)
		}
	}
	proctest.Ready()
	<-proctest.StdinClosed()

	// Message j of every stream, stream after stream, the streams to
	// close first, each closed right after its last message: the last call
	// before the kill is a Write.
	var order []writing
	for _, closing := range []bool{true, false} {
		for _, s := range streams {
			if pkClosed(s.i, s.k) == closing {
				order = append(order, s)
			}
		}
	}
	offsets := make([]int, len(order))
	for j := range pkMessages {
		for w, s := range order {
			msg := s.content[offsets[w] : offsets[w]+s.sizes[j]]
			offsets[w] += s.sizes[j]
			if err := pkSend(s.st, msg, (s.i+s.k+j)%2 == 0); err != nil {
				t.Fatalf("session %d stream %d: message %d of %d bytes: %v", s.i, s.k, j, len(msg), err)
			}
			if j == pkMessages-1 && pkClosed(s.i, s.k) {
				if err := s.st.Close(); err != nil {
					t.Fatalf("session %d stream %d: close: %v", s.i, s.k, err)
				}
			}
		}
	}
	if err := syscall.Kill(os.Getpid(), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Minute)
	t.Fatal("still running a minute after SIGKILL")
}

// pkSend writes msg on st. A message larger than any slice goes with Write,
// split into slices, or, with reserve, into one Reserve, which sends it and
// the rest of the stream, close included, over the socket as fallback
// data.
func pkSend(st *Stream, msg []byte, reserve bool) error {
	if !reserve || len(msg) < pkPastSlices() {
		_, err := st.Write(msg)
		return err
	}
	b, err := st.BufferWriter().Reserve(len(msg))
	if err != nil {
		return err
	}
	copy(b, msg)
	return st.Flush(false)
}

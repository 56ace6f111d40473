package shmipc

// A peer process killed right after writing: everything it wrote before it
// died must be read on this side, then its streams end, with io.EOF for
// those it had closed and with the session's error for the others.
//
// The parent listens; each child (this test binary re-executed, running
// TestPeerKillChild) dials a group of sessions, writes messages on one to
// three streams of each, closes some of them, and SIGKILLs itself as soon
// as its last Write returns. What each stream carries follows from a seed
// passed to the child, so the parent knows what to expect without being
// told.
//
// A Unix stream socket closed by a dying process gives its peer io.EOF,
// or ECONNRESET when the dead end still held bytes it had not read. The
// receive loop must deliver what the peer published before its end either
// way (drainBefore). Every other session of a child takes the ECONNRESET
// path by construction: on a "sink" stream the parent sends the child
// fallback data its reader never reads. The child's
// MaxFallbackBufferedPerStream is small, so its receive loop stops reading
// the socket once it holds the first frame, and the frames the parent
// sends after that stay in the child's socket until it dies. The other
// sessions receive nothing after the handshake and end with io.EOF.

import (
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

const (
	pkChildTest = "TestPeerKillChild"
	pkRole      = "killed-after-writes"

	pkChildren         = 4  // child processes, run at the same time
	pkSessionsPerChild = 24 // sessions each child dials
	pkMessages         = 6  // messages the child writes on each data stream

	// pkHeaderSize: every stream starts with the session's and the
	// stream's numbers (big-endian uint32 each), so that the parent can
	// tell which stream it accepted.
	pkHeaderSize = 8
	// pkSink is the stream number of a session's sink stream.
	pkSink = 1<<32 - 1
	// pkAck is what the child writes on a sink stream once the parent's
	// first frame has reached it.
	pkAck = 'k'
	// pkChildHold is the child's MaxFallbackBufferedPerStream: less than
	// the first frame on a sink stream, so that the next one stops the
	// child's receive loop.
	pkChildHold = 64 << 10
	// pkReadLimit bounds every read of the parent: a read still blocked
	// then is a hang, reported as such.
	pkReadLimit = 45 * time.Second
)

// pkLater are the fallback frames the parent sends on a sink stream after
// the first one: the child's receive loop stops at the first of them and
// reads at most one receive buffer (64 KiB) of what it has, so that more
// than 30 KiB are left in the kernel when the child dies. They add up to
// less than a Unix socket's default send buffer (208 KiB), so the parent's
// writes return without the child reading them.
var pkLater = []int{1 << 10, 32 << 10, 32 << 10, 32 << 10}

// pkReset reports whether session i has a sink stream, and so ends by
// ECONNRESET rather than io.EOF.
func pkReset(i int) bool { return i%2 == 1 }

// pkStreams is the number of data streams of session i: one, two or three.
// A reader polls for its data only while no other reader of its session
// sleeps (poll.go), which sessions of one stream let it do.
func pkStreams(i int) int { return 1 + i/2%3 }

// pkClosed reports whether the child closes stream k of session i before it
// dies: two streams in three.
func pkClosed(i, k int) bool { return (i/6+k)%3 != 0 }

// pkChildConfig is the configuration of the children. The buffer region has
// the reference layout (slices of at most 128 KiB), so that a Reserve of
// more goes as fallback data, and that messages of several hundred KiB
// span several slices.
func pkChildConfig(prefix string) *Config {
	conf := mpConfig(MemMapTypeMemFd, prefix)
	conf.ShareMemoryBufferCap = ReferenceBufferCap
	conf.BufferSliceSizes = ReferenceSliceSizes()
	conf.InitializeTimeout = 30 * time.Second
	conf.MaxFallbackBufferedPerStream = pkChildHold
	conf.FallbackStallTimeout = time.Minute // longer than a child lives
	return conf
}

// pkPastSlices is the smallest Reserve larger than any slice of the
// child's region: what it holds goes as fallback data, and so does
// everything sent after it on the stream. It is the size of the parent's
// first frame on a sink stream, more than pkChildHold.
func pkPastSlices() int {
	largest := 0
	for _, p := range ReferenceSliceSizes() {
		largest = max(largest, int(p.Size))
	}
	return largest + 4
}

// pkSizes returns the sizes of the messages the child writes on stream k of
// session i: 1 byte to 64 KiB, and now and then 128–512 KiB, which takes
// several of the largest slices, or goes as fallback data (pkSend). The
// first message also carries the header.
func pkSizes(seed uint64, i, k int) []int {
	rng := rand.New(rand.NewPCG(seed, uint64(i)<<32|uint64(k)))
	sizes := make([]int, pkMessages)
	for j := range sizes {
		switch r := rng.IntN(16); {
		case r == 0:
			sizes[j] = 128<<10 + rng.IntN(384<<10)
		case r < 5:
			sizes[j] = 1 + rng.IntN(64)
		case r < 10:
			sizes[j] = 1 + rng.IntN(8<<10)
		default:
			sizes[j] = 1 + rng.IntN(64<<10)
		}
	}
	sizes[0] += pkHeaderSize
	return sizes
}

// pkContent returns every byte the child writes on stream k of session i.
func pkContent(seed uint64, i, k int) []byte {
	n := 0
	for _, size := range pkSizes(seed, i, k) {
		n += size
	}
	b := mpPayload(n, seed^uint64(i)<<32^uint64(k))
	binary.BigEndian.PutUint32(b, uint32(i))
	binary.BigEndian.PutUint32(b[4:], uint32(k))
	return b
}

// pkHeader is the start of stream k of session i.
func pkHeader(i, k int) []byte {
	return binary.BigEndian.AppendUint32(binary.BigEndian.AppendUint32(nil, uint32(i)), uint32(k))
}

// TestPeerKilledAfterWrites: child processes write on many streams and
// SIGKILL themselves right after their last Write. On every stream the
// parent must read exactly what the child wrote; then a stream the child
// closed reads io.EOF, and one it left open fails with an error wrapping
// ErrSessionClosed and ErrPeerClosed, never io.EOF and never a hang. Half
// of the sessions end by ECONNRESET and half by io.EOF (see the top of
// the file); the test fails if either path was not taken at all.
func TestPeerKilledAfterWrites(t *testing.T) {
	pkRun(t, false)
}

// TestPeerKilledWhileRepliedTo is TestPeerKilledAfterWrites with the parent
// answering every read on the sessions without a sink stream, as a server
// does. A write to a peer that has just died sends a wake-up on the socket,
// which fails (EPIPE) before the receive loop has read to the end of the
// socket. That failure used to end the session at once: what the peer
// published before it died was never delivered, its closes never applied,
// and the streams ended with "send wake-up: write: broken pipe", not
// ErrPeerClosed (it failed in every run, up to 18 streams short of data).
// It now only stops the sending, and the receive loop ends the session
// (uds_conn.go).
func TestPeerKilledWhileRepliedTo(t *testing.T) {
	pkRun(t, true)
}

// pkRun runs the children and checks what the parent read.
func pkRun(t *testing.T, replies bool) {
	seed := rand.Uint64()
	t.Logf("seed %#x", seed)
	prefix := shmPrefix(t, "pk")
	sock := filepath.Join(t.TempDir(), "s.sock")
	conf := mpConfig(MemMapTypeMemFd, prefix)
	conf.InitializeTimeout = 30 * time.Second
	ln, err := Listen("unix", sock, conf)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()

	p := &pkParent{t: t, replies: replies, results: make(map[pkKey]pkResult), sessions: make(map[*Session]bool)}
	want := 0
	for i := range pkChildren * pkSessionsPerChild {
		want += pkStreams(i)
		if pkReset(i) {
			p.sinks[i/pkSessionsPerChild].Add(1)
			want++
		}
	}
	for c := range p.dead {
		p.dead[c] = make(chan struct{})
	}
	var wg sync.WaitGroup // the accepting goroutine and one per stream
	serveStreamsCounted(ln, &wg, p.serve)

	start := time.Now()
	children := make([]*proctest.Child, pkChildren)
	for c := range children {
		children[c], _ = startChild(t, proctest.Config{
			TestName: pkChildTest,
			Role:     pkRole,
			Args: map[string]string{
				"SOCK":   sock,
				"PREFIX": prefix,
				"SEED":   strconv.FormatUint(seed, 10),
				"FIRST":  strconv.Itoa(c * pkSessionsPerChild),
			},
		})
	}
	// The sinks of every child ready, all children write at once.
	for c, child := range children {
		if !clWaitGroup(&p.sinks[c], 30*time.Second) {
			t.Fatalf("child %d: its sink streams were not ready within 30s\n%s", c, child.Output())
		}
	}
	for _, child := range children {
		if err := child.CloseStdin(); err != nil {
			t.Fatal(err)
		}
	}
	for c, child := range children {
		if err := pkKilled(child.Wait(60 * time.Second)); err != nil {
			t.Fatalf("child %d: %v\n%s", c, err, child.Output())
		}
		close(p.dead[c])
	}
	t.Logf("children set up, wrote and died in %v", time.Since(start).Round(time.Millisecond))

	p.wait(want)
	if err := ln.Close(); err != nil {
		t.Error(err)
	}
	if !clWaitGroup(&wg, 10*time.Second) {
		t.Error("streams still being read 10s after the listener closed")
	}
	t.Logf("all streams ended %v after the start", time.Since(start).Round(time.Millisecond))

	p.mu.Lock()
	defer p.mu.Unlock()
	p.check(seed)
}

// pkKilled checks that a child ended by SIGKILL, as it does once it has
// written everything; err is what Child.Wait returned.
func pkKilled(err error) error {
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		if ws, ok := exit.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL {
			return nil
		}
	}
	if err == nil {
		return errors.New("exited with status 0, before killing itself")
	}
	return err
}

// The child process of the peer-kill tests: it writes what its seed says
// and kills itself.

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

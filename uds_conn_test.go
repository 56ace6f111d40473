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
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

// ucFallbackSize is a message that goes over the socket as fallback data
// (more than half of clConfig's region) and is much larger than a socket
// buffer, so that writing it blocks while the peer does not read.
const ucFallbackSize = 16 << 20

// ucStoppedPeer starts an echo server in a child process, dials it with
// conf and opens a stream, then stops the child (SIGSTOP): from then on
// nobody reads what the client sends. The child is killed when the test
// ends.
func ucStoppedPeer(t *testing.T, conf *Config) (*Session, *Stream, *proctest.Child) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "s.sock")
	c := lnStartChild(t, lnRoleEcho, sock, conf.ShareMemoryPathPrefix)
	sess, err := Dial("unix", sock, conf)
	if err != nil {
		t.Fatalf("dial the child: %v\n%s", err, c.Output())
	}
	t.Cleanup(func() { sess.Close() })
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	if err := c.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	// The signal stops each thread of the child as it next runs, not at
	// once: on a loaded machine the child's other threads go on reading
	// for a while.
	waitUntil(t, "every thread of the stopped child in state T", 10*time.Second, func() bool { return ucStopped(c.Pid()) })
	return sess, st, c
}

// ucStopped reports whether every thread of process pid is stopped.
func ucStopped(pid int) bool {
	stats, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stat", pid))
	for _, f := range stats {
		b, err := os.ReadFile(f)
		if err != nil {
			return false
		}
		// The state follows the command name, which is in parentheses.
		if i := bytes.LastIndexByte(b, ')'); i < 0 || i+2 >= len(b) || b[i+2] != 'T' {
			return false
		}
	}
	return len(stats) > 0
}

// ucBlockingWrite runs write, a write on st, and returns how long it took
// and its error, or fails the test if it has not returned within bound.
func ucBlockingWrite(t *testing.T, st *Stream, bound time.Duration, write func() error) (time.Duration, error) {
	t.Helper()
	start := time.Now()
	done := make(chan error, 1)
	go func() { done <- write() }()
	select {
	case err := <-done:
		return time.Since(start), err
	case <-time.After(bound):
		st.Session().Close() // unblocks the write, so that the test can end
		t.Fatalf("a fallback write to a peer that does not read still blocks after %v", bound)
		return 0, nil
	}
}

// TestFallbackWriteTimeoutRightAfterHandshake: a peer that stops reading
// right after the handshake makes a blocked socket write fail within about
// ConnectionWriteTimeout, ending the session, as it does later in the
// session's life. (The handshake used to clear the socket's deadline but
// not the copy the writers check, so for the first half of the timeout a
// write could block for good.)
func TestFallbackWriteTimeoutRightAfterHandshake(t *testing.T) {
	waitsInParallel(t)
	conf := clConfig(MemMapTypeMemFd, shmPrefix(t, "uc"))
	// Waited out; 200 ms with -short. The child is stopped within a few
	// milliseconds of the handshake, inside the first half of it.
	conf.ConnectionWriteTimeout = shortOr(time.Second, 200*time.Millisecond)
	sess, st, _ := ucStoppedPeer(t, conf)

	took, err := ucBlockingWrite(t, st, 10*time.Second, func() error {
		_, err := st.Write(make([]byte, ucFallbackSize))
		return err
	})
	t.Logf("the write returned after %v: %v", took, err)
	if err == nil {
		t.Fatal("a fallback write to a stopped peer succeeded")
	}
	if !errors.Is(err, ErrSessionClosed) || !sess.IsClosed() {
		t.Errorf("write error %v, session closed %v; want the write timeout to end the session", err, sess.IsClosed())
	}
}

// TestStreamWriteDeadlineBoundsFallbackWrite: a stream's write deadline
// bounds a write that goes over the socket as fallback data, even though
// ConnectionWriteTimeout is much longer. The write fails with a timeout
// error; as the deadline cut a frame short, the session ends.
func TestStreamWriteDeadlineBoundsFallbackWrite(t *testing.T) {
	waitsInParallel(t)
	conf := clConfig(MemMapTypeMemFd, shmPrefix(t, "uc"))
	conf.ConnectionWriteTimeout = time.Minute
	sess, st, _ := ucStoppedPeer(t, conf)

	// Build the message first: the deadline is for sending it.
	if _, err := st.BufferWriter().WriteBytes(make([]byte, ucFallbackSize)); err != nil {
		t.Fatal(err)
	}
	// The deadline is set by the writing goroutine right before it
	// writes, so that it passes while the frame is written however late
	// that goroutine runs: 150 ms with -short.
	deadline := shortOr(300*time.Millisecond, 150*time.Millisecond)
	took, err := ucBlockingWrite(t, st, 10*time.Second, func() error {
		st.SetWriteDeadline(time.Now().Add(deadline))
		return st.Flush(false)
	})
	t.Logf("the write returned after %v: %v", took, err)
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() || !errors.Is(err, ErrTimeout) || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("write past the stream's deadline: %v, want a timeout (net.Error, ErrTimeout)", err)
	}
	if !sess.IsClosed() || !errors.Is(sess.Err(), errFrameTorn) {
		t.Errorf("session after a frame was cut short: closed %v, Err %v; want it ended with errFrameTorn", sess.IsClosed(), sess.Err())
	}
}

// ucConnPair returns the two ends of a connected Unix socket pair, closed
// when the test ends.
func ucConnPair(t *testing.T) (net.Conn, net.Conn) {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conns := make([]net.Conn, 2)
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "socketpair")
		conns[i], err = net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conns[i].Close() })
	}
	return conns[0], conns[1]
}

// TestWriteFallbackStreamDeadline: the stream deadline passed to
// writeFallback bounds the write. Passed before anything of the frame is
// written (already past, or the socket full from the start), the error
// wraps ErrTimeout but not errFrameTorn: the connection is still usable.
// Passed part way through a frame, it wraps errFrameTorn too.
func TestWriteFallbackStreamDeadline(t *testing.T) {
	conn, _ := ucConnPair(t) // nobody reads the other end
	c := newEventConn(conn, time.Minute)
	data := [][]byte{make([]byte, ucFallbackSize)}

	err := c.writeFallback(3, 1, data, time.Now().Add(-time.Second))
	if !errors.Is(err, ErrTimeout) || errors.Is(err, errFrameTorn) {
		t.Errorf("deadline already past: %v, want ErrTimeout and no torn frame", err)
	}

	err = c.writeFallback(3, 1, data, time.Now().Add(100*time.Millisecond))
	if !errors.Is(err, ErrTimeout) || !errors.Is(err, errFrameTorn) {
		t.Errorf("deadline passing inside the frame: %v, want ErrTimeout and errFrameTorn", err)
	}

	// The socket is now full: the next frame cannot start.
	start := time.Now()
	err = c.writeFallback(3, 2, [][]byte{make([]byte, 64)}, time.Now().Add(100*time.Millisecond))
	if !errors.Is(err, ErrTimeout) || errors.Is(err, errFrameTorn) {
		t.Errorf("deadline passing before the frame starts: %v, want ErrTimeout and no torn frame", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("the write took %v; its deadline was 100ms away", d)
	}
}

// TestEventWriteDeadlineOnlyWhileBlocked: event frames go out without a
// write deadline left on the socket (a pending deadline is a runtime timer
// the Go scheduler checks on every round), yet a frame that cannot be
// written because the peer stopped reading fails within about
// ConnectionWriteTimeout rather than blocking for good.
func TestEventWriteDeadlineOnlyWhileBlocked(t *testing.T) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	mine, err := net.FileConn(os.NewFile(uintptr(fds[0]), "mine"))
	if err != nil {
		t.Fatal(err)
	}
	defer mine.Close()
	peer := os.NewFile(uintptr(fds[1]), "peer") // never read
	defer peer.Close()

	timeout := shortOr(300*time.Millisecond, 100*time.Millisecond) // waited out
	c := newEventConn(mine, timeout)
	frame := make([]byte, 4096)
	start := time.Now()
	var werr error
	for time.Since(start) < 10*time.Second {
		if werr = c.write(frame); werr != nil {
			break
		}
		c.wmu.Lock()
		armed := !c.deadline.IsZero()
		c.wmu.Unlock()
		if armed {
			t.Fatal("a write that did not block left a write deadline on the socket")
		}
	}
	took := time.Since(start)
	if werr == nil {
		t.Fatalf("writes to a peer that never reads still succeed after %v", took)
	}
	var ne net.Error
	if !errors.As(werr, &ne) || !ne.Timeout() {
		t.Errorf("the blocked write failed with %v; want a timeout", werr)
	}
	if took > timeout+5*time.Second {
		t.Errorf("the blocked write took %v to fail; ConnectionWriteTimeout is %v", took, timeout)
	}
	if !c.deadline.IsZero() {
		t.Error("the write deadline is still set after the blocked write returned")
	}
}

// The size of the FallbackData frames sent and taken (docs/protocol.md §9.5).

// rawFallbackSizes reads the victim's frames until it has data bytes of
// fallback data for stream id and returns the data size of each
// FallbackData frame (Polling frames are skipped), checking the bytes
// against want.
func rawFallbackSizes(t *testing.T, p *rawPeer, id uint32, want []byte) []int {
	t.Helper()
	p.conn.SetReadDeadline(time.Now().Add(4 * peerTimeout))
	defer p.conn.SetReadDeadline(time.Time{})
	var sizes []int
	got := 0
	for got < len(want) {
		h, err := readN(p.conn, 8)
		if err != nil {
			t.Fatalf("after %d bytes in frames %v: %v", got, sizes, err)
		}
		n := int(binary.BigEndian.Uint32(h))
		if n < 8 || n > 64<<20 {
			t.Fatalf("frame header % x", h)
		}
		rest, err := readN(p.conn, n-8)
		if err != nil {
			t.Fatal(err)
		}
		if h[7] != 3 {
			continue
		}
		if binary.BigEndian.Uint32(rest) != id {
			t.Fatalf("FallbackData for stream %d, want %d", binary.BigEndian.Uint32(rest), id)
		}
		data := rest[8:]
		if !bytes.Equal(data, want[got:got+len(data)]) {
			t.Fatalf("frame %d: the bytes differ from those written", len(sizes))
		}
		sizes = append(sizes, len(data))
		got += len(data)
	}
	return sizes
}

// TestFallbackOneFramePerMessage: a flushed message that goes over the
// socket is one FallbackData frame up to 32 MiB (header included), as the
// reference implementations send it, and frames of at most that beyond.
func TestFallbackOneFramePerMessage(t *testing.T) {
	p, victim := acceptRawVictim(t, MemMapTypeMemFd, 0)
	defer victim.Close()
	st := openPinged(t, p, victim)
	const most = 32<<20 - 16
	for _, tc := range []struct {
		size int
		want []int
	}{
		{5 << 20, []int{5 << 20}},              // more than the region gives: fallback
		{most, []int{most}},                    // the largest single frame
		{40 << 20, []int{most, 40<<20 - most}}, // split beyond it
	} {
		msg := mpPayload(tc.size, uint64(tc.size))
		errc := make(chan error, 1)
		go func() { _, err := st.Write(msg); errc <- err }()
		sizes := rawFallbackSizes(t, p, st.ID(), msg)
		if err := <-errc; err != nil {
			t.Fatalf("Write of %d bytes: %v", tc.size, err)
		}
		if !slices.Equal(sizes, tc.want) {
			t.Errorf("a message of %d bytes went in frames of %v bytes of data, want %v", tc.size, sizes, tc.want)
		}
	}
}

// TestFallbackTakesLargestFrame: a session configured with the smallest
// MaxFallbackFrameSize allowed takes the largest frame this
// implementation (or a reference one) sends: 32 MiB, header included.
func TestFallbackTakesLargestFrame(t *testing.T) {
	p, victim := acceptRawVictimWith(t, MemMapTypeMemFd, 0, func(c *Config) {
		c.MaxFallbackFrameSize = minFallbackFrame
	})
	defer victim.Close()
	st := openPinged(t, p, victim)
	data := mpPayload(32<<20-16, 7)
	go p.write(rawFallbackFrame(p.version, 0, st.ID(), 0, string(data)))
	st.SetReadDeadline(time.Now().Add(4 * peerTimeout))
	got := make([]byte, len(data))
	if _, err := io.ReadFull(st, got); err != nil {
		t.Fatalf("reading a 32 MiB frame: %v (session: %v)", err, victim.Err())
	}
	if !bytes.Equal(got, data) {
		t.Error("the bytes read differ from the frame's")
	}
}

// TestFallbackLatencyChild serves BenchmarkFallbackFrameLatency on SOCK: a
// stream whose first byte is 'A' is read and discarded, any other is
// echoed.
func TestFallbackLatencyChild(t *testing.T) {
	if proctest.Role() == "" {
		t.Skip("runs only as the child process of BenchmarkFallbackFrameLatency")
	}
	ln, err := Listen("unix", proctest.MustArg(t, "SOCK"), DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go serveStreams(ln, func(st *Stream) {
		defer st.Close()
		buf := make([]byte, 1<<20)
		n, err := st.Read(buf)
		if err != nil || n == 0 {
			return
		}
		if buf[0] == 'A' {
			_, _ = io.Copy(io.Discard, st)
			return
		}
		for err == nil {
			if _, err = st.Write(buf[:n]); err == nil {
				n, err = st.Read(buf)
			}
		}
	})
	proctest.Ready()
	<-proctest.StdinClosed()
}

// BenchmarkFallbackFrameLatency measures what fallback frames cost the
// other streams of a session: round trips of 64 B on stream B, to a server
// process, while stream A sends 32 MiB messages over the socket (the
// buffer region is too small for them), in frames of 1 MiB and of 32 MiB
// (the frame holds the socket, and B's wake-ups wait behind it). It
// reports the median, 99th percentile and largest round trip, and A's
// throughput.
func BenchmarkFallbackFrameLatency(b *testing.B) {
	sock := filepath.Join(b.TempDir(), "fb.sock")
	c := proctest.Start(b, proctest.Config{TestName: "TestFallbackLatencyChild", Role: "server", Args: map[string]string{"SOCK": sock}})
	defer c.Stop(10 * time.Second)
	if _, err := c.WaitReady(childStartTimeout); err != nil {
		b.Fatal(err, c.Output())
	}
	saved := fallbackFrameData
	defer func() { fallbackFrameData = saved }()
	for _, frame := range []int{1 << 20, 32 << 20} {
		b.Run(fmt.Sprintf("frame=%dMiB", frame>>20), func(b *testing.B) {
			fallbackFrameData = frame - 16
			conf := DefaultConfig()
			conf.ShareMemoryBufferCap = 16 << 20 // a 32 MiB message goes as fallback data
			conf.BufferSliceSizes = ReferenceSliceSizes()
			sess, err := Dial("unix", sock, conf)
			if err != nil {
				b.Fatal(err)
			}
			defer sess.Close()
			bulk, err := sess.OpenStream()
			if err != nil {
				b.Fatal(err)
			}
			big := bytes.Repeat([]byte{'A'}, 32<<20)
			var stop atomic.Bool
			var sent atomic.Int64
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				for !stop.Load() {
					if _, err := bulk.Write(big); err != nil {
						return
					}
					sent.Add(int64(len(big)))
				}
			}()
			small, err := sess.OpenStream()
			if err != nil {
				b.Fatal(err)
			}
			msg, reply := bytes.Repeat([]byte{'b'}, 64), make([]byte, 64)
			rtt := make([]time.Duration, 0, b.N)
			time.Sleep(50 * time.Millisecond) // the bulk stream is under way
			start := time.Now()
			b.ResetTimer()
			for range b.N {
				t0 := time.Now()
				if _, err := small.Write(msg); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(small, reply); err != nil {
					b.Fatal(err)
				}
				rtt = append(rtt, time.Since(t0))
			}
			b.StopTimer()
			elapsed := time.Since(start)
			stop.Store(true)
			bulk.Close()
			wg.Wait()
			slices.Sort(rtt)
			b.ReportMetric(float64(rtt[len(rtt)/2].Microseconds()), "p50-µs")
			b.ReportMetric(float64(rtt[len(rtt)*99/100].Microseconds()), "p99-µs")
			b.ReportMetric(float64(rtt[len(rtt)-1].Microseconds()), "max-µs")
			b.ReportMetric(float64(sent.Load())/elapsed.Seconds()/(1<<20), "bulk-MiB/s")
		})
	}
}

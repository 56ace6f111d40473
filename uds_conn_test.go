package shmipc

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
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

package shmipc

// Wake-ups (wakeup.go): a Write never waits for its wake-up, and counts a
// message on the queue whatever became of the wake-up.

import (
	"encoding/binary"
	"errors"
	"net"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/shm"
)

// rawVictimOver is acceptRawVictimWith with the client's session made by
// dial on the raw server's socket.
func rawVictimOver(t *testing.T, mode MemMapType, dial func(sock string, conf *Config) (*Session, error), edit func(*Config)) (*rawPeer, *Session) {
	t.Helper()
	conf := peerConfig(t, mode, 0)
	if edit != nil {
		edit(conf)
	}
	ln, sock := listenRaw(t)
	ch := startHandshake(func() (*Session, error) { return dial(sock, conf) })
	c := acceptRaw(t, ln)
	buf, q, v := mapRawClient(t, c, mode)
	res := awaitHandshake(t, ch, peerTimeout)
	if res.err != nil {
		t.Fatalf("handshake: %v", res.err)
	}
	bm, err := shm.NewBuffer(shm.RegionOf(buf), false)
	if err != nil {
		t.Fatal(err)
	}
	half := len(q) / 2
	qcap := uint32((half - queueHeaderSize) / queueElemSize)
	return &rawPeer{
		t: t, conn: c, version: v, buf: buf, bm: bm, lists: rawLists(buf),
		send: rawQueue{mem: q[half:], cap: qcap},
		recv: rawQueue{mem: q[:half], cap: qcap},
	}, res.s
}

// fillSocket writes Polling frames into the session's socket, without
// waiting, until it is full, and returns how many went in.
func fillSocket(t *testing.T, s *Session) int {
	t.Helper()
	frame := rawFrame(8, rawMagic, s.version, 1)
	c := s.ec
	c.wmu.Lock()
	defer c.unlockW()
	n := 0
	for {
		w, err := c.tryWriteErr(frame)
		if err != nil {
			t.Fatal(err)
		}
		if w == 0 {
			return n
		}
		if w != len(frame) {
			t.Fatalf("a write of %d bytes of a Polling frame", w)
		}
		n++
	}
}

// TestWakeupDoesNotWaitForSocket: the peer has not read its socket, which
// is full, and its working flag is clear. A small Write, whose element
// needs a wake-up, returns at once with everything written, rather than
// waiting for room in the socket until ConnectionWriteTimeout; the
// wake-up is not lost: once the peer reads, it finds it after the frames
// before it, and the message on the queue.
func TestWakeupDoesNotWaitForSocket(t *testing.T) {
	const writeTimeout = 3 * time.Second
	p, victim := acceptRawVictimWith(t, MemMapTypeMemFd, 0, func(c *Config) { c.ConnectionWriteTimeout = writeTimeout })
	defer victim.Close()
	st, err := victim.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	before := fillSocket(t, victim)
	if p.recv.flag() != 0 {
		t.Fatal("the peer's working flag is set before the write")
	}
	st.SetWriteDeadline(time.Now().Add(time.Second))
	start := time.Now()
	n, err := st.Write([]byte("hello"))
	took := time.Since(start)
	if n != 5 || err != nil {
		t.Errorf("Write with the socket full: %d, %v, want 5, nil", n, err)
	}
	if took > 500*time.Millisecond {
		t.Errorf("Write took %v with the socket full (ConnectionWriteTimeout %v)", took, writeTimeout)
	}
	// The peer reads: the frames before, then the wake-up.
	p.conn.SetReadDeadline(time.Now().Add(peerTimeout))
	frames := 0
	for frames < before+1 {
		h, err := readN(p.conn, 8)
		if err != nil {
			t.Fatalf("after %d frames (%d filled): %v", frames, before, err)
		}
		if binary.BigEndian.Uint32(h) != 8 || h[7] != 1 {
			t.Fatalf("frame %d: % x, want Polling", frames, h)
		}
		frames++
	}
	e, err := p.waitElem()
	if err != nil {
		t.Fatal(err)
	}
	if got, err := p.readMsg(e.Offset); err != nil || got != "hello" {
		t.Errorf("the message on the queue: %q, %v", got, err)
	}
	if victim.IsClosed() {
		t.Errorf("the session ended: %v", victim.Err())
	}
}

// errWriteFault stands for a write(2) failure that is not the peer's end.
var errWriteFault = errors.New("write fault")

// wakeFaultConn is a Unix connection whose writes fail with errWriteFault
// once fail is set, through the net.Conn and its raw descriptor alike.
type wakeFaultConn struct {
	*net.UnixConn
	fail atomic.Bool
}

func (c *wakeFaultConn) Write(b []byte) (int, error) {
	if c.fail.Load() {
		return 0, errWriteFault
	}
	return c.UnixConn.Write(b)
}

func (c *wakeFaultConn) SyscallConn() (syscall.RawConn, error) {
	rc, err := c.UnixConn.SyscallConn()
	return wakeFaultRaw{RawConn: rc, c: c}, err
}

type wakeFaultRaw struct {
	syscall.RawConn
	c *wakeFaultConn
}

func (r wakeFaultRaw) Write(f func(uintptr) bool) error {
	if r.c.fail.Load() {
		return errWriteFault
	}
	return r.RawConn.Write(f)
}

// TestWriteCountsQueuedMessage: the message is on the IO queue when the
// write of its wake-up fails (not because the peer went: the session ends
// with that error). The peer may read the message, and does here, so
// Write counts it: n is len(p), with the error.
func TestWriteCountsQueuedMessage(t *testing.T) {
	var fc *wakeFaultConn
	p, victim := rawVictimOver(t, MemMapTypeDevShmFile, func(sock string, conf *Config) (*Session, error) {
		c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: sock, Net: "unix"})
		if err != nil {
			return nil, err
		}
		fc = &wakeFaultConn{UnixConn: c}
		return Client(fc, conf)
	}, nil)
	defer victim.Close()
	st, err := victim.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	fc.fail.Store(true)
	n, err := st.Write([]byte("hello"))
	if !errors.Is(err, errWriteFault) {
		t.Errorf("Write: %v, want the write's error", err)
	}
	if n != 5 {
		t.Errorf("Write counted %d bytes of a message on the queue, want 5", n)
	}
	e, werr := p.waitElem()
	if werr != nil {
		t.Fatal(werr)
	}
	if got, err := p.readMsg(e.Offset); err != nil || got != "hello" {
		t.Errorf("the message on the queue: %q, %v", got, err)
	}
}

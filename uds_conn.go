package shmipc

import (
	"errors"
	"fmt"
	"net"
	"slices"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/goshm/shmipc/internal/shm"
	"github.com/goshm/shmipc/internal/wire"
	"golang.org/x/sys/unix"
)

// eventConn carries event frames on the session's socket. Reads come from
// one goroutine at a time (the handshake, then the receive loop); writes may
// come from any goroutine and are serialised so frames never interleave.
type eventConn struct {
	conn net.Conn
	unix *net.UnixConn // nil over TCP

	rbuf []byte // receive buffer; rbuf[r:w] is unread
	r, w int
	read uint64 // bytes read into rbuf so far (the running phase)

	raw syscall.RawConn // the connection's fd, for raw I/O and SIOCINQ; nil if none

	// SIOCINQ, set up on first use (inq, uds_read.go); receive loop only.
	inqFn  func(fd uintptr)
	inqN   int
	inqErr error

	tcp *tcpOrder // close ordering over TCP (tcp_order.go); receive loop only

	wmu          handoverMutex
	writeTimeout time.Duration
	// pollOwed: a Polling frame is owed, left to wmu's holder (writePolling,
	// unlockW); onAsyncErr gets the error of a write no caller waits for.
	pollOwed    atomic.Bool
	pollVersion atomic.Uint32
	onAsyncErr  func(error)
	wbuf        []byte      // scratch for small frames; guarded by wmu
	wvec        net.Buffers // scratch for fallback writes; guarded by wmu
	deadline    time.Time   // the write deadline set on conn (zero: none); guarded by wmu

	// One non-blocking write (tryWriteErr); guarded by wmu.
	wfn  func(fd uintptr) bool
	wb   []byte
	wn   int
	wErr error

	// One read at a time (readSome).
	rfn  func(fd uintptr) bool
	rb   []byte
	rn   int
	rErr error
}

// Frames go through the socket with raw system calls (readOnce, writeOnce)
// rather than the net package's Read and Write: the socket is non-blocking,
// and a call the runtime is told of would wake its monitor thread for
// nearly every frame of a process that waits for its peer. Waiting for the
// socket still goes through the network poller (syscall.RawConn), with the
// connection's deadlines.

// readBufSize is the initial receive buffer: many wake-up frames per read.
const readBufSize = 64 << 10

func newEventConn(conn net.Conn, writeTimeout time.Duration) *eventConn {
	c := &eventConn{conn: conn, writeTimeout: writeTimeout}
	c.unix, _ = conn.(*net.UnixConn)
	if sc, ok := conn.(syscall.Conn); ok {
		if raw, err := sc.SyscallConn(); err == nil {
			c.raw, c.wfn, c.rfn = raw, c.writeOnce, c.readOnce
		}
	}
	return c
}

// write sends one or more whole frames with a single write.
func (c *eventConn) write(b []byte) error {
	c.wmu.Lock()
	defer c.unlockW()
	if err := c.payPolling(); err != nil {
		return err
	}
	return c.writeLocked(b)
}

// clearDeadlines removes the handshake's deadlines from the connection.
// The write deadline the writers keep track of goes with them, so that the
// first write after the handshake sets a fresh one.
func (c *eventConn) clearDeadlines() error {
	c.wmu.Lock()
	defer c.unlockW()
	c.deadline = time.Time{}
	return c.conn.SetDeadline(time.Time{})
}

// armDeadline sets the socket's write deadline ConnectionWriteTimeout
// ahead, for a write that may block.
func (c *eventConn) armDeadline() error {
	c.deadline = time.Now().Add(c.writeTimeout)
	return c.conn.SetWriteDeadline(c.deadline)
}

// disarmDeadline removes the write deadline once such a write is done. A
// deadline left set would keep a runtime timer pending for good, and the
// Go scheduler reads the clock on every round while any timer is pending.
func (c *eventConn) disarmDeadline() {
	if !c.deadline.IsZero() {
		c.deadline = time.Time{}
		_ = c.conn.SetWriteDeadline(time.Time{})
	}
}

// writeLocked writes b whole. A frame nearly always fits in the socket's
// buffer, so it first tries one non-blocking write with no deadline armed;
// only a write that would block arms the deadline (ConnectionWriteTimeout),
// for as long as it takes.
func (c *eventConn) writeLocked(b []byte) error {
	n, _ := c.tryWriteErr(b) // an error comes again from the blocking write
	if n == len(b) {
		return nil
	}
	if err := c.armDeadline(); err != nil {
		return err
	}
	defer c.disarmDeadline()
	_, err := c.conn.Write(b[n:])
	return err
}

// writeOnce is tryWriteErr's callback: it never waits for the socket.
func (c *eventConn) writeOnce(fd uintptr) bool {
	raceReleaseIO()
	for {
		n, _, e := unix.RawSyscall(unix.SYS_WRITE, fd, uintptr(unsafe.Pointer(unsafe.SliceData(c.wb))), uintptr(len(c.wb)))
		switch e {
		case 0:
			c.wn, c.wErr = int(n), nil
		case unix.EINTR:
			continue
		default:
			c.wn, c.wErr = -1, e
		}
		return true
	}
}

// writeEvent sends a frame without payload (handshake only: it allocates).
func (c *eventConn) writeEvent(version uint8, t wire.Type) error {
	return c.write(wire.AppendEvent(nil, version, t))
}

// writeStreamClose sends a StreamClose frame.
func (c *eventConn) writeStreamClose(version uint8, id uint32) error {
	c.wmu.Lock()
	defer c.unlockW()
	if err := c.payPolling(); err != nil {
		return err
	}
	c.wbuf = wire.AppendStreamClose(c.wbuf[:0], version, id)
	return c.writeLocked(c.wbuf)
}

// errFrameTorn is wrapped by the error of a write that stopped part way
// through a frame: the peer can no longer tell where the next frame starts,
// so the connection is unusable.
var errFrameTorn = errors.New("frame cut short; the connection is unusable")

// writeFallback sends data as one FallbackData frame with one writev; the
// caller keeps each frame within the size limit. A non-zero deadline (the
// stream's write deadline) bounds this write if it comes before the
// connection's own write deadline. When it passes, the error wraps
// ErrTimeout, and errFrameTorn if part of the frame was written.
func (c *eventConn) writeFallback(version uint8, id uint32, data [][]byte, deadline time.Time) error {
	n := 0
	for _, d := range data {
		n += len(d)
	}
	c.wmu.Lock()
	defer c.unlockW()
	if err := c.payPolling(); err != nil {
		return err
	}
	if err := c.armDeadline(); err != nil {
		return err
	}
	defer c.disarmDeadline()
	byStream := !deadline.IsZero() && deadline.Before(c.deadline)
	if byStream {
		if !time.Now().Before(deadline) {
			return fmt.Errorf("%w: stream %d's write deadline passed before its fallback data was sent", ErrTimeout, id)
		}
		if err := c.conn.SetWriteDeadline(deadline); err != nil {
			return err
		}
		c.deadline = deadline
	}
	c.wbuf = wire.AppendFallbackHead(c.wbuf[:0], version, id, shm.StatusOpened, n)
	total := len(c.wbuf) + n
	c.wvec = append(append(c.wvec[:0], c.wbuf), data...)
	bufs := c.wvec
	sent, err := bufs.WriteTo(c.conn)
	clear(c.wvec)
	if err != nil && byStream && isTimeout(err) {
		if sent == 0 {
			return fmt.Errorf("%w: stream %d's write deadline passed before its fallback data was sent", ErrTimeout, id)
		}
		return fmt.Errorf("%w: stream %d's write deadline passed after %d of the %d bytes of a fallback frame: %w",
			ErrTimeout, id, sent, total, errFrameTorn)
	}
	return err
}

// sendFds sends the single 0x00 byte carrying fds in one SCM_RIGHTS message
// (docs/protocol.md §4.2).
func (c *eventConn) sendFds(fds ...int) error {
	if c.unix == nil {
		return errors.New("file descriptors need a Unix socket")
	}
	_, _, err := c.unix.WriteMsgUnix([]byte{0}, unix.UnixRights(fds...), nil)
	return err
}

// recvFds receives the fd message: exactly one data byte and one SCM_RIGHTS
// message with exactly n fds. Every fd received is closed on error.
func (c *eventConn) recvFds(n int) ([]int, error) {
	if c.unix == nil {
		return nil, errors.New("file descriptors need a Unix socket")
	}
	var data [1]byte
	oob := make([]byte, unix.CmsgSpace(4*(n+8)))
	dn, oobn, flags, _, err := c.unix.ReadMsgUnix(data[:], oob)
	var fds []int
	if oobn > 0 {
		msgs, perr := unix.ParseSocketControlMessage(oob[:oobn])
		if perr != nil && err == nil {
			err = fmt.Errorf("parse control message: %w", perr)
		}
		for i := range msgs {
			got, rerr := unix.ParseUnixRights(&msgs[i])
			if rerr != nil && err == nil {
				err = fmt.Errorf("control message %d: %w", i, rerr)
			}
			fds = append(fds, got...)
		}
		if err == nil && len(msgs) != 1 {
			err = fmt.Errorf("%d control messages, want 1", len(msgs))
		}
	}
	switch {
	case err != nil:
	case dn != 1:
		err = fmt.Errorf("fd message carries %d data bytes, want 1", dn)
	case flags&unix.MSG_CTRUNC != 0:
		err = errors.New("fd message control data truncated")
	case len(fds) != n:
		err = fmt.Errorf("fd message carries %d fds, want %d", len(fds), n)
	}
	if err != nil {
		shm.CloseFds(fds...)
		return nil, err
	}
	return fds, nil
}

// errPeerNotAllowed is wrapped by the error for a client whose user id is
// not in Config.AllowedPeerUIDs.
var errPeerNotAllowed = errors.New("peer user not allowed")

// checkPeer enforces Config.AllowedPeerUIDs on an accepted connection.
func checkPeer(conn net.Conn, allowed []uint32) error {
	if len(allowed) == 0 {
		return nil
	}
	uc, ok := conn.(*net.UnixConn)
	if !ok {
		return fmt.Errorf("%w: %T carries no peer credentials", errPeerNotAllowed, conn)
	}
	id, err := unixPeer(uc)
	if err != nil {
		return err
	}
	if slices.Contains(allowed, id.uid) {
		return nil
	}
	return fmt.Errorf("%w: uid %d (pid %d)", errPeerNotAllowed, id.uid, id.pid)
}

// A write on the connection can fail because the peer has gone (EPIPE,
// ECONNRESET) while what it sent before it went is still to be read, in
// this side's socket buffer and on the IO queue. So such a failure only
// stops this side's sending (sendable), and the receive loop reads on to
// the end of the socket, drains the queue and ends the session with
// ErrPeerClosed, as for any peer that closed its end. If that end has not
// come within peerGoneGrace (a peer that shut down only its reading side,
// or a receive loop waiting for a reader to take fallback data), the
// session ends with the write's error then.
const peerGoneGrace = time.Second

// sendable returns the error that sending on s must fail with: the
// session's, or that of a write that found the peer gone.
func (s *Session) sendable() error {
	if err := s.Err(); err != nil {
		return err
	}
	if e := s.sendErr.Load(); e != nil {
		return *e
	}
	return nil
}

// sendFailed handles the failure err of a write on the connection, what
// naming the write. It returns the error the caller's send fails with.
func (s *Session) sendFailed(what string, err error) error {
	cause := fmt.Errorf("%s: %w", what, err)
	if !errors.Is(err, syscall.EPIPE) && !errors.Is(err, syscall.ECONNRESET) {
		s.closeWithError(cause)
		return s.closedErr()
	}
	e := errorf("%w: %w (%w)", ErrSessionClosed, ErrPeerClosed, cause)
	if s.sendErr.CompareAndSwap(nil, &e) {
		time.AfterFunc(peerGoneGrace, func() { s.closeWithError(fmt.Errorf("%w (%w)", ErrPeerClosed, cause)) })
	}
	return s.sendable() // sendErr is set now
}

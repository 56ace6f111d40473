package shmipc

import (
	"errors"
	"fmt"
	"io"
	"os"
	"time"
	"unsafe"

	"github.com/goshm/shmipc/internal/wire"
	"golang.org/x/sys/unix"
)

// Reading the socket: handshake frames read exactly, running-phase frames
// through a receive buffer that grows with the bytes that arrive, and the
// raw non-blocking reads under both.

// readExact reads exactly n bytes straight from the socket, without reading
// ahead: the handshake must not consume what follows it.
func (c *eventConn) readExact(n int) ([]byte, error) {
	b := make([]byte, n)
	if _, err := io.ReadFull(c.conn, b); err != nil {
		return nil, err
	}
	return b, nil
}

// readHeader reads and checks one frame header during the handshake.
func (c *eventConn) readHeader() (wire.Header, error) {
	b, err := c.readExact(wire.HeaderSize)
	if err != nil {
		return nil, err
	}
	h := wire.Header(b)
	if err := h.Check(); err != nil {
		return nil, err
	}
	return h, nil
}

// frameLength returns the length a receiver consumes for a frame with header
// h. Fixed-size frames must say exactly their size; FallbackData and path
// messages may be up to limit bytes long.
func frameLength(h wire.Header, limit uint32) (int, error) {
	var want uint32
	switch h.Type() {
	case wire.TypePolling, wire.TypeExchangeProtoVersion, wire.TypeAckShareMemory, wire.TypeAckReadyRecvFD:
		want = wire.EmptyEventSize
	case wire.TypeStreamClose:
		want = wire.StreamCloseSize
	case wire.TypeHotRestart, wire.TypeHotRestartAck:
		want = wire.HotRestartSize
	case wire.TypeFallbackData:
		if l := h.Length(); l < wire.FallbackHeadSize || l > limit {
			return 0, fmt.Errorf("%w: %v frame of %d bytes is outside [%d, %d]", wire.ErrBadLength, h.Type(), l, wire.FallbackHeadSize, limit)
		}
		return int(h.Length()), nil
	default: // path messages
		if l := h.Length(); l < wire.HeaderSize+4 || l > wire.HeaderSize+wire.MaxPathPayloadLen {
			return 0, fmt.Errorf("%w: %v frame of %d bytes", wire.ErrBadLength, h.Type(), l)
		}
		return int(h.Length()), nil
	}
	if h.Length() != want {
		return 0, fmt.Errorf("%w: %v frame says %d bytes, must be %d", wire.ErrBadLength, h.Type(), h.Length(), want)
	}
	return int(want), nil
}

// readFrame returns the next frame, header checked and length validated
// against limit. The returned slice is valid until the next call. A frame
// whose first bytes have arrived must arrive whole within partial, or the
// read fails (errPartialFrame).
func (c *eventConn) readFrame(limit uint32, partial time.Duration) (wire.Header, []byte, error) {
	if err := c.fill(wire.HeaderSize, partial); err != nil {
		return nil, nil, err
	}
	h := wire.Header(c.rbuf[c.r : c.r+wire.HeaderSize])
	if err := h.Check(); err != nil {
		return nil, nil, err
	}
	n, err := frameLength(h, limit)
	if err != nil {
		return nil, nil, err
	}
	if err := c.fill(n, partial); err != nil {
		return nil, nil, err
	}
	f := c.rbuf[c.r : c.r+n]
	c.r += n
	return wire.Header(f[:wire.HeaderSize]), f[wire.HeaderSize:], nil
}

// interrupt makes the loop's wait for a frame to begin return
// errInterrupted (a frame begun is read whole first), or its next one.
func (c *eventConn) interrupt() { _ = c.conn.SetReadDeadline(time.Unix(1, 0)) }

// errInterrupted is readFrame's error when interrupt ended its wait.
var errInterrupted = errors.New("read interrupted")

// errPartialFrame is the error of a frame that did not arrive whole in time.
var errPartialFrame = errors.New("frame not completed in time")

// fill makes at least n unread bytes available in rbuf. The buffer grows
// as bytes arrive, at most doubling each time it is full, so that what a
// frame announces costs nothing until it is sent. Once some of the n bytes
// are unread, the rest must come within partial, and the end of the
// connection is io.ErrUnexpectedEOF.
func (c *eventConn) fill(n int, partial time.Duration) error {
	if c.w-c.r >= n {
		return nil
	}
	var deadline time.Time
	defer func() {
		if !deadline.IsZero() {
			_ = c.conn.SetReadDeadline(time.Time{})
		}
	}()
	for c.w-c.r < n {
		if c.w == len(c.rbuf) { // no room to read into
			c.makeRoom(n)
		}
		if c.w > c.r && deadline.IsZero() && partial > 0 {
			deadline = time.Now().Add(partial)
			if err := c.conn.SetReadDeadline(deadline); err != nil {
				return err
			}
		}
		m, err := c.readSome(c.rbuf[c.w:])
		c.w += m
		c.read += uint64(m)
		if err != nil {
			if c.w-c.r >= n {
				return nil
			}
			if isTimeout(err) && (deadline.IsZero() || time.Now().Before(deadline)) {
				// interrupt, not the frame's deadline: restore that, and
				// go on inside a frame.
				if err := c.conn.SetReadDeadline(deadline); err != nil {
					return err
				}
				if c.w == c.r {
					return errInterrupted
				}
				continue
			}
			if isTimeout(err) && !deadline.IsZero() {
				return fmt.Errorf("%w: %d of %d bytes arrived within %v", errPartialFrame, c.w-c.r, n, partial)
			}
			if errors.Is(err, io.EOF) && c.w > c.r {
				return fmt.Errorf("%w: connection closed inside a frame (%d of %d bytes arrived)", io.ErrUnexpectedEOF, c.w-c.r, n)
			}
			return err
		}
	}
	return nil
}

// makeRoom makes room to read more of a frame of n bytes that starts at
// c.r: it slides the unread bytes to the front, or grows the buffer to
// twice its size (readBufSize at first), but never beyond the frame.
func (c *eventConn) makeRoom(n int) {
	if c.r > 0 {
		copy(c.rbuf, c.rbuf[c.r:c.w])
		c.w -= c.r
		c.r = 0
		return
	}
	size := min(max(2*len(c.rbuf), readBufSize), max(n, readBufSize))
	nb := make([]byte, size)
	copy(nb, c.rbuf[c.r:c.w])
	c.rbuf = nb
}

// shrink drops a receive buffer grown for a large frame once it is drained,
// unless more bytes wait on the socket: a run of large frames reuses it.
func (c *eventConn) shrink() {
	if len(c.rbuf) > readBufSize && c.r == c.w {
		if n, err := c.inq(); err == nil && n > 0 {
			return
		}
		c.rbuf, c.r, c.w = nil, 0, 0
	}
}

// readSome reads what the socket holds into b, waiting (in the runtime's
// network poller, with the read deadline) until it holds something. It
// returns io.EOF once the peer has closed its end.
func (c *eventConn) readSome(b []byte) (int, error) {
	if c.raw == nil || len(b) == 0 {
		return c.conn.Read(b)
	}
	c.rb = b
	err := c.raw.Read(c.rfn)
	c.rb = nil
	if err != nil {
		return 0, err
	}
	if c.rn > 0 {
		raceAcquireIO()
	}
	return c.rn, c.rErr
}

// readOnce is readSome's callback: one non-blocking read(2). It reports
// false when the socket holds nothing, to wait for it to be readable.
func (c *eventConn) readOnce(fd uintptr) bool {
	for {
		n, _, e := unix.RawSyscall(unix.SYS_READ, fd, uintptr(unsafe.Pointer(unsafe.SliceData(c.rb))), uintptr(len(c.rb)))
		switch e {
		case 0:
			c.rn, c.rErr = int(n), nil
			if n == 0 {
				c.rErr = io.EOF
			}
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			return false
		default:
			c.rn, c.rErr = 0, os.NewSyscallError("read", e)
		}
		return true
	}
}

// inq returns how many received bytes the kernel holds for the connection
// (SIOCINQ). Connections that are not sockets report 0. Only the receive
// loop calls it; it allocates nothing after the first call.
func (c *eventConn) inq() (int, error) {
	if c.raw == nil {
		return 0, nil
	}
	if c.inqFn == nil {
		c.inqFn = func(fd uintptr) { c.inqN, c.inqErr = unix.IoctlGetInt(int(fd), unix.SIOCINQ) }
	}
	if err := c.raw.Control(c.inqFn); err != nil {
		return 0, err
	}
	if c.inqErr != nil {
		return 0, fmt.Errorf("SIOCINQ: %w", c.inqErr)
	}
	return c.inqN, nil
}

// receivedSoFar returns the position in the running phase's byte stream up
// to which the peer's writes have reached this side: what has been read
// into the receive buffer plus what the kernel holds now. Only the receive
// loop reads, and it calls this between reads, so the sum is exact. Over
// TCP it is not where the peer's writes have reached (tcp_order.go).
func (c *eventConn) receivedSoFar() (uint64, error) {
	n, err := c.inq()
	if err != nil {
		return 0, err
	}
	return c.read + uint64(n), nil
}

// framesWaiting reports whether frames have arrived that the receive loop
// has not handled: bytes read ahead into the buffer, or held by the kernel.
func (c *eventConn) framesWaiting() bool {
	if c.w > c.r {
		return true
	}
	n, err := c.inq()
	return n > 0 || err != nil
}

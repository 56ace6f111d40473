package shmipc

import (
	"os"

	"github.com/goshm/shmipc/internal/wire"
	"golang.org/x/sys/unix"
)

// Wake-ups (docs/protocol.md §7.5): a producer that sets the peer's working flag
// owes it a Polling frame. The frame must reach the peer, or the elements it
// announces wait for ever (no other producer sends one while the flag is
// set); it need not be in the socket when the producer's Write returns, only
// on its way. So no writer waits for a wake-up:
//
//   - when another frame holds the socket, its writer writes the wake-up
//     right after it (pollOwed, unlockW);
//   - when the socket is full, a goroutine of its own writes the rest of
//     the frame as room comes (finishPolling). The peer is not asleep then
//     for want of bytes: it has a socket buffer's worth to read first.

// writePolling sends a Polling frame, or leaves it to the writer of the
// frame being written (flushPolling): it goes out right after that one, as
// early as it could anyway, and answers every wake-up owed meanwhile.
func (c *eventConn) writePolling(version uint8) error {
	c.pollVersion.Store(uint32(version))
	c.pollOwed.Store(true)
	return c.flushPolling()
}

// flushPolling writes the owed Polling frame unless another goroutine holds
// wmu, which then writes it when it lets go (handoverMutex). An error is
// that of a write that failed at once.
func (c *eventConn) flushPolling() error {
	for c.pollOwed.Load() {
		if !c.wmu.tryLockOrLeave() {
			return nil
		}
		if !c.pollOwed.Swap(false) {
			c.wmu.Unlock()
			continue
		}
		c.wbuf = wire.AppendEvent(c.wbuf[:0], uint8(c.pollVersion.Load()), wire.TypePolling)
		n, err := c.tryWriteErr(c.wbuf)
		if err != nil {
			c.wmu.Unlock()
			return err
		}
		if n < len(c.wbuf) {
			go c.finishPolling(n) // it holds wmu until the frame is out
			return nil
		}
		c.wmu.Unlock()
	}
	return nil
}

// finishPolling writes the Polling frame in wbuf from byte n on, as the
// holder of wmu, waiting for room in the socket up to ConnectionWriteTimeout,
// then lets wmu go. An error goes to onAsyncErr, for the session to end.
func (c *eventConn) finishPolling(n int) {
	err := c.armDeadline()
	if err == nil {
		_, err = c.conn.Write(c.wbuf[n:])
		c.disarmDeadline()
	}
	c.unlockW()
	if err != nil && c.onAsyncErr != nil {
		c.onAsyncErr(err)
	}
}

// unlockW releases wmu and writes a Polling frame owed meanwhile. Its error
// is not the caller's: it goes to onAsyncErr.
func (c *eventConn) unlockW() {
	c.wmu.Unlock()
	if c.pollOwed.Load() {
		if err := c.flushPolling(); err != nil && c.onAsyncErr != nil {
			go c.onAsyncErr(err) // not under the caller's locks
		}
	}
}

// payPolling writes an owed Polling frame before the frame the caller,
// which holds wmu, is about to write: a frame written later must not
// overtake the wake-up for elements published before it (a StreamClose or
// FallbackData frame of the stream that published them).
func (c *eventConn) payPolling() error {
	if !c.pollOwed.Load() || !c.pollOwed.Swap(false) {
		return nil
	}
	c.wbuf = wire.AppendEvent(c.wbuf[:0], uint8(c.pollVersion.Load()), wire.TypePolling)
	return c.writeLocked(c.wbuf)
}

// tryWriteErr makes one non-blocking write(2) of b and returns how much of
// it went out: 0 when the socket is full, or has no file descriptor (a
// caller's net.Conn that is not a syscall.Conn); else an error.
func (c *eventConn) tryWriteErr(b []byte) (int, error) {
	if c.raw == nil {
		return 0, nil
	}
	c.wb = b
	err := c.raw.Write(c.wfn)
	c.wb = nil
	switch {
	case err != nil:
		return 0, err
	case c.wn >= 0:
		return c.wn, nil
	case c.wErr == unix.EAGAIN:
		return 0, nil
	}
	return 0, os.NewSyscallError("write", c.wErr)
}

package shmipc

import (
	"fmt"

	"golang.org/x/sys/unix"
)

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

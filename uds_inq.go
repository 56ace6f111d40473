package shmipc

import (
	"fmt"
	"syscall"

	"golang.org/x/sys/unix"
)

// receivedSoFar returns the position in the running phase's byte stream up
// to which the peer's writes have reached this side: what the receive loop
// has consumed, what it has read ahead, and what the kernel holds for it
// now (SIOCINQ). The receive loop calls it between reads, so the three add
// up exactly. Connections that are not sockets hold nothing in a kernel
// buffer we can see; for them it is what has been read.
func (c *eventConn) receivedSoFar() (uint64, error) {
	n := c.consumed + uint64(c.w-c.r)
	sc, ok := c.conn.(syscall.Conn)
	if !ok {
		return n, nil
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return 0, err
	}
	var inq int
	var ierr error
	if err := raw.Control(func(fd uintptr) { inq, ierr = unix.IoctlGetInt(int(fd), unix.SIOCINQ) }); err != nil {
		return 0, err
	}
	if ierr != nil {
		return 0, fmt.Errorf("SIOCINQ: %w", ierr)
	}
	return n + uint64(inq), nil
}

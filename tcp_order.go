package shmipc

import (
	"cmp"
	"errors"
	"fmt"
	"net"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// Close ordering over TCP loopback (closeAfterSocket). Over TCP, bytes of
// a write that has returned may still sit in the peer's send queue (this
// side's window is full) or on the loopback path, so "read so far +
// SIOCINQ" does not bound them. Instead the kernel is asked (sock_diag,
// tcp_diag.go) how many bytes the peer's application has written in all,
// tcpi_bytes_acked + idiag_wqueue, and the close applies once this side has
// acted on that many. This side's count is tcpi_bytes_received − SIOCINQ,
// the handshake included; eventConn.read is the running phase's part of it.
//
// Three details of the counts (checked by experiment on Linux 6.18, and in
// the kernel's sources):
//   - The connecting side's tcpi_bytes_acked counts its SYN; the accepting
//     side's does not. A sent FIN counts in write_seq, a received one in
//     tcpi_bytes_received. So the target is taken tcpCountSlack (2) bytes
//     low, 0 to 3 below the exact one: every frame is at least
//     wire.HeaderSize (8) bytes, so the same frame reaches both.
//   - idiag_wqueue is read without the socket lock tcp_info is read under:
//     an acknowledgement in between makes the sum too large, never too
//     small. Two consecutive answers that agree are exact; until then the
//     smallest sum is a safe target that may never be reached, looked at
//     again whenever the socket is drained (settleTCPClose).
//   - This side's two counts come from two calls, and are used only when
//     tcpi_bytes_received was the same before and after SIOCINQ.
//
// Without sock_diag (no NETLINK_SOCK_DIAG, the peer in another network
// namespace, behind a proxy, or on another host) closes follow the quiet
// rule, with a warning: a close applies once everything received when it
// was seen has been acted on and then no byte has arrived for tcpQuiet, at
// most tcpQuietRounds times over. With everything read, this side's window
// is open and the peer's kernel sends what it holds without the peer's
// process running; tcpQuiet bounds how late that may arrive. That bound is
// a choice, not a proof: hence the warning.

// Modes of a pending close.
const (
	closeExact = iota // at is the position the close follows
	closeUpper        // at may lie beyond it: settle when the socket is drained
	closeQuiet        // at is what had arrived: confirm the socket is quiet
)

const (
	tcpCountSlack  = 2 // a SYN and a FIN: see above
	tcpAgreeTries  = 8
	tcpSettleFor   = 10 * time.Millisecond
	tcpQuiet       = 20 * time.Millisecond
	tcpQuietRounds = 50
)

// tcpDiagOff, set by tests, makes every TCP session use the quiet rule.
var tcpDiagOff atomic.Bool

// tcpOrder is a TCP session's close-ordering state; receive loop only.
type tcpOrder struct {
	local, remote *net.TCPAddr
	diagErr       error // why sock_diag cannot be used, once known
}

// closeTarget returns the position in the running phase's byte stream the
// receive loop must have acted on before a close element seen now applies,
// and how that position is known.
func (s *Session) closeTarget() (uint64, uint8, error) {
	c := s.ec
	tc, ok := c.conn.(*net.TCPConn)
	if !ok || c.raw == nil {
		at, err := c.receivedSoFar()
		return at, closeExact, err
	}
	if c.tcp == nil {
		l, lok := tc.LocalAddr().(*net.TCPAddr)
		r, rok := tc.RemoteAddr().(*net.TCPAddr)
		c.tcp = &tcpOrder{local: l, remote: r}
		if !lok || !rok {
			c.tcp.diagErr = errors.New("connection without TCP addresses")
		}
	}
	at, exact, err := c.tcpTarget(^uint64(0))
	switch {
	case err == nil && exact:
		return at, closeExact, nil
	case err == nil:
		return at, closeUpper, nil
	}
	if c.tcp.diagErr == nil {
		c.tcp.diagErr = err
		s.conf.logger().Warn("shmipc: cannot see the peer's TCP socket; stream closes wait for the socket to be quiet",
			"role", s.role(), "remote", s.RemoteAddr(), "quiet", tcpQuiet, "err", err)
	}
	at, err = c.receivedSoFar()
	return at, closeQuiet, err
}

// tcpTarget asks the kernel how much the peer has written and returns it
// as a position in the running phase, at most upper; exact is false while
// the kernel's answers did not agree.
func (c *eventConn) tcpTarget(upper uint64) (at uint64, exact bool, err error) {
	o := c.tcp
	if o.diagErr != nil {
		return 0, false, o.diagErr
	}
	if tcpDiagOff.Load() {
		return 0, false, errors.New("sock_diag turned off")
	}
	total := ^uint64(0)
	var prev tcpWritten
	for i := 0; i < tcpAgreeTries && !exact; i++ {
		w, err := queryPeerSocket(o.local, o.remote)
		if err != nil {
			return 0, false, err
		}
		total = min(total, w.total())
		exact = i > 0 && w == prev
		prev = w
	}
	consumed, err := c.tcpConsumed()
	if err != nil {
		return 0, false, err
	}
	if consumed < c.read {
		return 0, false, fmt.Errorf("TCP_INFO: %d bytes received, fewer than the %d read", consumed, c.read)
	}
	// The peer's total less what this side consumed before the running phase.
	handshake := consumed - c.read
	if total < handshake+tcpCountSlack {
		return 0, exact, nil
	}
	return min(upper, total-handshake-tcpCountSlack), exact, nil
}

// tcpConsumed returns how many bytes this side has read from the socket.
func (c *eventConn) tcpConsumed() (uint64, error) {
	var n uint64
	var cerr error
	err := c.raw.Control(func(fd uintptr) {
		cerr = errors.New("bytes kept arriving while the counts were read")
		for i := 0; i < tcpAgreeTries; i++ {
			a, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO)
			if err != nil {
				cerr = fmt.Errorf("TCP_INFO: %w", err)
				return
			}
			q, err := unix.IoctlGetInt(int(fd), unix.SIOCINQ)
			if err != nil {
				cerr = fmt.Errorf("SIOCINQ: %w", err)
				return
			}
			b, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO)
			if err != nil {
				cerr = fmt.Errorf("TCP_INFO: %w", err)
				return
			}
			if a.Bytes_received == b.Bytes_received && a.Bytes_received >= uint64(q) {
				n, cerr = a.Bytes_received-uint64(q), nil
				return
			}
		}
	})
	return n, cmp.Or(err, cerr)
}

// settleTCPClose looks again at a first pending close whose target may lie
// beyond what the peer wrote, once the receive loop has read all the
// socket holds: asked again, the kernel's answers agree as soon as the
// peer's socket is still for a moment. If they do not within tcpSettleFor,
// the close follows the quiet rule.
func (s *Session) settleTCPClose() {
	if len(s.closing) == 0 || s.closing[0].mode != closeUpper {
		return
	}
	c, start := &s.closing[0], time.Now()
	for c.at > s.handled && !s.ec.framesWaiting() {
		at, exact, err := s.ec.tcpTarget(c.at)
		if err == nil && exact {
			c.at, c.mode = at, closeExact
			return
		}
		c.at = at
		if err != nil || time.Since(start) > tcpSettleFor {
			c.at, c.mode = s.handled, closeQuiet
			return
		}
	}
}

// quietAfter reports whether a close under the quiet rule applies now: no
// byte arrives for tcpQuiet. If some do, its target moves past them.
func (s *Session) quietAfter(c *pendingClose) bool {
	if c.rounds >= tcpQuietRounds {
		return true
	}
	c.rounds++
	var n int
	var perr error
	err := s.ec.raw.Control(func(fd uintptr) {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		for {
			n, perr = unix.Poll(fds, int(tcpQuiet/time.Millisecond))
			if perr != unix.EINTR {
				return
			}
		}
	})
	if err != nil || perr != nil || n == 0 {
		return true
	}
	at, err := s.ec.receivedSoFar()
	if err != nil || at <= s.handled {
		return true // readable, nothing to read: the end of the connection
	}
	c.at = at
	return false
}

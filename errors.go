package shmipc

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strings"

	"github.com/goshm/shmipc/internal/shm"
)

// Errors returned by this package. Returned errors wrap these sentinels with
// context, so compare them with errors.Is.
var (
	// ErrInvalidConfig is returned by Config.Verify and everything that
	// calls it for a configuration that cannot work.
	ErrInvalidConfig = errors.New("shmipc: invalid config")

	// ErrHandshake is returned by Client, Server and Dial when the handshake
	// fails: a malformed or unexpected message, or a region that cannot be
	// created or mapped.
	ErrHandshake = errors.New("shmipc: handshake failed")

	// ErrProtocol means the peer sent something the protocol forbids: a bad
	// frame, or a value in shared memory outside what it may be. The session
	// is closed and its error says what was wrong.
	ErrProtocol = shm.ErrProtocol

	// ErrSessionClosed is returned by the methods of a closed session and of
	// its streams. When the session ended for a reason other than Close, the
	// error also wraps that reason.
	ErrSessionClosed = errors.New("shmipc: session closed")

	// ErrPeerClosed is wrapped by the error of a session whose peer closed
	// the connection (or whose process ended). It deliberately does not
	// match io.EOF: a stream of a dead session has not ended cleanly.
	ErrPeerClosed = errors.New("peer closed the connection")

	// ErrStreamClosed is returned by the methods of a stream after its own
	// Close (and by a call that Close cut short). It matches net.ErrClosed
	// under errors.Is, as the error of a closed net.Conn does.
	ErrStreamClosed error = &closedError{"shmipc: stream closed"}

	// ErrStreamPeerClosed is returned by writes on a stream the peer has
	// closed while this side has not. It does not match ErrStreamClosed or
	// net.ErrClosed: the stream must still be closed here. Reads of such a
	// stream return what had arrived, then io.EOF.
	ErrStreamPeerClosed = errors.New("shmipc: stream closed by the peer")

	// ErrStreamIDsExhausted is returned (wrapped) by OpenStream on a session
	// that has opened every stream id (2 to 2^32-1, docs/protocol.md §9.1; ids
	// are never reused): open streams on a new session, as a SessionManager
	// does by itself.
	ErrStreamIDsExhausted = errors.New("shmipc: stream ids exhausted")

	// ErrQueueFull is wrapped by the timeout error of a Flush (or Write)
	// whose message found the peer's IO queue full until its write deadline
	// or Config.WriteSpaceTimeout; the message was not sent.
	ErrQueueFull = errors.New("shmipc: IO queue full")

	// ErrLimitExceeded is wrapped by the error of a session that ended, or
	// an operation that failed, because a bound was reached: MaxStreams,
	// MaxPendingAccepts, MaxFallbackBuffered, MaxFallbackBufferedPerStream
	// (see Config), or MaxReserve. The message names the bound.
	ErrLimitExceeded = errors.New("shmipc: limit exceeded")

	// ErrNotSupported is returned for operations the protocol does not allow
	// in this role, such as opening a stream on a server session.
	ErrNotSupported = errors.New("shmipc: not supported in this role")

	// ErrListenerClosed is returned by Accept after the listener was closed.
	// It matches net.ErrClosed under errors.Is, as the error of a closed
	// net.Listener does.
	ErrListenerClosed error = &closedError{"shmipc: listener closed"}

	// ErrTimeout is returned when a deadline or timeout passes. It satisfies
	// net.Error with Timeout() == true and matches os.ErrDeadlineExceeded
	// under errors.Is, as deadline errors from the net package do.
	ErrTimeout error = &timeoutError{}
)

// Errors of a SessionManager.
var (
	// ErrSessionManagerClosed is returned by GetStream after Close.
	ErrSessionManagerClosed = errors.New("shmipc: session manager closed")

	// ErrNoHealthySession is returned (wrapped, with the last dial error) by
	// GetStream when every session of the manager died and is re-dialed.
	ErrNoHealthySession = errors.New("shmipc: no healthy session")
)

// Errors of a hot restart.
var (
	// ErrHotRestartRunning is returned by HotRestart while a restart of the
	// listener is still running.
	ErrHotRestartRunning = errors.New("shmipc: a hot restart is already running")

	// ErrHotRestartHandshaking is returned by nothing: HotRestart tells a
	// session still handshaking when it is done. It stays for code that
	// checks it.
	ErrHotRestartHandshaking = errors.New("shmipc: a session is still handshaking")

	// ErrHotRestartTimeout is returned (wrapped) by WaitHotRestart when not
	// every session acknowledged within 2 s. The sessions stay up.
	ErrHotRestartTimeout = errors.New("shmipc: hot restart not acknowledged in time")

	// ErrNoHotRestart is returned by WaitHotRestart when HotRestart was not
	// called on the listener (or the listener has been closed since).
	ErrNoHotRestart = errors.New("shmipc: no hot restart started")
)

type timeoutError struct{}

func (*timeoutError) Error() string        { return "shmipc: i/o timeout" }
func (*timeoutError) Timeout() bool        { return true }
func (*timeoutError) Temporary() bool      { return true }
func (*timeoutError) Is(target error) bool { return target == os.ErrDeadlineExceeded }

// spaceTimeout is the error of a write that waited for room in vain: a
// timeout net.Error wrapping ErrTimeout and, for a full queue, ErrQueueFull.
type spaceTimeout struct {
	msg   string
	cause error // ErrQueueFull or nil
}

func (e *spaceTimeout) Error() string   { return e.msg }
func (e *spaceTimeout) Timeout() bool   { return true }
func (e *spaceTimeout) Temporary() bool { return true }
func (e *spaceTimeout) Unwrap() []error {
	if e.cause != nil {
		return []error{ErrTimeout, e.cause}
	}
	return []error{ErrTimeout}
}

// closedError is a sentinel that also matches net.ErrClosed.
type closedError struct{ msg string }

func (e *closedError) Error() string { return e.msg }

func (e *closedError) Unwrap() error { return net.ErrClosed }

// writeClosedErr is the error of a write on a stream whose writes are
// closed: by its Close, fail, the peer's close or the session's end.
func (st *Stream) writeClosedErr() error {
	st.mu.Lock()
	closed, failed, peer := st.closed, st.failErr, st.peerClosed
	st.mu.Unlock()
	switch {
	case closed:
		return ErrStreamClosed
	case failed != nil:
		return failed
	case peer:
		return ErrStreamPeerClosed
	}
	if err := st.s.sendable(); err != nil {
		return err
	}
	return ErrStreamClosed
}

// Every error of this package starts with errPrefix, and many wrap another
// of them, so joined naively the prefix would come back at each level:
// errorf's prefixedError says it once, at the start.
const errPrefix = "shmipc: "

type prefixedError struct{ err error }

func (e *prefixedError) Error() string { return oncePrefixed(e.err.Error()) }
func (e *prefixedError) Unwrap() error { return e.err }

// oncePrefixed drops the prefix of the errors that s quotes after its own.
func oncePrefixed(s string) string {
	s = strings.ReplaceAll(s, ": "+errPrefix, ": ")
	return strings.ReplaceAll(s, "("+errPrefix, "(")
}

// errorf is fmt.Errorf whose message says errPrefix once.
func errorf(format string, a ...any) error {
	return &prefixedError{fmt.Errorf(format, a...)}
}

// netError is the error of op (dial, listen) on network and address that
// failed with err: the prefix and err when err names them already (a
// *net.OpError or an *os.PathError), else all of them.
func netError(op, network, address string, err error) error {
	var oe *net.OpError
	var pe *os.PathError
	if errors.As(err, &oe) || errors.As(err, &pe) {
		return errorf(errPrefix+"%w", err)
	}
	return errorf(errPrefix+"%s %s %s: %w", op, network, address, err)
}

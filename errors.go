package shmipc

import (
	"errors"
	"os"
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
	ErrProtocol = errors.New("shmipc: protocol violation")

	// ErrSessionClosed is returned by the methods of a closed session and of
	// its streams. When the session ended for a reason other than Close, the
	// error also wraps that reason.
	ErrSessionClosed = errors.New("shmipc: session closed")

	// ErrStreamClosed is returned by the methods of a stream after its own
	// Close, and by writes after the peer closed the stream.
	ErrStreamClosed = errors.New("shmipc: stream closed")

	// ErrQueueFull is returned by Flush (and Write) when the peer did not
	// drain its IO queue within the retry period; the message was not sent.
	ErrQueueFull = errors.New("shmipc: IO queue full")

	// ErrNotSupported is returned for operations the protocol does not allow
	// in this role, such as opening a stream on a server session.
	ErrNotSupported = errors.New("shmipc: not supported in this role")

	// ErrListenerClosed is returned by Accept after the listener was closed.
	ErrListenerClosed = errors.New("shmipc: listener closed")

	// ErrTimeout is returned when a deadline or timeout passes. It satisfies
	// net.Error with Timeout() == true and matches os.ErrDeadlineExceeded
	// under errors.Is, as deadline errors from the net package do.
	ErrTimeout error = &timeoutError{}
)

type timeoutError struct{}

func (*timeoutError) Error() string        { return "shmipc: i/o timeout" }
func (*timeoutError) Timeout() bool        { return true }
func (*timeoutError) Temporary() bool      { return true }
func (*timeoutError) Is(target error) bool { return target == os.ErrDeadlineExceeded }

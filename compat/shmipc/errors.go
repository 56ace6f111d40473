package shmipc

import (
	"errors"
	"io"

	shm "github.com/goshm/shmipc"
)

// The errors of shmipc-go. Where this library has the same error, the
// variable is that error, so errors.Is matches it against either package's
// name. The methods of this package return these variables themselves, not
// wrapped, for the errors programs compare with ==: ErrEndOfStream,
// ErrStreamClosed, ErrSessionShutdown, ErrTimeout, ErrQueueFull,
// ErrSessionUnhealthy and ErrStreamsExhausted. Session.Err keeps the cause
// of a session's end.
var (
	// ErrInvalidVersion is not returned: a handshake with a peer of an
	// unknown version fails with the root package's ErrHandshake.
	ErrInvalidVersion = errors.New("shmipc: invalid protocol version")
	// ErrInvalidMsgType is not returned: a peer that sends an unknown
	// frame breaks the protocol, and its session ends (Session.Err).
	ErrInvalidMsgType = errors.New("shmipc: invalid message type")
	// ErrSessionShutdown is returned by the methods of a closed session,
	// of its streams and of a closed SessionManager.
	ErrSessionShutdown = shm.ErrSessionClosed
	// ErrStreamsExhausted is returned by OpenStream and GetStream while
	// Config's stream limit is reached.
	ErrStreamsExhausted = errors.New("shmipc: streams exhausted")
	// ErrTimeout is returned when a deadline or timeout passes; it is a
	// net.Error with Timeout() true.
	ErrTimeout = shm.ErrTimeout
	// ErrStreamClosed is returned by the methods of a stream after its
	// Close, and by writes after the peer closed it.
	ErrStreamClosed = shm.ErrStreamClosed
	// ErrConnectionWriteTimeout is not returned: a socket write that takes
	// longer than ConnectionWriteTimeout ends the session.
	ErrConnectionWriteTimeout = errors.New("shmipc: connection write timeout")
	// ErrEndOfStream is io.EOF: reads return it once the peer closed the
	// stream and every byte it sent has been read.
	ErrEndOfStream = io.EOF
	// ErrSessionUnhealthy is returned by GetStream while every session of
	// the manager is down and being re-dialed.
	ErrSessionUnhealthy = shm.ErrNoHealthySession
	// ErrNotEnoughData is not returned: reads wait for the bytes they ask
	// for (bounded by the read deadline) instead.
	ErrNotEnoughData = errors.New("shmipc: not enough data")
	// ErrNoMoreBuffer is not returned: see ErrNotEnoughData.
	ErrNoMoreBuffer = errors.New("shmipc: no more buffer")
	// ErrShareMemoryHadNotLeftSpace is not returned: a writer waits for
	// room in shared memory (bounded by its write deadline) instead.
	ErrShareMemoryHadNotLeftSpace = errors.New("shmipc: share memory had no space left")
	// ErrStreamCallbackHadExisted is returned by a second SetCallbacks.
	ErrStreamCallbackHadExisted = errors.New("shmipc: stream callbacks already set")
	// ErrOSNonSupported and ErrArchNonSupported are not returned: the
	// package builds only where it works.
	ErrOSNonSupported   = errors.New("shmipc: operating system not supported")
	ErrArchNonSupported = errors.New("shmipc: architecture not supported")
	// ErrHotRestartInProgress is returned by HotRestart while a restart of
	// the listener is running.
	ErrHotRestartInProgress = shm.ErrHotRestartRunning
	// ErrInHandshakeStage is returned by HotRestart while a session of the
	// listener is still handshaking.
	ErrInHandshakeStage = shm.ErrHotRestartHandshaking
	// ErrFileNameTooLong is wrapped by the error of VerifyConfig (and of
	// everything that verifies a Config) for a ShareMemoryPathPrefix too
	// long for region names.
	ErrFileNameTooLong = errors.New("shmipc: file name too long")
	// ErrQueueFull is returned by a write that found the peer's IO queue
	// full until its write deadline.
	ErrQueueFull = shm.ErrQueueFull
)

// compatErr turns an error of the root package into the shmipc-go variable
// programs compare it with, when there is one.
func compatErr(err error) error {
	switch {
	case err == nil || err == io.EOF:
		return err
	case errors.Is(err, shm.ErrSessionManagerClosed), errors.Is(err, shm.ErrSessionClosed):
		return ErrSessionShutdown
	case errors.Is(err, shm.ErrQueueFull):
		return ErrQueueFull
	case errors.Is(err, shm.ErrTimeout):
		return ErrTimeout
	case errors.Is(err, shm.ErrStreamClosed):
		return ErrStreamClosed
	case errors.Is(err, shm.ErrNoHealthySession):
		return ErrSessionUnhealthy
	}
	return err
}

// openErr is compatErr for the errors of opening a stream, where a limit
// reached is the stream limit.
func openErr(err error) error {
	if errors.Is(err, shm.ErrLimitExceeded) {
		return ErrStreamsExhausted
	}
	return compatErr(err)
}

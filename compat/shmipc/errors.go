package shmipc

import (
	"errors"
	"io"

	shm "github.com/goshm/shmipc"
)

// The errors of shmipc-go. Where the root package has the same error, the
// variable is that error, so errors.Is matches either package's name. The
// methods of this package return these variables themselves, not wrapped,
// for the errors programs compare with ==; Session.Err keeps the cause of
// a session's end.
var (
	// ErrEndOfStream is io.EOF: reads return it once the peer closed the
	// stream and every byte it sent has been read.
	ErrEndOfStream = io.EOF
	// ErrStreamClosed: the stream was closed (by the peer, for writes).
	ErrStreamClosed = shm.ErrStreamClosed
	// ErrSessionShutdown: the session, or the SessionManager, was closed.
	ErrSessionShutdown = shm.ErrSessionClosed
	// ErrTimeout: a deadline passed; it is a net.Error with Timeout() true.
	ErrTimeout = shm.ErrTimeout
	// ErrQueueFull: the peer's IO queue stayed full until the write
	// deadline.
	ErrQueueFull = shm.ErrQueueFull
	// ErrSessionUnhealthy: GetStream while every session of the manager is
	// down and being re-dialed.
	ErrSessionUnhealthy = shm.ErrNoHealthySession
	// ErrStreamsExhausted: OpenStream or GetStream at the stream limit.
	ErrStreamsExhausted = errors.New("shmipc: streams exhausted")
	// ErrStreamCallbackHadExisted: a second SetCallbacks.
	ErrStreamCallbackHadExisted = errors.New("shmipc: stream callbacks already set")
	// ErrHotRestartInProgress: HotRestart while a restart is running.
	ErrHotRestartInProgress = shm.ErrHotRestartRunning
	// ErrInHandshakeStage: HotRestart while a session is handshaking.
	ErrInHandshakeStage = shm.ErrHotRestartHandshaking
	// ErrFileNameTooLong is wrapped by the error of a Config whose
	// ShareMemoryPathPrefix is too long for region names.
	ErrFileNameTooLong = errors.New("shmipc: file name too long")
)

// Errors of shmipc-go that this package never returns. A handshake with
// an unknown version fails with the root package's ErrHandshake, a bad
// frame ends the session (Session.Err), a slow socket write ends the
// session, reads wait for the bytes they ask for, writers wait for room in
// shared memory, and the package builds only where it works.
var (
	ErrInvalidVersion             = errors.New("shmipc: invalid protocol version")
	ErrInvalidMsgType             = errors.New("shmipc: invalid message type")
	ErrConnectionWriteTimeout     = errors.New("shmipc: connection write timeout")
	ErrNotEnoughData              = errors.New("shmipc: not enough data")
	ErrNoMoreBuffer               = errors.New("shmipc: no more buffer")
	ErrShareMemoryHadNotLeftSpace = errors.New("shmipc: share memory had no space left")
	ErrOSNonSupported             = errors.New("shmipc: operating system not supported")
	ErrArchNonSupported           = errors.New("shmipc: architecture not supported")
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

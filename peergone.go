package shmipc

import (
	"errors"
	"fmt"
	"syscall"
	"time"
)

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

package shmipc

import (
	"sync/atomic"
)

// recvToken says who consumes a session's receive queue: who reads and
// moves its head, sets and clears the working flag, and hands the elements
// to their streams. Exactly one goroutine holds it at a time, or none. The
// socket is another matter: only the receive loop ever reads it.
//
// States, and who moves between them:
//
//	free   → loop     the receive loop, to act on a frame it read, waiting
//	                  for a polling reader to hand it over (takeLoop)
//	free   → reader   a reader whose stream is empty, when no other reader
//	                  waits (tryReader); it polls the queue itself (poll.go)
//	loop   → free     the loop, once the queue is empty, no close waits for
//	                  the socket and no fallback frame for room (giveBack)
//	reader → free     the polling reader, once it has what it waited for or
//	                  its spin ends (giveBack)
//	reader → handed   the polling reader, when the loop asked for the token
//	                  (wanted), or before what only the loop may handle: a
//	                  close element, which waits for the socket, or readers
//	                  still parked (handOver)
//	handed → loop     the loop takes up what was handed to it (takeHanded,
//	                  takeLoop)
//	any    → ended    the loop, at the session's end; from reader, once the
//	                  reader has let go. Nothing consumes after that, and the
//	                  regions may be unmapped.
//
// Letting go follows the working-flag protocol (docs/protocol.md §7.5):
// the holder clears the flag, then looks at the queue once more, and marks
// the token free only if that look finds it empty. The peer publishes and
// then looks at the flag (both sequentially consistent): so an element is
// either seen by that last look, or announced by a Polling frame, for which
// the loop waits for the token and consumes.
//
// Handing over to the loop while it sleeps on the socket interrupts its
// read (eventConn.interrupt); while it waits in takeLoop, the hand-over
// signals it. The working flag stays set across a hand-over: the loop
// consumes at once, so the peer needs to send no wake-up.
type recvToken struct {
	state  atomic.Int32
	wanted atomic.Bool   // the loop waits in takeLoop
	handed chan struct{} // signalled when the token is handed or freed while wanted
}

// The states of a recvToken.
const (
	tokenFree int32 = iota
	tokenLoop
	tokenReader
	tokenHanded
	tokenEnded
)

func (t *recvToken) init() { t.handed = make(chan struct{}, 1) }

// tryReader takes the free token for a polling reader.
func (t *recvToken) tryReader() bool {
	return t.state.Load() == tokenFree && t.state.CompareAndSwap(tokenFree, tokenReader)
}

// takeLoop takes the token for the loop, waiting for a polling reader to
// hand it over (it looks at wanted every round); with end, for good.
func (t *recvToken) takeLoop(end bool) {
	to := tokenLoop
	if end {
		to = tokenEnded
	}
	for t.state.Load() != tokenEnded {
		if t.state.CompareAndSwap(tokenFree, to) || t.state.CompareAndSwap(tokenHanded, to) ||
			(end && t.state.CompareAndSwap(tokenLoop, to)) {
			t.wanted.Store(false)
			return
		}
		t.wanted.Store(true)
		if t.state.Load() == tokenReader {
			<-t.handed
		}
	}
}

// giveBack marks the token free, and signals the loop if it waits for it.
func (t *recvToken) giveBack() { t.pass(tokenFree) }

// handOver passes a reader's token to the loop. It reports whether the
// loop waits for it (wanted) and has been signalled; otherwise the caller
// must interrupt the loop's read of the socket.
func (t *recvToken) handOver() bool { return t.pass(tokenHanded) }

// pass stores state, and signals the loop if it waits for the token.
func (t *recvToken) pass(state int32) bool {
	t.state.Store(state)
	if !t.wanted.Load() {
		return false
	}
	signalChan(t.handed)
	return true
}

// takeHanded takes up a token handed to the loop.
func (t *recvToken) takeHanded() bool { return t.state.CompareAndSwap(tokenHanded, tokenLoop) }

package shmipc

import (
	"errors"
	"fmt"
	"sync"
)

// Errors of push, which leaves the stream out of the queue (see push). The
// caller decides what becomes of a stream refused for errTooManyPending.
var (
	errAcceptClosed   = errors.New("shmipc: no longer accepting streams")
	errTooManyPending = errors.New("shmipc: too many streams not yet accepted")
)

// streamQueue holds the streams that peers opened and nobody has accepted
// yet: a Listener's queue (streams of all its sessions) or a session's own.
// Once closed it takes no more streams and closes those it held, so that
// none is left holding its session's regions with nobody to close it.
type streamQueue struct {
	mu      sync.Mutex
	items   []*Stream
	pending map[*Session]int // streams in items, by session
	notify  chan struct{}
	done    bool
}

func (q *streamQueue) init() {
	q.notify = make(chan struct{}, 1)
	q.pending = make(map[*Session]int)
}

// push queues st for pop. limit bounds the streams of st's session waiting
// in the queue (limit <= 0: no bound); when the session has that many, push
// returns an error wrapping errTooManyPending and does not queue st. After
// close, push closes st and returns an error wrapping errAcceptClosed.
func (q *streamQueue) push(st *Stream, limit int) error {
	q.mu.Lock()
	if q.done {
		q.mu.Unlock()
		st.Close()
		return fmt.Errorf("stream %d: %w", st.id, errAcceptClosed)
	}
	if n := q.pending[st.s]; limit > 0 && n >= limit {
		q.mu.Unlock()
		return fmt.Errorf("%w: the peer opened more than %d (stream %d)", errTooManyPending, limit, st.id)
	}
	q.items = append(q.items, st)
	q.pending[st.s]++
	q.mu.Unlock()
	signalChan(q.notify)
	return nil
}

// close makes pop fail once the queue is empty and push refuse streams;
// streams still queued are closed.
func (q *streamQueue) close() {
	q.mu.Lock()
	q.done = true
	items := q.items
	q.items = nil
	clear(q.pending)
	q.mu.Unlock()
	for _, st := range items {
		st.Close()
	}
	signalChan(q.notify)
}

// pop waits for a stream until closed is closed; errFn gives the error then.
func (q *streamQueue) pop(closed <-chan struct{}, errFn func() error) (*Stream, error) {
	for {
		q.mu.Lock()
		if len(q.items) > 0 {
			st := q.items[0]
			q.items[0] = nil
			q.items = q.items[1:]
			if q.pending[st.s]--; q.pending[st.s] == 0 {
				delete(q.pending, st.s)
			}
			more := len(q.items) > 0
			q.mu.Unlock()
			if more {
				signalChan(q.notify) // another pop may be waiting
			}
			return st, nil
		}
		done := q.done
		q.mu.Unlock()
		if done {
			return nil, errFn()
		}
		select {
		case <-q.notify:
		case <-closed:
			q.mu.Lock()
			empty := len(q.items) == 0
			q.mu.Unlock()
			if empty {
				return nil, errFn()
			}
		}
	}
}

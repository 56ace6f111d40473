package shmipc

import "sync"

// streamQueue is a queue of accepted streams.
type streamQueue struct {
	mu     sync.Mutex
	items  []*Stream
	notify chan struct{}
	done   bool
}

func (q *streamQueue) init() { q.notify = make(chan struct{}, 1) }

func (q *streamQueue) push(st *Stream) {
	q.mu.Lock()
	q.items = append(q.items, st)
	q.mu.Unlock()
	select {
	case q.notify <- struct{}{}:
	default:
	}
}

// close makes pop fail once the queue is empty; streams still queued are
// closed.
func (q *streamQueue) close() {
	q.mu.Lock()
	q.done = true
	items := q.items
	q.items = nil
	q.mu.Unlock()
	for _, st := range items {
		st.Close()
	}
	select {
	case q.notify <- struct{}{}:
	default:
	}
}

// pop waits for a stream until closed is closed; errFn gives the error then.
func (q *streamQueue) pop(closed <-chan struct{}, errFn func() error) (*Stream, error) {
	for {
		q.mu.Lock()
		if len(q.items) > 0 {
			st := q.items[0]
			q.items[0] = nil
			q.items = q.items[1:]
			more := len(q.items) > 0
			q.mu.Unlock()
			if more {
				select {
				case q.notify <- struct{}{}:
				default:
				}
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

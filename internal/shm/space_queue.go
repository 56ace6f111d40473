package shm

import (
	"slices"
	"sync"
	"sync/atomic"
)

// spaceQueue makes the writers of this process that hold no slice and find
// no room wait for it in turn. Retrying at intervals would hand the room to
// whoever looks first after a slice is freed, which favours the streams just
// served and starves the others. So there is one queue per class of slice
// asked for (Class): only its head looks for room, at short intervals
// (headSpacePause) and at once whenever this process frees a slice, and a
// writer that finds others queued joins the end. A writer that leaves the
// queue (it got its room, or gave up) passes the turn on if it was the head.
//
// Writers that hold slices do not queue: the room they take lets an exchange
// finish and free slices, and the list reserve (Alloc) keeps room for them.
type spaceQueue struct {
	mu      sync.Mutex
	waiters []chan struct{} // in arrival order; the first is the head
	n       atomic.Int32    // len(waiters), read without the lock
}

// SpaceQueues are a region's queues for this process: one per list, and
// one for writers that can use any list.
type SpaceQueues struct {
	qs      []spaceQueue
	waiting atomic.Int32 // writers in all the queues
}

func (sq *SpaceQueues) init(lists int) { sq.qs = make([]spaceQueue, lists) }

// Waiting reports whether writers wait in any queue.
func (sq *SpaceQueues) Waiting() bool { return sq.waiting.Load() > 0 }

// Waiters is the number of writers waiting in queue li.
func (sq *SpaceQueues) Waiters(li int) int { return int(sq.qs[li].n.Load()) }

// Join appends the writer whose wake-up channel is ch to queue li and
// reports whether it is the head.
func (sq *SpaceQueues) Join(li int, ch chan struct{}) bool {
	q := &sq.qs[li]
	q.mu.Lock()
	defer q.mu.Unlock()
	q.waiters = append(q.waiters, ch)
	q.n.Store(int32(len(q.waiters)))
	sq.waiting.Add(1)
	return len(q.waiters) == 1
}

// IsHead reports whether ch heads queue li.
func (sq *SpaceQueues) IsHead(li int, ch chan struct{}) bool {
	q := &sq.qs[li]
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.waiters) > 0 && q.waiters[0] == ch
}

// Leave takes ch out of queue li, and wakes the next writer if ch was the
// head (it got its room, or gave up).
func (sq *SpaceQueues) Leave(li int, ch chan struct{}) {
	q := &sq.qs[li]
	q.mu.Lock()
	defer q.mu.Unlock()
	i := slices.Index(q.waiters, ch)
	if i < 0 {
		return
	}
	q.waiters = slices.Delete(q.waiters, i, i+1)
	q.n.Store(int32(len(q.waiters)))
	sq.waiting.Add(-1)
	if i == 0 && len(q.waiters) > 0 {
		wakeWriter(q.waiters[0])
	}
}

// freed wakes the head of every queue: this process just freed a slice.
func (sq *SpaceQueues) freed() {
	if sq.waiting.Load() == 0 {
		return
	}
	for i := range sq.qs {
		q := &sq.qs[i]
		if q.n.Load() == 0 {
			continue
		}
		q.mu.Lock()
		if len(q.waiters) > 0 {
			wakeWriter(q.waiters[0])
		}
		q.mu.Unlock()
	}
}

// wakeWriter wakes the writer waiting on ch, if it is not awake already.
func wakeWriter(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

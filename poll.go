package shmipc

import (
	"runtime"
	"sync/atomic"
	"time"
)

// Receiving: who takes elements off the receive queue, and when the peer
// must wake us.
//
// Any goroutine may pop and dispatch elements while it holds the consumer
// token: the receive loop when a wake-up arrives, and readers waiting for
// data, which poll the queue themselves for a short while instead of
// sleeping and being handed their data by another goroutine. Popping and
// dispatching happen under the token, so elements are dispatched in queue
// order.
//
// The working flag tells the peer whether to send a wake-up after it
// publishes (PROTOCOL.md §5.5). Every goroutine that polls counts itself in
// pollers and keeps the flag set; the last one to stop clears the flag and
// then looks at the queue once more. Because the peer publishes and then
// looks at the flag, and the last poller clears the flag and then looks at
// the queue (both sequentially consistent), an element is either seen by
// that last look or announced by a wake-up. If the last look finds
// something, that poller takes up polling again.
type consumer struct {
	token   atomic.Bool
	pollers atomic.Int32
	budget  atomic.Int64 // how long to poll for, in ns; adapts
	max     int64        // ConsumerSpinTime in ns
	slept   atomic.Int64 // when the last poller stopped (UnixNano)
}

// pollCheckEvery is how many looks at the queue a poller makes between
// looks at the clock and at its exit conditions.
const pollCheckEvery = 8

func (c *consumer) init(max time.Duration) {
	c.max = int64(max)
	c.budget.Store(c.max)
}

// spinBudget is how long a poller may look for work now.
func (c *consumer) spinBudget() time.Duration { return time.Duration(c.budget.Load()) }

// hit records a poll that found what it waited for: keep polling in full.
func (c *consumer) hit() {
	if c.budget.Load() != c.max {
		c.budget.Store(c.max)
	}
}

// miss records a poll that ran out: poll half as long next time, and not
// at all once that is under a microsecond.
func (c *consumer) miss() {
	b := c.budget.Load() / 2
	if b < int64(time.Microsecond) {
		b = 0
	}
	c.budget.Store(b)
}

// woken records a wake-up from the peer. One that comes within the full
// budget of the last poller stopping would have been caught by polling, so
// polling is worth it again.
func (c *consumer) woken() {
	if c.budget.Load() < c.max && time.Now().UnixNano()-c.slept.Load() < c.max {
		c.budget.Store(c.max)
	}
}

// startPolling counts the caller as a poller and sets the working flag, so
// the peer stops sending wake-ups.
func (s *Session) startPolling() {
	s.cons.pollers.Add(1)
	s.recvQ.setWorking(true)
}

// stopPolling ends the caller's polling. The last poller clears the working
// flag and looks at the queue again; if something arrived in between it
// stays a poller and stopPolling reports false.
func (s *Session) stopPolling() bool {
	if s.cons.pollers.Add(-1) != 0 {
		return true
	}
	s.recvQ.setWorking(false)
	if s.recvQ.isEmpty() || s.IsClosed() { // a corrupt queue never looks empty
		s.cons.slept.Store(time.Now().UnixNano())
		return true
	}
	s.startPolling()
	return false
}

// drainAvailable pops and dispatches every element published so far and
// returns how many it dispatched. The caller holds the consumer token.
func (s *Session) drainAvailable() (int, error) {
	n := 0
	for {
		e, ok, err := s.recvQ.pop()
		if err != nil || !ok {
			return n, err
		}
		if err := s.handleElem(e); err != nil {
			return n, err
		}
		n++
	}
}

// tryDrain drains the queue if it has elements and nobody else is at it,
// and returns how many elements it dispatched.
func (s *Session) tryDrain() (int, error) {
	if s.recvQ.isEmpty() || !s.cons.token.CompareAndSwap(false, true) {
		return 0, nil
	}
	n, err := s.drainAvailable()
	s.cons.token.Store(false)
	return n, err
}

// drainNow waits for the consumer token and drains the queue. After it
// returns, every element published before the call has been dispatched.
func (s *Session) drainNow() error {
	for !s.cons.token.CompareAndSwap(false, true) {
		runtime.Gosched()
	}
	_, err := s.drainAvailable()
	s.cons.token.Store(false)
	return err
}

// poll is the receive loop's answer to a wake-up: drain, keep polling while
// no reader does, and stop by the protocol above.
func (s *Session) poll() error {
	s.cons.woken()
	s.startPolling()
	for {
		if err := s.drainNow(); err != nil {
			s.stopPolling()
			return err
		}
		if s.cons.pollers.Load() == 1 && s.spinUntil(nil) {
			continue
		}
		if s.stopPolling() {
			return nil
		}
	}
}

// spinUntil polls the queue for up to the spin budget, draining what
// arrives. It returns true when ready (if given) is signalled, or, with a
// nil ready, when the queue has an element; false when the budget runs out,
// the session ends, or draining fails (which closes the session). With a nil
// ready (the receive loop) it also stops when a reader starts polling, so
// that one goroutine per process spins, not two. The caller is a poller.
//
// It waits with cpuRelax and yields the processor only after handing data
// to other goroutines (the receive loop yields first, as it has just done
// so) and otherwise rarely: runtime.Gosched wakes another thread to look for
// work and lets the spinning goroutine move between threads, which on a
// small machine takes cores from the peer process.
func (s *Session) spinUntil(ready <-chan struct{}) bool {
	budget := s.cons.spinBudget()
	if budget <= 0 {
		return false
	}
	if ready == nil {
		runtime.Gosched()
	}
	start := time.Now()
	lastYield := start
	for {
		for range pollCheckEvery {
			if ready == nil {
				if !s.recvQ.isEmpty() {
					s.cons.hit()
					return true
				}
				if s.cons.pollers.Load() > 1 {
					return false // a reader polls: leave it to that one
				}
			} else {
				n, err := s.tryDrain()
				if err != nil {
					s.closeWithError(err)
					return false
				}
				select {
				case <-ready:
					s.cons.hit()
					return true
				default:
				}
				if n > 0 { // it was for other streams: let their readers run
					runtime.Gosched()
				}
			}
			cpuRelax()
		}
		if s.IsClosed() {
			return false
		}
		now := time.Now()
		if now.Sub(start) >= budget {
			s.cons.miss()
			return false
		}
		if now.Sub(lastYield) >= yieldEvery {
			runtime.Gosched()
			lastYield = now
		}
	}
}

// yieldEvery is how often a spinning goroutine lets others on its processor
// run.
const yieldEvery = 100 * time.Microsecond

// pollFor lets a reader poll the queue while it waits for ready, up to the
// spin budget. It reports whether ready was signalled.
//
// The reader holds references on both regions meanwhile, so a session that
// ends under it cannot unmap what it is looking at.
func (s *Session) pollFor(ready <-chan struct{}) bool {
	if s.cons.spinBudget() <= 0 || s.IsClosed() {
		return false
	}
	if !s.queueRegion.acquire() {
		return false
	}
	defer s.queueRegion.release()
	if !s.buf.region.acquire() {
		return false
	}
	defer s.buf.region.release()
	s.startPolling()
	got := s.spinUntil(ready)
	for !s.stopPolling() {
		if err := s.drainNow(); err != nil {
			s.closeWithError(err) // the next stopPolling sees the session closed
		}
	}
	if !got {
		select {
		case <-ready:
			got = true
		default:
		}
	}
	return got
}

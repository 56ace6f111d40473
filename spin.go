package shmipc

import (
	"runtime"
	"time"
)

// spinner decides how long a receive loop that has drained its queue keeps
// looking for more work before it clears its working flag and sleeps.
//
// The budget adapts: a spin that finds work keeps the full budget; a spin
// that runs out halves it, down to nothing; a wake-up that comes within the
// full budget of falling asleep (so spinning would have caught it) restores
// it. A session with steady traffic spins; an idle one stops spinning after
// one short burst; one whose requests come further apart than the budget
// stops spinning too.
type spinner struct {
	max    time.Duration
	budget time.Duration
	slept  time.Time // when the loop last went to sleep
}

// wait spins until q has an element (true), the budget runs out or done is
// closed (false). Between looks it yields the processor, so that goroutines
// it has just handed data to can run.
func (sp *spinner) wait(q *ioQueue, done <-chan struct{}) bool {
	if sp.budget <= 0 {
		return false
	}
	start := time.Now()
	for {
		for range 8 {
			if !q.isEmpty() {
				sp.budget = sp.max
				return true
			}
			runtime.Gosched()
		}
		select {
		case <-done:
			return false
		default:
		}
		if time.Since(start) >= sp.budget {
			sp.budget /= 2
			if sp.budget < time.Microsecond {
				sp.budget = 0
			}
			return false
		}
	}
}

// sleeping records that the loop goes to sleep on the socket.
func (sp *spinner) sleeping() { sp.slept = time.Now() }

// woken records a wake-up from the peer.
func (sp *spinner) woken() {
	if sp.budget < sp.max && !sp.slept.IsZero() && time.Since(sp.slept) < sp.max {
		sp.budget = sp.max
	}
}

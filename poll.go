package shmipc

import (
	"runtime"
	"sync/atomic"
	"time"
)

// Receiving: who takes elements off the receive queue, and when the peer
// must wake us.
//
// The receive loop is the session's only consumer. It alone pops elements,
// walks their chains in the peer-writable region and hands each stream its
// data, in queue order; readers never touch the queue, they wait for their
// stream to be signalled. One consumer makes harvesting fair by
// construction (every stream's data is handed over in the order it was
// published, whoever waits for it), keeps every access to the receive queue
// on one goroutine inside one fault-safe access (shmaccess.go), and means
// that once the receive loop has stopped nothing can reach a stream.
//
// The working flag tells the peer whether to send a wake-up after it
// publishes (PROTOCOL.md §5.5). A wake-up sets it (the peer's CAS); the
// receive loop drains, may keep looking for a while (spinning), then clears
// the flag and looks at the queue once more. Because the peer publishes and
// then looks at the flag, and the consumer clears the flag and then looks at
// the queue (both sequentially consistent), an element is either seen by
// that last look or announced by a wake-up.
//
// Spinning takes small-message latency far below a socket round trip, but
// only pays while a core is free for it and the peer is answering. So it is
// rationed:
//   - a wake-up that finds nothing is answered without spinning, so that
//     spurious wake-ups cost microseconds;
//   - each session adapts how long it spins to how often spinning found
//     something (consumer below);
//   - the whole process spins on at most spinSlots goroutines at once (half
//     the CPUs this process may use, none on a single CPU);
//   - a spinner that notices it was descheduled (the CPU is oversubscribed)
//     stops, and spinning is switched off process-wide for a cool-down that
//     doubles while the pressure lasts.
type consumer struct {
	budget int64 // how long to spin for, in ns; adapts; receive loop only
	max    int64 // ConsumerSpinTime in ns
	slept  int64 // when the receive loop last went to sleep (UnixNano)
}

// pollCheckEvery is how many looks at the queue a spinner makes between
// looks at the clock and at its exit conditions.
const pollCheckEvery = 8

// yieldEvery is how often a spinning receive loop lets other goroutines on
// its processor run.
const yieldEvery = 50 * time.Microsecond

func (c *consumer) init(max time.Duration) {
	c.max = int64(max)
	c.budget = c.max
}

// hit records a spin that found work: spin in full next time.
func (c *consumer) hit() { c.budget = c.max }

// miss records a spin that ran out: spin half as long next time, and not at
// all once that is under a microsecond.
func (c *consumer) miss() {
	c.budget /= 2
	if c.budget < int64(time.Microsecond) {
		c.budget = 0
	}
}

// woken records a wake-up that found work. One that comes within the full
// budget of the loop going to sleep would have been caught by spinning, so
// spinning is worth it again.
func (c *consumer) woken(now int64) {
	if c.budget < c.max && now-c.slept < c.max {
		c.budget = c.max
	}
}

// consume answers a wake-up: drain the queue, keep looking while that pays,
// and go back to sleep by the protocol above. It runs on the receive loop,
// inside a fault-safe access.
func (s *Session) consume() error {
	n, err := s.drain()
	if err != nil {
		return err
	}
	if n > 0 {
		s.cons.woken(time.Now().UnixNano())
	}
	for {
		if n > 0 {
			// Let the readers just served run before looking again.
			runtime.Gosched()
			switch s.spin() {
			case spinFound:
				if n, err = s.drain(); err != nil {
					return err
				}
				continue
			case spinFramesWaiting:
				// Frames wait on the socket (fallback data, closes): let the
				// receive loop read them, and come back here after the next
				// one. The working flag stays set meanwhile, so the peer
				// sends no wake-up and nothing published is missed.
				s.resume = true
				return nil
			}
		}
		s.recvQ.setWorking(false)
		if s.recvQ.isEmpty() || s.IsClosed() {
			s.cons.slept = time.Now().UnixNano()
			return nil
		}
		s.recvQ.setWorking(true)
		if n, err = s.drain(); err != nil {
			return err
		}
	}
}

// drain pops and dispatches every element published so far and returns how
// many it dispatched.
func (s *Session) drain() (int, error) {
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

// What a spin ended with.
const (
	spinGaveUp        = iota // nothing came within the budget, or no spinning now
	spinFound                // the queue has an element
	spinFramesWaiting        // frames arrived on the socket
)

// spin looks at the queue for up to the session's spin budget, if the
// process lets it spin now. It stops early when frames arrive on the socket,
// which the receive loop must not leave unread however busy the queue is.
func (s *Session) spin() int {
	if s.cons.budget <= 0 || !spinning.enter() {
		return spinGaveUp
	}
	defer spinning.exit()
	start := time.Now()
	last, lastYield := start, start
	for {
		for range pollCheckEvery {
			if !s.recvQ.isEmpty() {
				s.cons.hit()
				return spinFound
			}
			cpuRelax()
		}
		now := time.Now()
		if now.Sub(last) > preemptedGap {
			// Descheduled between two looks: the CPU has more work than
			// cores, and spinning only takes a core from someone.
			spinning.pressure(now)
			return spinGaveUp
		}
		last = now
		if now.Sub(start) >= time.Duration(s.cons.budget) {
			s.cons.miss()
			return spinGaveUp
		}
		if s.IsClosed() {
			return spinGaveUp
		}
		if now.Sub(lastYield) >= yieldEvery {
			if s.ec.framesWaiting() {
				return spinFramesWaiting
			}
			runtime.Gosched()
			last, lastYield = time.Now(), now
		}
	}
}

// preemptedGap is a pause between two looks of a spinner that only being
// descheduled explains: a look takes well under a microsecond.
const preemptedGap = 100 * time.Microsecond

// Cool-down after a spinner was descheduled: the first, and the longest.
const (
	minSpinCooldown = time.Millisecond
	maxSpinCooldown = 250 * time.Millisecond
)

// spinGovernor rations spinning for the whole process.
type spinGovernor struct {
	slots    int32        // how many goroutines may spin at once
	active   atomic.Int32 // how many do
	offUntil atomic.Int64 // no spinning before this time (UnixNano)
	cooldown atomic.Int64 // the next cool-down, in ns
	calm     atomic.Int64 // when the last pressure was seen (UnixNano)
}

var spinning = newSpinGovernor(runtime.NumCPU())

func newSpinGovernor(cpus int) *spinGovernor {
	g := &spinGovernor{slots: int32(cpus / 2)}
	g.cooldown.Store(int64(minSpinCooldown))
	return g
}

// enter takes a spinning slot if one is free and no cool-down is running.
func (g *spinGovernor) enter() bool {
	if g.slots <= 0 {
		return false
	}
	if until := g.offUntil.Load(); until != 0 && time.Now().UnixNano() < until {
		return false
	}
	if g.active.Add(1) > g.slots {
		g.active.Add(-1)
		return false
	}
	return true
}

func (g *spinGovernor) exit() { g.active.Add(-1) }

// pressure switches spinning off for a cool-down. Pressure soon after the
// last cool-down doubles the next one; a calm spell resets it.
func (g *spinGovernor) pressure(now time.Time) {
	t := now.UnixNano()
	d := g.cooldown.Load()
	if t-g.calm.Load() > 4*int64(maxSpinCooldown) {
		d = int64(minSpinCooldown)
	}
	g.offUntil.Store(t + d)
	g.cooldown.Store(min(2*d, int64(maxSpinCooldown)))
	g.calm.Store(t)
}

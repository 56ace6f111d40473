package shmipc

import (
	"math"
	"runtime"
	"sync/atomic"
	"time"
)

// Consuming the receive queue. The receive loop (recv.go) is the only
// goroutine that reads the socket or takes elements off the receive queue,
// so neither needs a lock, and teardown, which runs on the same goroutine,
// cannot race a delivery. Readers wait on their own stream only
// (Stream.awaitReadable).
//
// The working flag tells the peer whether to send a wake-up after it
// publishes (docs/protocol.md §7.5). The loop clears it
// before it sleeps on the socket, then looks at the queue once more: the
// peer publishes and then looks at the flag, the loop clears the flag and
// then looks at the queue (both sequentially consistent), so an element is
// either seen by that last look or announced by a wake-up.
//
// After a drain that found work the loop keeps looking at the queue for a
// while (spin): the next message of a request-reply exchange usually
// follows within microseconds, and then costs no system call on either
// side. Each session adapts its spin to how often it paid (consumer); the
// process rations spinning (spin.go, cpubudget.go).

// consumer is the receive loop's state for consuming; only the loop uses it.
type consumer struct {
	budget    int64       // how long to spin for, in ns; adapts
	max       int64       // ConsumerSpinTime in ns
	slept     int64       // when the loop last stopped consuming (UnixNano)
	consuming bool        // the loop holds the working flag set
	timer     *time.Timer // bounds awaitReader
}

// pollCheckEvery is how many looks at the queue a spinner makes between
// looks at the clock and at its exit conditions.
const pollCheckEvery = 8

// A spinning receive loop looks for frames on the socket every
// socketCheckEvery. It lets other goroutines on its processor run every
// yieldEvery, which is longer than a default spin: runtime.Gosched wakes
// another thread to look for work, and that thread takes a core from the
// peer the spinner waits for.
const (
	socketCheckEvery = 50 * time.Microsecond
	yieldEvery       = time.Millisecond
)

func (c *consumer) init(max time.Duration) {
	c.max = int64(max)
	c.budget = c.max
}

// hit records a spin that found what it waited for: spin in full next time.
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
func (c *consumer) woken() {
	if c.budget < c.max && time.Now().UnixNano()-c.slept < c.max {
		c.budget = c.max
	}
}

// consume answers a wake-up: drain, keep looking while that pays, and stop
// by the protocol above. It returns with the working flag still set
// (s.cons.consuming) when frames on the socket must be read first: a close
// waits for them (closeAfterSocket), or they arrived while the loop spun;
// the loop consumes again after the next frame. It runs inside an access.
func (s *Session) consume() error {
	if !s.cons.consuming {
		s.cons.consuming = true
		s.recvQ.setWorking(true)
	}
	first := true
	for {
		n, paused, err := s.drain(true, noDrainLimit)
		if err != nil || paused {
			return err
		}
		if first && n > 0 {
			s.cons.woken()
		}
		first = false
		if n > 0 && (s.waiting.Load() > 0 || s.awaitReader()) {
			switch s.spin() {
			case spinFound:
				continue
			case spinFramesWaiting:
				return nil
			}
		}
		s.recvQ.setWorking(false)
		if s.recvQ.isEmpty() || s.IsClosed() { // a corrupt queue never looks empty
			s.cons.consuming = false
			s.cons.slept = time.Now().UnixNano()
			return nil
		}
		s.recvQ.setWorking(true) // something came in between: go on
	}
}

// awaitReader parks the loop, its working flag still set, until a reader
// of the session begins to wait for data, or for up to the spin budget, and
// reports whether a reader waits. While every reader is busy with what it
// was handed, spinning would only take a core from them and from the peer:
// parked, the loop and the reader it serves take turns on one thread.
func (s *Session) awaitReader() bool {
	if s.cons.budget <= 0 {
		return false
	}
	// A token left by a reader whose wait the loop has since served
	// (it began waiting while the loop spun) says nothing of now.
	select {
	case <-s.readerWaits:
	default:
	}
	if s.waiting.Load() > 0 {
		return true
	}
	d := time.Duration(s.cons.budget)
	if s.cons.timer == nil {
		s.cons.timer = time.NewTimer(d)
	} else {
		s.cons.timer.Reset(d)
	}
	select {
	case <-s.readerWaits:
		s.cons.timer.Stop()
		return true
	case <-s.cons.timer.C:
		s.cons.miss()
		return false
	case <-s.closed:
		s.cons.timer.Stop()
		return false
	}
}

// noDrainLimit lets drain go on while elements come.
const noDrainLimit = math.MaxInt

// drain pops and dispatches the elements published so far, at most limit
// of them. With pause it stops (paused) while a close waits for the socket
// (closeAfterSocket), so that elements take effect in queue order.
func (s *Session) drain(pause bool, limit int) (n int, paused bool, err error) {
	if h := consumeHook.Load(); h != nil {
		(*h)(s)
	}
	for n < limit {
		if pause && len(s.closing) > 0 {
			return n, true, nil
		}
		if s.IsClosed() {
			// Nothing is delivered after the end, and a peer that keeps
			// the queue full must not keep the drain going.
			return n, false, nil
		}
		e, ok, err := s.recvQ.peek()
		if err != nil || !ok {
			return n, false, err
		}
		if s.stall != nil && e.id == s.stall.st.id {
			return n, true, nil // after the stream's waiting frame (serveStalled)
		}
		s.recvQ.skip()
		if err := s.handleElem(e); err != nil {
			return n, false, err
		}
		n++
	}
	return n, false, nil
}

// consumeHook, set by tests, is called by every drain and frame read.
var consumeHook atomic.Pointer[func(*Session)]

// drainBefore dispatches what the queue holds when it begins, closes
// included, without pausing behind a pending close (another stream's: a
// stream's own close is published after its last data). It runs before a
// frame that must not overtake what the peer published before sending it
// (handleFrame), and at the peer's end, so that a stream it wrote to and
// closed ends with all its data and io.EOF. Taking no more than the queue
// held keeps a peer that goes on publishing from holding up the loop.
func (s *Session) drainBefore() error {
	_, _, err := s.drain(false, int(min(s.recvQ.depth(), int64(s.recvQ.cap))))
	return err
}

// What a spin ended with.
const (
	spinGaveUp        = iota // nothing came within the budget, or no spinning now
	spinFound                // the queue has elements
	spinFramesWaiting        // frames arrived on the socket
)

// spin looks at the queue for up to the spin budget, if the process lets it
// spin now. It first lets the readers the drain just handed data run:
// they were made runnable on this processor, and another processor takes
// the loop. It stops when frames arrive on the socket, which must not be
// left unread however busy the queue is.
func (s *Session) spin() int {
	if s.cons.budget <= 0 || !spinning.enter() {
		return spinGaveUp
	}
	defer spinning.exit()
	runtime.Gosched()
	now := time.Now()
	w := spinWatch{begin: now, last: now, lastYield: now, lastSocket: now, alone: procs.get(now) == 1}
	for {
		for range pollCheckEvery {
			if !s.recvQ.looksEmpty() {
				s.cons.hit()
				return spinFound
			}
			cpuRelax()
		}
		switch w.check(s) {
		case spinGaveUp:
			return spinGaveUp
		case spinFramesWaiting:
			if s.ec.framesWaiting() {
				return spinFramesWaiting
			}
		}
	}
}

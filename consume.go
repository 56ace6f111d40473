package shmipc

import (
	"math"
	"runtime"
	"sync/atomic"
	"time"
)

// Consuming the receive queue. One goroutine per session, its receive loop
// (recv.go), reads the socket and takes elements off the receive queue; it
// walks each message's chain in the peer-writable region and hands every
// stream its data, in queue order. Readers wait on their own stream only
// (Stream.awaitReadable): nothing else ever touches the socket's read side
// or the queue's consumer side, so neither needs a lock or a token, and
// teardown, which runs on the same goroutine once it stops reading, cannot
// race a delivery.
//
// The working flag tells the peer whether to send a wake-up after it
// publishes (PROTOCOL.md §5.5, in docs/protocol.md). The loop sets it while
// it consumes and clears it before it sleeps on the socket, then looks at
// the queue once more. Because the peer publishes and then looks at the
// flag, and the loop clears the flag and then looks at the queue (both
// sequentially consistent), an element is either seen by that last look or
// announced by a wake-up.
//
// After a drain that found work the loop keeps looking at the queue for a
// while (spin), since the next message of a request-reply exchange usually
// follows within microseconds: then the peer sends no wake-up at all, and
// the message costs no system call on either side. Spinning only pays
// while a core is free for it and the peer is answering, so it is
// rationed:
//   - a wake-up that finds nothing is answered without spinning, so that
//     spurious wake-ups cost microseconds;
//   - each session adapts how long it spins to how often spinning found
//     something (consumer below);
//   - the whole process spins on at most half the CPUs it may use at once
//     (none on a single CPU), leaving the other half to the peer process;
//   - a spinner that notices it was descheduled for long (the CPU is
//     oversubscribed) stops, and spinning is switched off process-wide for
//     a cool-down that doubles while the pressure lasts
//     (spinGovernor.pressure).

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
// of the session begins to wait for data, or for up to the spin budget.
// While every reader is busy with what it was handed, spinning would only
// take a core from them and from the peer: in a request-reply exchange the
// loop and the reader it serves then take turns on one thread, the reader
// waking the loop as it begins to wait for its reply, instead of each
// holding a core of a machine the peer process needs too. It reports
// whether a reader waits.
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

// consumeHook, when set (by tests), is called by every drain and every
// frame read with the session: the receive side's single owner is the only
// caller.
var consumeHook atomic.Pointer[func(*Session)]

// drainAtEnd dispatches what the peer published on the queue before it
// closed its end of the connection, closes included: a stream it wrote to
// and closed before it ended the session ends with all its data and
// io.EOF, not with the session's error. It takes at most what the queue
// held when it began, so that a peer that goes on publishing after its end
// cannot keep the receive loop from ending.
func (s *Session) drainAtEnd() error {
	_, _, err := s.drain(false, int(min(s.recvQ.depth(), int64(s.recvQ.cap))))
	return err
}

// drainBefore drains what the queue holds, closes included, without
// pausing behind a pending close: a FallbackData or StreamClose frame must
// not overtake what the peer published before sending it on the same
// stream, and the pending close belongs to another stream (a stream's own
// close is published after its last data is sent). What the peer published
// before sending the frame is on the queue once the frame has been read, so
// the drain takes what the queue holds when it begins and no more: a peer
// that goes on publishing cannot keep the socket from being read.
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
	var w spinWatch
	w.start()
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

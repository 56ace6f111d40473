package shmipc

import (
	"math"
	"runtime"
	"runtime/metrics"
	"sync/atomic"
	"time"

	"github.com/goshm/shmipc/internal/shm"
)

// Consuming the receive queue: only the receive token's holder moves the
// queue's head and the working flag (recvtoken.go). After a drain that
// found work the loop spins while readers it serves are parked, or waits
// for them with several streams active (awaitReader); otherwise it lets go
// at once, so that the next reader to wait polls for itself. Spinning
// adapts per session (consumer) and is rationed per process (spin.go).

// consumer is the consuming state of a session; only the token's holder
// uses it, except held and consuming, which are the loop's.
type consumer struct {
	budget    int64            // how long to spin for, in ns; adapts
	max       int64            // ConsumerSpinTime in ns
	slept     int64            // when the last holder stopped consuming (UnixNano)
	held      bool             // the loop holds the token
	consuming bool             // the loop holds the token and the working flag set
	last      uint32           // the stream the holder last handed data to
	multi     bool             // the loop's consume has handed data to several streams
	timer     *time.Timer      // bounds awaitReader
	runnable  []metrics.Sample // for spinWatch.othersWait, made once
	cpuShared bool             // the holder's last OS yield ran another thread
}

// pollCheckEvery is how many looks at the queue a spinner makes between
// looks at the clock and at its exit conditions.
const pollCheckEvery = 8

// A spinning receive loop looks for frames on the socket every
// socketCheckEvery. It lets other goroutines on its processor run every
// yieldEvery, which is longer than a default spin (runtime.Gosched wakes
// another thread to look for work, and that thread takes a core from the
// peer the spinner waits for), or sooner if goroutines wait (othersWait).
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
// budget of the last holder's stop would have been caught by spinning, so
// spinning is worth it again.
func (c *consumer) woken() {
	if c.budget < c.max && time.Now().UnixNano()-c.slept < c.max {
		c.budget = c.max
	}
}

// loopTake takes the token for the loop, to act on a frame.
func (s *Session) loopTake() {
	if !s.cons.held {
		s.tok.takeLoop(false)
		s.cons.held = true
	}
}

// loopRelease gives the loop's token back by the protocol once it may: it
// is not consuming, no close waits for the socket, no frame for room.
func (s *Session) loopRelease() error {
	if !s.cons.held || s.cons.consuming || len(s.closing) > 0 || s.stall != nil {
		return nil
	}
	if !s.clearWorking() {
		return s.consume()
	}
	s.cons.held = false
	s.tok.giveBack()
	return nil
}

// clearWorking clears the working flag and looks once more (recvtoken.go):
// true if the queue is empty or the session ended, else the flag is set.
func (s *Session) clearWorking() bool {
	s.recvQ.SetWorking(false)
	if s.recvQ.IsEmpty() || s.IsClosed() { // a corrupt queue never looks empty
		return true
	}
	s.recvQ.SetWorking(true)
	return false
}

// takeHanded takes up a token a polling reader handed to the loop.
func (s *Session) takeHanded() error {
	if s.cons.held || !s.tok.takeHanded() {
		return nil
	}
	s.cons.held = true
	return s.consume()
}

// consume drains, keeps looking while that pays, and stops by the protocol
// above; the loop holds the token, inside an access. It returns with the
// working flag still set (s.cons.consuming) when frames on the socket must
// be read first: a close waits for them (closeAfterSocket), or they arrived
// while the loop spun; the loop consumes again after the next frame.
func (s *Session) consume() error {
	if !s.cons.consuming {
		s.cons.consuming = true
		s.recvQ.SetWorking(true)
	}
	first := true
	s.cons.multi = false
	for {
		n, paused, err := s.drain(drainInOrder, noDrainLimit)
		if err != nil || paused {
			return err
		}
		if first && n > 0 {
			s.cons.woken()
		}
		first = false
		if n > 0 && (s.waiting.Load() > 0 || (s.cons.multi && s.awaitReader())) {
			switch s.spin() {
			case spinFound:
				continue
			case spinFramesWaiting:
				return nil
			}
		}
		if !s.clearWorking() {
			continue // something came in between
		}
		s.cons.consuming = false
		s.cons.slept = time.Now().UnixNano()
		if len(s.closing) == 0 && s.stall == nil {
			s.cons.held = false
			s.tok.giveBack()
		}
		return nil
	}
}

// awaitReader parks the loop, holding the token and the working flag,
// until a reader begins to wait or for up to the spin budget, and reports
// whether one waits: the readers of several active streams come back one
// after another, and are served without wake-ups.
func (s *Session) awaitReader() bool {
	if s.cons.budget <= 0 {
		return false
	}
	select { // a signal of a wait the loop has served since
	case <-s.readerWaits:
	default:
	}
	if s.waiting.Load() > 0 {
		return true
	}
	if s.cons.timer == nil {
		s.cons.timer = time.NewTimer(time.Duration(s.cons.budget))
	} else {
		s.cons.timer.Reset(time.Duration(s.cons.budget))
	}
	defer s.cons.timer.Stop()
	select {
	case <-s.readerWaits:
		return true
	case <-s.cons.timer.C:
		s.cons.miss()
	case <-s.closed:
	}
	return false
}

// noDrainLimit lets drain go on while elements come.
const noDrainLimit = math.MaxInt

// How a drain treats close elements.
const (
	drainInOrder = iota // pause while a close waits for the socket (closeAfterSocket)
	drainAll            // take closes too, without pausing behind them
	drainReader         // stop before a close: a polling reader (poll.go)
)

// drain pops and dispatches the elements published so far, at most limit of
// them; the caller holds the token. It reports stopped when it stopped
// before an element, as mode says, or before one of the stream whose frame
// waits for room (serveStalled).
func (s *Session) drain(mode, limit int) (n int, stopped bool, err error) {
	if h := consumeHook.Load(); h != nil {
		(*h)(s, false)
	}
	for n < limit {
		if mode == drainInOrder && len(s.closing) > 0 {
			return n, true, nil
		}
		if s.IsClosed() {
			// Nothing is delivered after the end, and a peer that keeps
			// the queue full must not keep the drain going.
			return n, false, nil
		}
		e, ok, err := s.recvQ.Peek()
		if err != nil || !ok {
			return n, false, err
		}
		if s.stall != nil && e.ID == s.stall.st.id {
			return n, true, nil // after the stream's waiting frame (serveStalled)
		}
		if mode == drainReader && e.Status&shm.StatusMask == shm.StatusClosed {
			return n, true, nil
		}
		s.recvQ.Skip()
		if err := s.handleElem(e); err != nil {
			return n, false, err
		}
		n++
	}
	return n, false, nil
}

// consumeHook, set by tests, is called by every drain (socket false) and
// frame read (socket true).
var consumeHook atomic.Pointer[func(s *Session, socket bool)]

// drainBefore dispatches what the queue holds when it begins, closes
// included, without pausing behind a pending close (another stream's: a
// stream's own close is published after its last data). It runs before a
// frame that must not overtake what the peer published before sending it
// (handleFrame), and at the peer's end, so that a stream it wrote to and
// closed ends with all its data and io.EOF. Taking no more than the queue
// held keeps a peer that goes on publishing from holding up the loop.
func (s *Session) drainBefore() error {
	_, _, err := s.drain(drainAll, int(min(s.recvQ.Depth(), int64(s.recvQ.Cap()))))
	return err
}

// What a spin ended with.
const (
	spinGaveUp        = iota // nothing came within the budget, or no spinning now
	spinFound                // the queue has elements
	spinFramesWaiting        // frames arrived on the socket
)

// spin looks at the queue for up to the spin budget while readers are
// parked, if the process lets it spin now. It first lets the readers the
// drain just handed data run: they were made runnable on this processor,
// and another processor takes the loop. It stops when frames arrive on the
// socket, which must not be left unread however busy the queue is.
func (s *Session) spin() int {
	if s.cons.budget <= 0 || !spinning.enter() {
		return spinGaveUp
	}
	defer spinning.exit()
	runtime.Gosched()
	now := time.Now()
	w := spinWatch{begin: now, last: now, lastYield: now, lastSocket: now, lastLook: now, alone: procs.get(now) == 1}
	for {
		for range pollCheckEvery {
			if !s.recvQ.LooksEmpty() {
				s.cons.hit()
				return spinFound
			}
			shm.CPURelax()
		}
		if !s.cons.multi && s.waiting.Load() == 0 {
			return spinGaveUp // the next reader to wait polls for itself
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

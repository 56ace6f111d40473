package shmipc

import (
	"math"
	"runtime"
	"sync/atomic"
	"time"
)

// Receiving: who takes elements off the receive queue, and when the peer
// must wake us.
//
// One goroutine at a time drains the queue: whoever holds the consumer
// token. It pops every element published so far, walks each message's chain
// in the peer-writable region and hands every stream its data, in queue
// order, so that harvesting is fair by construction: a stream's data is
// handed over in the order it was published, whoever happens to drain.
//
// The receive loop drains when a wake-up arrives. A reader waiting for data
// may also drain, by polling the queue itself for a short while instead of
// sleeping and being handed its data by the receive loop: when its own data
// arrives it is on the CPU already, which saves two goroutine hand-offs per
// round trip. A polling reader never applies a close: when the next element
// is a close it stops and kicks the receive loop (kick), which alone applies
// closes, in order with the socket (Session.closeAfterSocket). Teardown
// takes the token for good, so nothing is delivered after it begins.
//
// The working flag tells the peer whether to send a wake-up after it
// publishes (PROTOCOL.md §5.5). Every goroutine that polls counts itself in
// pollers and keeps the flag set; the last one to stop clears the flag and
// then looks at the queue once more. Because the peer publishes and then
// looks at the flag, and the last poller clears the flag and then looks at
// the queue (both sequentially consistent), an element is either seen by
// that last look or announced by a wake-up. If that look finds something,
// the receive loop polls again; a reader instead kicks the receive loop.
//
// Spinning takes small-message latency far below a socket round trip, but
// only pays while a core is free for it and the peer is answering. So it is
// rationed:
//   - a wake-up that finds nothing is answered without spinning, so that
//     spurious wake-ups cost microseconds;
//   - each session adapts how long it spins to how often spinning found
//     something (consumer below);
//   - the readers of a session take turns at polling (Stream.pollTurn);
//   - the whole process spins on at most half the CPUs it may use at once
//     (none on a single CPU), whether receive loops or readers, leaving the
//     other half to the peer process's spinner; a session whose peer is this
//     very process (both ends in one program) may take every CPU, since its
//     peer's spinner is counted here too; a reader that wants to poll
//     takes over the slot of its session's spinning receive loop, so that
//     it serves itself rather than being handed its data;
//   - a spinner that notices it was descheduled for long (the CPU is
//     oversubscribed) stops, and spinning is switched off process-wide for a
//     cool-down that doubles while the pressure lasts (spinGovernor.pressure);
//   - a reader is woken to poll for a reply (Stream.sent) only when it could
//     poll now.
//
// budget and max, read by every writer (mayPoll) and written only when a
// spin ends otherwise than the last one, are kept off the line of the
// fields every drain writes.
type consumer struct {
	budget atomic.Int64 // how long to spin for, in ns; adapts
	max    int64        // ConsumerSpinTime in ns
	_      cacheLinePad

	token   atomic.Bool  // held by the goroutine draining the queue
	pollers atomic.Int32 // goroutines keeping the working flag set
	slept   atomic.Int64 // when the last poller stopped (UnixNano)
	kicked  atomic.Bool  // the receive loop was asked to drain (kick) and has not yet
	// loopSpins: the receive loop holds a spinning slot (spin); a reader
	// that wants to poll may take it over (takeLoopSlot).
	loopSpins atomic.Bool
}

// pollCheckEvery is how many looks at the queue a spinner makes between
// looks at the clock and at its exit conditions.
const pollCheckEvery = 8

// A spinning receive loop looks for frames on the socket every
// socketCheckEvery. A spinner lets other goroutines on its processor run
// every yieldEvery, which is longer than a default spin: runtime.Gosched
// wakes another thread to look for work, and that thread takes a core from
// the peer the spinner waits for.
const (
	socketCheckEvery = 50 * time.Microsecond
	yieldEvery       = time.Millisecond
)

func (c *consumer) init(max time.Duration) {
	c.max = int64(max)
	c.budget.Store(c.max)
}

// hit records a spin that found what it waited for: spin in full next time.
func (c *consumer) hit() {
	if c.budget.Load() != c.max {
		c.budget.Store(c.max)
	}
}

// miss records a spin that ran out: spin half as long next time, and not at
// all once that is under a microsecond.
func (c *consumer) miss() {
	b := c.budget.Load() / 2
	if b < int64(time.Microsecond) {
		b = 0
	}
	c.budget.Store(b)
}

// woken records a wake-up that found work. One that comes within the full
// budget of the last poller stopping would have been caught by spinning, so
// spinning is worth it again.
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
// flag and looks at the queue again; it reports false when something
// arrived in between, and the caller is then still a poller.
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

// consumeNow is consume for a receive loop that may be resuming.
func (s *Session) consumeNow() error {
	resume := s.resume
	s.resume = false
	return s.consume(resume)
}

// consume answers a wake-up on the receive loop: drain, keep polling while
// that pays and no reader polls, and stop by the protocol above. With
// resume, the receive loop comes back from reading frames that arrived
// while it spun, and is still a poller.
func (s *Session) consume(resume bool) error {
	// held: the loop counts as a poller. Every return settles the count;
	// a memory fault unwinding from here (to the caller's access, which
	// ends the session), even from startPolling's write of the working
	// flag, gives it back too, so that the count does not stay up after
	// the session.
	held := true
	defer func() {
		if held {
			s.cons.pollers.Add(-1)
		}
	}()
	if !resume {
		s.startPolling()
	}
	stop := func() bool {
		held = false // stopPolling uncounts first
		if s.stopPolling() {
			return true
		}
		held = true // something arrived: a poller again
		return false
	}
	first := true
	for {
		n, paused, err := s.drainAll()
		if err != nil {
			stop()
			return err
		}
		if paused {
			// A close waits for frames on the socket: read them, then come
			// back here, still a poller (as for spinFramesWaiting).
			s.resume = true
			held = false
			return nil
		}
		if first && n > 0 {
			s.cons.woken()
		}
		first = false
		// A reader that wanted the socket was just handed data (mayLend):
		// go back and lend it now, before that reader runs. Spinning did
		// not pay when it asked (lead), and a reader let run first (with
		// one processor, the Gosched below runs it at once) comes back for
		// its next message while the loop still holds the socket, and
		// sleeps on a request nothing will answer by a lend.
		if n > 0 && s.cons.pollers.Load() == 1 && !s.leading && !s.mayLend() && s.localPeerSession.Load() == nil {
			// Let the readers just served run before looking again.
			runtime.Gosched()
			switch s.spin() {
			case spinFound:
				continue
			case spinFramesWaiting:
				// Frames wait on the socket (fallback data, closes): let the
				// receive loop read them and come back here after the next
				// one, still a poller, so that the peer sends no wake-up
				// and nothing published is missed.
				s.resume = true
				held = false
				return nil
			}
		}
		if stop() {
			return nil
		}
	}
}

// drainAll waits for the token and drains everything, closes included: it
// is the receive loop's drain. After it returns, every element published
// before the call has been dispatched, unless paused: a close waits for the
// socket to catch up (Session.closeAfterSocket), and what follows it waits
// too.
func (s *Session) drainAll() (n int, paused bool, err error) {
	s.takeToken()
	defer s.cons.token.Store(false) // deferred: also after a fault
	return s.drainHeld(true, true, noDrainLimit)
}

// drainAtEnd dispatches what the peer published on the queue before it
// closed its end of the connection, closes included: a stream it wrote to
// and closed before it ended the session ends with all its data and
// io.EOF, not with the session's error. Without it the end of the socket
// could overtake a close that a polling reader of ours had seen and left
// to this loop (only the receive loop applies closes). It takes at most
// what the queue held when it began, so that a peer that goes on
// publishing after its end cannot keep the receive loop from ending.
func (s *Session) drainAtEnd() error {
	s.takeToken()
	defer s.cons.token.Store(false) // deferred: also after a fault
	_, _, err := s.drainHeld(true, false, int(min(s.recvQ.depth(), int64(s.recvQ.cap))))
	return err
}

// drainBefore drains everything, closes included, without pausing behind a
// pending close: a FallbackData or StreamClose frame must not overtake what
// the peer published before sending it on the same stream, and the pending
// close belongs to another stream (a stream's own close is published after
// its last data is sent).
func (s *Session) drainBefore() error {
	s.takeToken()
	defer s.cons.token.Store(false) // deferred: also after a fault
	_, _, err := s.drainHeld(true, false, noDrainLimit)
	return err
}

// takeToken waits for the consumer token and takes it.
func (s *Session) takeToken() {
	for !s.cons.token.CompareAndSwap(false, true) {
		runtime.Gosched()
	}
}

// noDrainLimit lets drainHeld go on while elements come.
const noDrainLimit = math.MaxInt

// drainHeld pops and dispatches the elements published so far, at most
// limit of them; the caller holds the token. With pause, it stops
// (stopped) while a close is pending, so that elements take effect in
// queue order. A reader (closes false) also stops before a close element:
// only the receive loop applies closes.
func (s *Session) drainHeld(closes, pause bool, limit int) (n int, stopped bool, err error) {
	for n < limit {
		if pause && s.closesPending.Load() {
			return n, true, nil
		}
		if s.IsClosed() {
			// Nothing is delivered after the end, and a peer that keeps
			// the queue full must not keep the drain, which teardown
			// waits for, going.
			return n, false, nil
		}
		e, ok, err := s.recvQ.peek()
		if err != nil || !ok {
			return n, false, err
		}
		if !closes && e.status&statusMask == statusClosed {
			return n, true, nil
		}
		s.recvQ.skip()
		if err := s.handleElem(e); err != nil {
			return n, false, err
		}
		n++
	}
	return n, false, nil
}

// tryDrain drains as a reader if the queue has elements, no close is
// pending and nobody else is at it. closeAhead reports that the receive
// loop must go on (a close is next or pending).
func (s *Session) tryDrain() (n int, closeAhead bool, err error) {
	if s.closesPending.Load() {
		return 0, true, nil
	}
	if s.recvQ.looksEmpty() {
		return 0, false, nil
	}
	n, closeAhead, _, err = s.drainAsReader()
	return n, closeAhead, err
}

// drainAsReader drains as a reader (no closes) if nobody else holds the
// token (busy otherwise). closeAhead: a close is next or pending.
func (s *Session) drainAsReader() (n int, closeAhead, busy bool, err error) {
	if s.closesPending.Load() {
		return 0, true, false, nil
	}
	if !s.cons.token.CompareAndSwap(false, true) {
		return 0, false, true, nil
	}
	defer s.cons.token.Store(false) // deferred: also after a fault
	n, closeAhead, err = s.drainHeld(false, true, noDrainLimit)
	return n, closeAhead, false, err
}

// sealConsumer takes the token for good: nothing is drained or delivered
// after it returns. Teardown calls it.
func (s *Session) sealConsumer() { s.takeToken() }

// kick makes the receive loop drain the queue: its socket read returns at
// once (a read deadline in the past), and it consumes before reading on.
func (s *Session) kick() {
	s.cons.kicked.Store(true)
	_ = s.ec.conn.SetReadDeadline(time.Unix(1, 0))
	if !s.sock.held.Load() {
		s.sock.signal() // nobody reads the socket: the receive loop takes it (lead.go)
	}
}

// pollFor lets a reader poll the queue while it waits for ready, if the
// process lets it spin now. It reports whether ready was signalled.
//
// The reader holds references on both regions meanwhile, so a session that
// ends under it cannot unmap what it is looking at; the polling runs inside
// an access.
func (s *Session) pollFor(ready chan struct{}) bool {
	if s.cons.budget.Load() <= 0 || s.IsClosed() {
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
	entered := spinning.enter(s.localPeer)
	if !entered && !s.cons.loopSpins.Load() {
		return false
	}
	// The poller count and the spinning slot live outside the region, and
	// a fault must not leave them taken by this reader: they are given back
	// inside the access right after the spin, before anything else there
	// touches the region, and below if a fault cut the spin short (left).
	// Counting itself also tells a spinning receive loop to stop and free
	// its slot for this reader (takeLoopSlot).
	var got, kick, left bool
	var spun time.Time
	s.cons.pollers.Add(1)
	if entered || s.takeLoopSlot() {
		_ = s.access(func() error {
			s.recvQ.setWorking(true)
			got, kick, spun = s.spinReader(ready)
			// The usual end, in the same access: one access less between
			// the reply's arrival and its reader. After a fault the rest
			// is done below.
			spinning.exit()
			left = true
			if s.cons.pollers.Add(-1) == 0 {
				kick = s.lastPollerLeaves(spun) || kick
			}
			return nil
		})
		if !left {
			spinning.exit()
		}
	}
	if !left && s.cons.pollers.Add(-1) == 0 {
		_ = s.access(func() error {
			kick = s.lastPollerLeaves(spun) || kick
			return nil
		})
	}
	if kick && !s.IsClosed() {
		s.kick()
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

// lastPollerLeaves clears the working flag for the reader that was the
// last to poll, inside an access. It reports true when something arrived
// meanwhile, for the receive loop to take; otherwise it records when
// polling stopped, at spun (the last clock reading of the spin, so that
// no clock is read between the reply and its reader) or now.
func (s *Session) lastPollerLeaves(spun time.Time) (arrived bool) {
	s.recvQ.setWorking(false)
	if !s.recvQ.isEmpty() {
		return true
	}
	if spun.IsZero() {
		spun = time.Now()
	}
	s.cons.slept.Store(spun.UnixNano())
	return false
}

// pollTurn reports whether the reader of st, waiting for a reply, may
// poll this time or must sleep, so that the session's readers take turns.
//
// With a peer in another process, a reader polls only while no other
// reader of the session sleeps. Once several streams wait at once, the
// receive loop harvests for all of them, a batch per look, and readers that
// poll for themselves only get in its way: they contend for the consumer
// token and for the spinning slot (a reader takes over the loop's), and the
// last one to stop kicks the loop for what arrived meanwhile. Between two
// processes, 8 streams went from 1.4–1.6× the round trips per second of
// Unix sockets to 3.7–4.6× with this rule, and 64 streams from 4.7× to
// 6.6× (medians). A lone reader (a single stream, or one gRPC connection)
// still polls and is served without a hand-off. (The same rule in one
// process made 64 streams faster and fairer but 8 streams of small
// messages 1.4× slower, and 256–512 KB bimodal, so sessions whose peer is
// this process keep the time slices below.)
//
// With the peer in this process, both ends of every stream share the
// spinning slots and the processors, and that rule lets pairs fall into
// step: the two ends of one stream poll at the same time and their round
// trips take a microsecond, while for another both sleep and each waits to
// be handed its data; the slowest stream got 0.05–0.15 of the fastest
// one's round trips. So there the turns are time slices instead: time is
// cut into pollTurnSlice, and a stream's readers may poll in the slices
// its id is due in (turnDue), which both ends compute alike, as both see
// the same ids and the same clock. A stream in its turn runs at the speed
// of a lone stream; the others are served by hand-offs meanwhile. With a
// single processor (GOMAXPROCS 1) there are no turns: once several readers
// wait, they all sleep and the two sessions' receive loops, which let the
// other goroutines run between their looks (spinWatch), harvest for them.
// The spinners of two streams in their turn held the spinning slots, and
// the other streams' data waited for wake-ups through the socket: 8 streams
// took 7.9 µs per round trip with the turns, 1.75 µs without (a Unix
// socket: 3.0 µs).
func (st *Stream) pollTurn() bool {
	s := st.s
	if !s.localPeer {
		return s.sleepers.Load() == 0
	}
	c := s.contenders.Load()
	if c <= 1 {
		return true // alone: no turns, and no clock to read
	}
	now := time.Now()
	if procs.alone(now) {
		return false
	}
	return turnDue(st.id, c, now)
}

// pollTurnSlice is how long one turn at polling lasts in a session whose
// peer is this process, and maxTurnGroups how many groups of streams take
// turns at most.
const (
	pollTurnSlice = time.Millisecond
	maxTurnGroups = 64
)

// turnDue reports whether stream id may poll at now when contenders
// readers of its session wait for a reply: always when it waits alone;
// otherwise the streams are split by id into a power of two of groups, at
// least one per contender (up to maxTurnGroups), which take turns one
// pollTurnSlice each.
func turnDue(id uint32, contenders int32, now time.Time) bool {
	if contenders <= 1 {
		return true
	}
	groups := uint64(1)
	for groups < uint64(contenders) && groups < maxTurnGroups {
		groups <<= 1
	}
	slice := uint64(now.UnixNano() / int64(pollTurnSlice))
	return slice%groups == uint64(id)%groups
}

// mayPoll reports whether a reader of the session could poll now: the
// session still spins, and the process has a spinning slot for it, or the
// slot is this session's receive loop's, which a reader takes over.
func (s *Session) mayPoll() bool {
	return s.localPeerSession.Load() == nil && s.cons.budget.Load() > 0 &&
		(spinning.free(s.localPeer) || s.cons.loopSpins.Load())
}

// takeLoopSlot takes the spinning slot of this session's receive loop for
// a reader that found no free slot and counts itself as a poller: the loop
// sees another poller and stops within a few looks, and the reader takes
// its place, serving itself instead of being handed its data.
func (s *Session) takeLoopSlot() bool {
	deadline := time.Now().Add(slotHandoverWait)
	for {
		for range pollCheckEvery {
			if spinning.enter(s.localPeer) {
				return true
			}
			if !s.cons.loopSpins.Load() {
				// The loop stopped; its slot is free unless another
				// spinner took it.
				return spinning.enter(s.localPeer)
			}
			cpuRelax()
		}
		if time.Now().After(deadline) {
			return false
		}
	}
}

// slotHandoverWait bounds how long a reader waits for a spinning receive
// loop to free its slot; the loop looks at the poller count every few looks
// at the queue, so this is only reached when the loop was descheduled.
const slotHandoverWait = 20 * time.Microsecond

// What a spin ended with.
const (
	spinGaveUp        = iota // nothing came within the budget, or no spinning now
	spinFound                // what the spinner waited for is there
	spinFramesWaiting        // frames arrived on the socket (receive loop only)
)

// spin is the receive loop's spin: it looks at the queue for up to the spin
// budget, if the process lets it spin now. It stops when a reader starts
// polling (one spinner is enough), and when frames arrive on the socket,
// which the receive loop must not leave unread however busy the queue is.
func (s *Session) spin() int {
	if s.cons.budget.Load() <= 0 || !spinning.enter(s.localPeer) {
		return spinGaveUp
	}
	s.cons.loopSpins.Store(true)
	defer s.cons.loopSpins.Store(false) // after exit: a reader that sees it false finds the slot free
	defer spinning.exit()
	var w spinWatch
	w.start(s, yieldOSAfter)
	for {
		for range w.looks() {
			if !s.recvQ.isEmpty() {
				s.cons.hit()
				return spinFound
			}
			if s.cons.pollers.Load() > 1 {
				return spinGaveUp // a reader polls: leave it to that one
			}
			w.relax()
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

// spinReader is a reader's spin: it drains what arrives and stops when
// ready is signalled (true), when the budget runs out, or when a close is
// next in the queue (kick: the receive loop must apply it). When ready was
// signalled, last is the spin's last reading of the clock, recent enough
// to date the end of the polling, so that the clock is not read again
// between a reply's arrival and its reader (reading it there, about 45 ns
// on the development VMs, made a single stream's 64 B round trip between
// two processes 70–80 ns slower).
func (s *Session) spinReader(ready chan struct{}) (got, kick bool, last time.Time) {
	var w spinWatch
	w.startReader(s)
	for {
		for range w.looks() {
			n, closeAhead, err := s.tryDrain()
			if err != nil {
				s.closeWithError(err)
				return false, false, time.Time{}
			}
			select {
			case <-ready:
				s.cons.hit()
				return true, closeAhead, w.last
			default:
			}
			if closeAhead {
				return false, true, time.Time{}
			}
			if n > 0 && !w.sharesProc { // it was for other streams: let their readers run
				runtime.Gosched()
			}
			w.relax()
		}
		if w.sharesProc && localWakes.pending() {
			if localWakes.await(ready, s.closed) {
				// Usually the arrival's signal, and the peer has run
				// meanwhile: put the signal back and look once more, so
				// that this reader drains its reply itself. Returned at
				// once, it left the reply in the queue for the receive
				// loop, kicked to hand it over (BenchmarkPausedPingPong
				// with one processor: 21–27 µs, 2.2–3.2× a Unix socket's;
				// 12–20 µs, 1.2–1.8×, this way).
				select {
				case ready <- struct{}{}:
				default:
				}
			}
			w.last = time.Now() // parked on purpose, not preempted
		}
		if w.check(s) == spinGaveUp {
			return false, false, time.Time{}
		}
	}
}

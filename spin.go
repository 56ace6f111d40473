package shmipc

import (
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// spinWatch keeps a spinner's clock: budget, preemption, yielding.
type spinWatch struct {
	begin, last, lastYield, lastSocket time.Time
	yieldAfter                         time.Duration // yieldOSAfter or readerYieldOSAfter
	// alone: the process has one processor, which the spinner holds;
	// sharesProc: and the session's peer is this process.
	alone, sharesProc bool
}

// start begins a spin for session s.
//
// In a process with a single processor (GOMAXPROCS 1) whose session's peer
// is this same process, the peer's goroutines need the processor the
// spinner holds to answer, so the spinner lets them run between every two
// rounds of looks: the two ends of a stream then take turns on the
// processor, and no round trip waits for the end of a spin. Without that, a
// round trip in one process took 0.1–0.6 ms (a Unix socket's 3.4 µs).
func (w *spinWatch) start(s *Session, yieldAfter time.Duration) {
	w.yieldAfter = yieldAfter
	w.begin = time.Now()
	w.alone = procs.alone(w.begin) // every spin, so that a change is seen whatever the peer
	w.sharesProc = s.localPeer && w.alone
	w.last, w.lastYield, w.lastSocket = w.begin, w.begin, w.begin
}

// looks is how many looks a spinner makes between two checks: one when it
// shares the processor with its peer, whose turn comes at every check.
func (w *spinWatch) looks() int {
	if w.sharesProc {
		return 1
	}
	return pollCheckEvery
}

// relax pauses between two looks, unless the peer's turn comes next.
func (w *spinWatch) relax() {
	if !w.sharesProc {
		cpuRelax()
	}
}

// startReader begins a reader's spin. In a process with a single processor
// the spinner would hold the only one, so it first lets the goroutines that
// wait for it run: they are often the very goroutines the reader waits for,
// readied by its own goroutine just before (a gRPC reader hands each
// request to a handler goroutine, then reads again), and they would wait
// until the spin ends. With more processors another one takes them, and a
// yield would wake a thread to look for work, which costs a single stream's
// round trip a few microseconds. (With the peer in another process,
// yielding again every 20 µs of the spin, or at the start of the receive
// loop's spins, made gRPC's small calls two to three times slower.)
func (w *spinWatch) startReader(s *Session) {
	w.start(s, readerYieldOSAfter)
	if w.alone {
		runtime.Gosched()
		w.begin = time.Now()
		w.last, w.lastYield, w.lastSocket = w.begin, w.begin, w.begin
	}
}

// Two sessions of this process connected to each other (a client and the
// server session it got) are paired, and then deliver to each other
// directly: a writer hands its message to the peer's stream itself, on
// its own goroutine, without the queue (deliverDirect) whenever nothing
// published on the queue before is still to take effect; otherwise it
// publishes, and if the peer session is not draining, drains that
// session's queue itself (drainForPeer) instead of waking the peer with a
// Polling frame. The
// peer's readers never poll and never read the socket (they sleep on their
// streams until data is delivered), and its receive loop never spins: a
// message is handed over as a Go channel hands a value over, the reader
// made runnable next on the writer's processor. Nobody spins on a core the
// other end needs, so a busy CPU costs little: in one process with two CPU
// hogs a single stream's 4 KB round trip took 2.0–2.1 µs against a Unix
// socket's 5.3–6.9 µs, where polling had taken 4.2–5.0 µs (three
// alternating pairs of runs, docs/bench/results-2026-11-24c).
//
// The peer's other frames still go through the socket, so the order of
// closes and fallback data is kept (closeAfterSocket): a close element
// stops the writer's drain and kicks the peer's receive loop, as a polling
// reader does; at the peer's end the receive loop drains what a kick had
// not yet had drained (recvLoop). The sessions are paired by the name of
// the queue region, which both sides know and which is new for each
// session; a session whose peer in this process is not a Session (a
// hand-written peer) stays unpaired and talks as with another process.
var localPairs = struct {
	sync.Mutex
	waiting map[string]*Session // by queue region name: sessions whose peer has not started
}{waiting: make(map[string]*Session)}

// noLocalPairs leaves sessions of one process unpaired, so that they talk
// as two processes do; the tests set it.
var noLocalPairs atomic.Bool

// pairLocal pairs s, whose peer is this process, with the peer's session if
// it has started, or leaves s for it to find.
func pairLocal(s *Session) {
	if s.queueRegion == nil || noLocalPairs.Load() {
		return
	}
	key := s.queueRegion.path
	localPairs.Lock()
	defer localPairs.Unlock()
	if o := localPairs.waiting[key]; o != nil && o != s && o.isClient != s.isClient {
		delete(localPairs.waiting, key)
		s.localPeerSession.Store(o)
		o.localPeerSession.Store(s)
		return
	}
	localPairs.waiting[key] = s
}

// unpairLocal forgets s as it ends. Its peer stops using it on its own: it
// finds s closed.
func unpairLocal(s *Session) {
	if s.queueRegion == nil {
		return
	}
	localPairs.Lock()
	if localPairs.waiting[s.queueRegion.path] == s {
		delete(localPairs.waiting, s.queueRegion.path)
	}
	localPairs.Unlock()
}

// drainForPeer drains s's queue on its paired peer's goroutine: the peer
// has just published and set s's working flag (s was not draining). Every
// goroutine of the peer that publishes while it drains finds the flag set,
// so one drain takes a batch. What s's readers wait for is delivered and
// they are readied by a channel send, which puts the first of them next in
// line on the writer's processor, as a send on a Go channel does: once the
// writer waits for its reply, the reader runs on the same thread, with no
// thread woken and nobody spinning. A close element, or a close waiting for
// the socket, is left to s's receive loop, kicked for it, as a polling
// reader leaves it (tryDrain). The drain counts itself among s's pollers,
// so the working flag follows poll.go's rule: the last poller to stop
// clears it and looks at the queue once more.
func (s *Session) drainForPeer() {
	if s.IsClosed() || !s.queueRegion.acquire() {
		return
	}
	defer s.queueRegion.release()
	if !s.buf.region.acquire() {
		return
	}
	defer s.buf.region.release()
	s.drainForPeerHeld(0)
}

// directPeer returns the paired peer session that st's messages may go to
// directly (deliverDirect), or nil when they go through the queue: st was
// opened before its session was paired. (deliverDirect looks whether the
// peer has ended.)
func (st *Stream) directPeer() *Session {
	peer := st.s.localPeerSession.Load()
	if peer == nil || st.peerRefs != peer {
		return nil
	}
	return peer
}

// deliverDirect hands the message of the paired peer's stream id whose
// first slice is at offset to s's stream id on the writer's goroutine,
// without the IO queue: its reader is made runnable on the writer's
// processor, and no queue line, consumer token or working flag is
// written. Through the queue, those lines went back and forth between
// the processors for every message when the streams of both shared one
// session: 8 streams of 64 B took 1.2-1.3 µs per round trip, no faster
// than with one processor, against 0.8 µs over 8 sessions; 0.72-0.75 µs
// handed over directly (BenchmarkPingPong, BenchmarkPingPongSessions).
//
// It reports false, and the writer publishes on the queue instead, while
// anything published on the queue before may not have taken effect yet:
// the queue holds elements, a consumer holds the token (it may be
// handling one it took), or a close waits for the socket. So a message
// handed over directly never overtakes one published before it, of its
// stream or any other, as a later queue element never does (a close
// published on the queue, then data on another stream: the close has
// taken effect when the data arrives). Its stream's messages do not
// overtake each other either: the writer holds the stream, and a message
// it published on the queue keeps the queue from being empty until it
// has been handled. Its close is published after the last message has
// been handed over (Close leaves the close to a writer in progress).
//
// It does not take the consumer token, which would put one line shared
// by both processors back on every message (8 streams of 64 B took
// 1.0 µs per round trip with it, 0.75 µs without), so the end of s does
// not wait for it: a message it hands over meanwhile finds s closed
// (streamFor) or its stream ended (deliver, under the stream's lock, which
// sessionEnded takes to mark it), and is freed; or it arrived before the
// end, like any other message. The writer's stream holds references on
// s's regions (peerRefs), so they stay mapped meanwhile. A fault in them
// ends s, not the writer's session.
func (s *Session) deliverDirect(id, offset uint32, scratch *[]segment) bool {
	delivered := false
	err := s.access(func() error {
		// In this order: an element taken from the queue is handled under
		// the token, and a close deferred under it is marked pending
		// before the token is let go.
		if s.IsClosed() || !s.recvQ.isEmpty() || s.cons.token.Load() || s.closesPending.Load() {
			return nil
		}
		delivered = true
		return s.handleData(id, offset, scratch)
	})
	if err != nil {
		s.closeWithError(err) // s's error: the writer's session goes on
	}
	return delivered
}

// drainForPeerHeld is drainForPeer for a caller that holds references on
// s's regions (a stream's peerRefs). id is the publishing stream's, for
// the counters.
func (s *Session) drainForPeerHeld(id uint32) {
	if s.IsClosed() {
		return
	}
	s.counters.of(id).wakeupsReceived.Add(1)
	kick := false
	for {
		s.cons.pollers.Add(1) // outside the accesses, as in pollFor
		err := s.access(func() error {
			s.recvQ.setWorking(true)
			for !s.recvQ.isEmpty() && !s.IsClosed() {
				// busy: another goroutine drains, and may have looked for
				// the last time already, so the receive loop drains after
				// it.
				_, closeAhead, busy, err := s.drainAsReader()
				if err != nil {
					return err
				}
				if closeAhead || busy {
					kick = true
					return nil
				}
			}
			return nil
		})
		if err != nil {
			s.closeWithError(err) // s's error: the writer's session goes on
		}
		// The last poller clears the flag and looks once more, as in
		// stopPolling; after a kick the receive loop drains what is left.
		if s.cons.pollers.Add(-1) != 0 || err != nil {
			break
		}
		again := false
		_ = s.access(func() error {
			s.recvQ.setWorking(false)
			again = !s.recvQ.isEmpty()
			return nil
		})
		if !again || kick || s.IsClosed() {
			break
		}
	}
	if kick && !s.IsClosed() {
		s.kick()
	}
}

// localWakes tracks the wake-ups that sessions whose peer is this process
// but that are not paired (pairLocal) have sent as Polling frames and not
// yet seen arrive. With a single processor such a wake-up reaches its
// session only through the network poller, which the scheduler consults
// when it has no goroutine to run: a spinner that lets the other
// goroutines run between its looks is always one (sharesProc), so while
// it spins the wake-up waits, and with it the reply the spinner waits for. A round trip with a pause before it (the
// peer's spinners had stopped) took two full spins, 0.4 ms with the default
// ConsumerSpinTime, against 11 µs over a Unix socket. So while such a
// wake-up is on its way, a reader that spins parks until it arrives (or its
// own data does) and then spins on, and a receive loop stops spinning. (A
// reader that stopped instead left its peer asleep for the next message,
// which then needed a wake-up too: every message came with one, and a
// stream of back-to-back round trips took 2.3 times as long.)
//
// It keeps times, not counts: sessions end with wake-ups unread, and the
// next one to arrive clears what they left. (With several pairs of
// sessions in one process a wake-up can clear another's; a spinner then
// goes on as before, until the wake-up's session is served.) A wake-up
// that has not arrived after localWakeStale is taken for lost: its session
// ended, or the peer in this process is not a Session (the tests' raw
// peers), and spinners that waited for it go on.
var localWakes localWakeTimes

// localWakeStale is how long a wake-up between two sessions of this process
// may take: the network poller delivers it in microseconds once the
// processor is left to the scheduler.
const localWakeStale = time.Millisecond

// wakeTimers bounds the parking of readers (await) without allocating.
var wakeTimers = sync.Pool{New: func() any {
	t := time.NewTimer(time.Hour)
	t.Stop()
	return t
}}

type localWakeTimes struct {
	sent, got atomic.Int64 // UnixNano of the last sent and the last received
	waiters   atomic.Int32 // readers parked in await
	mu        sync.Mutex
	parked    []chan struct{} // their ready channels (buffered), signalled on an arrival
}

// wakingPeer records that s is about to send its peer a wake-up.
func (s *Session) wakingPeer() {
	if s.localPeer {
		localWakes.sent.Store(time.Now().UnixNano())
	}
}

// received records a wake-up that arrived, and signals the parked readers
// (they look for their data again, as after any notification).
func (l *localWakeTimes) received() {
	l.got.Store(time.Now().UnixNano())
	if l.waiters.Load() > 0 {
		l.mu.Lock()
		for _, ch := range l.parked {
			select {
			case ch <- struct{}{}:
			default: // a notification is waiting already
			}
		}
		l.mu.Unlock()
	}
}

// pending reports whether a wake-up between two sessions of this process is
// on its way (sent, not arrived, not yet taken for lost).
func (l *localWakeTimes) pending() bool {
	sent := l.sent.Load()
	return sent > l.got.Load() && time.Now().UnixNano()-sent < int64(localWakeStale)
}

// await parks a reader until no wake-up is pending (it arrived, or it is
// taken for lost), its ready channel is signalled (reported true: the
// signal was taken; an arrival signals it too), or the session ends.
// Parked, the reader leaves the processor to the scheduler, which then
// polls the network and delivers the wake-up.
func (l *localWakeTimes) await(ready chan struct{}, closed <-chan struct{}) (got bool) {
	l.waiters.Add(1)
	l.mu.Lock()
	l.parked = append(l.parked, ready)
	l.mu.Unlock()
	defer func() {
		l.mu.Lock()
		for i, ch := range l.parked {
			if ch == ready {
				last := len(l.parked) - 1
				l.parked[i] = l.parked[last]
				l.parked[last] = nil
				l.parked = l.parked[:last]
				break
			}
		}
		l.mu.Unlock()
		l.waiters.Add(-1)
	}()
	if !l.pending() { // it arrived before this reader counted itself
		return false
	}
	t := wakeTimers.Get().(*time.Timer)
	defer wakeTimers.Put(t)
	t.Reset(localWakeStale)
	defer t.Stop()
	select {
	case <-ready:
		return true
	case <-closed:
	case <-t.C:
	}
	return false
}

// procs caches GOMAXPROCS for spinners: runtime.GOMAXPROCS takes the
// scheduler's lock. It can change while the process runs (the runtime
// follows the CPU limit of the process's cgroup; go test -cpu sets it for
// each benchmark), so spinners read it again when they start a spin more
// than procsRefresh after the last read.
var procs = newProcsCache()

type procsCache struct {
	n  atomic.Int32
	at atomic.Int64 // when n was read (UnixNano)
}

const procsRefresh = 5 * time.Millisecond

func newProcsCache() *procsCache {
	c := &procsCache{}
	c.read(time.Now())
	return c
}

func (c *procsCache) read(now time.Time) {
	n := runtime.GOMAXPROCS(0)
	c.n.Store(int32(n))
	c.at.Store(now.UnixNano())
	spinning.resize(usableCPUs(n)) // the governor follows (cpubudget.go)
}

// alone reports whether the process runs its goroutines on one processor;
// now is the time, which the caller has read anyway.
func (c *procsCache) alone(now time.Time) bool {
	if now.UnixNano()-c.at.Load() > int64(procsRefresh) {
		c.read(now)
	}
	return c.n.Load() == 1
}

// check looks at the clock between rounds of looks. It returns spinGaveUp
// when the spinner must stop, spinFramesWaiting every socketCheckEvery
// (time for the receive loop to look at the socket), and spinFound
// otherwise (go on).
func (w *spinWatch) check(s *Session) int {
	var now time.Time
	if w.sharesProc {
		if localWakes.pending() {
			return spinGaveUp
		}
		runtime.Gosched() // the peer's turn; the time it takes is not a preemption
		now = time.Now()
		w.last = now
	} else if now = time.Now(); now.Sub(w.begin) >= w.yieldAfter {
		// A long wait: give the CPU to any thread waiting for it, which may
		// be the very peer this spinner waits for; with nobody waiting it
		// returns at once.
		osYield()
		now = time.Now()
	}
	if now.Sub(w.last) > preemptedGap {
		// Descheduled between two rounds: the CPU has more work than cores,
		// and spinning only takes a core from someone.
		spinning.pressure(w.last, now)
		return spinGaveUp
	}
	w.last = now
	if now.Sub(w.begin) >= time.Duration(s.cons.budget.Load()) {
		s.cons.miss()
		return spinGaveUp
	}
	if s.IsClosed() {
		return spinGaveUp
	}
	if now.Sub(w.lastYield) >= yieldEvery {
		runtime.Gosched()
		w.last, w.lastYield = time.Now(), now
	}
	if now.Sub(w.lastSocket) >= socketCheckEvery {
		w.lastSocket = now
		return spinFramesWaiting
	}
	return spinFound
}

// yieldOSAfter is how long a receive loop spins before it yields the OS
// thread between rounds, and readerYieldOSAfter the same for a reader
// polling for its reply. Spinning longer usually means the peer is waiting
// for the very core the spinner holds; with nobody waiting, a yield returns
// at once, but costs a system call.
//
// A reader polls only while it waits alone (pollTurn), for a reply to what
// it just sent, which is a latency the user sees: when the two processes'
// spinners share a CPU, each runs until it yields, and with 5 µs a single
// stream's round trip of 64 B took 14 µs at p99 between two processes
// (1.5 µs at p50); yielding after 1 µs gave 6 µs. With two CPU hogs
// running, that pair of spinners took 10–14 µs at p50 for 4 KiB, more
// than a Unix socket's 9 µs; yielding after 1 µs, 6.1–6.3 µs. A receive
// loop spins while many streams are busy, where each yield is a system
// call taken from the harvest: with every spinner yielding at once, 64
// streams × 4 KiB made a quarter fewer round trips per second, and with
// 2 µs 4 % fewer.
const (
	yieldOSAfter       = 5 * time.Microsecond
	readerYieldOSAfter = time.Microsecond
)

// preemptedGap is a pause between two rounds of a spinner that only being
// descheduled explains: a round takes well under a microsecond, and the
// processor is yielded on purpose only at yield points.
const preemptedGap = 500 * time.Microsecond

// Cool-down after a spinner was descheduled: the first, and the longest.
const (
	minSpinCooldown = time.Millisecond
	maxSpinCooldown = 250 * time.Millisecond
)

// spinGovernor rations spinning for the whole process.
type spinGovernor struct {
	slots    atomic.Int32 // how many goroutines may spin at once for sessions with another process
	local    atomic.Int32 // the same, counting sessions whose peer is this process
	active   atomic.Int32 // how many do
	offUntil atomic.Int64 // no spinning before this time (UnixNano); 0 once it has passed
	cooldown atomic.Int64 // the length of the last cool-down, in ns
	lastEnd  atomic.Int64 // when the last cool-down ended or ends (UnixNano)
	// ender clears offUntil when the cool-down is over, so that enter and
	// free, called on every wait, never read the clock: under load a
	// cool-down is running much of the time, and two clock reads per
	// round trip cost several percent of the CPU.
	ender *time.Timer
}

var spinning = newSpinGovernor(usableCPUs(runtime.GOMAXPROCS(0)))

func newSpinGovernor(cpus int) *spinGovernor {
	g := &spinGovernor{}
	g.resize(cpus)
	g.cooldown.Store(int64(minSpinCooldown))
	g.ender = time.AfterFunc(time.Hour, g.endCooldown)
	g.ender.Stop()
	return g
}

// endCooldown runs when the cool-down should be over: it ends it, or waits
// for the rest if pressure extended it meanwhile.
func (g *spinGovernor) endCooldown() {
	until := g.offUntil.Load()
	if until == 0 {
		return
	}
	if left := until - time.Now().UnixNano(); left > 0 {
		g.ender.Reset(time.Duration(left))
		return
	}
	g.offUntil.CompareAndSwap(until, 0)
}

// enter takes a spinning slot if one is free and no cool-down is running;
// local says the session's peer is this process.
func (g *spinGovernor) enter(local bool) bool {
	slots := g.slotsFor(local)
	if slots <= 0 {
		return g.starve()
	}
	if g.active.Load() >= slots || g.offUntil.Load() != 0 {
		return false
	}
	if g.active.Add(1) > slots {
		g.active.Add(-1)
		return false
	}
	return true
}

func (g *spinGovernor) exit() { g.active.Add(-1) }

// slotsFor is the number of slots for a session: local says its peer is
// this process. (One slot for such sessions in a process with a single
// processor made a single stream's round trip in one process 390 µs: its
// peer's reader slept, and a spinner that lets other goroutines run keeps
// the scheduler from polling the network for the wake-up, which then waits
// for the runtime's monitor thread or for the end of the spin.)
func (g *spinGovernor) slotsFor(local bool) int32 {
	if local {
		return g.local.Load()
	}
	return g.slots.Load()
}

// free reports whether enter would find a slot now.
func (g *spinGovernor) free(local bool) bool {
	slots := g.slotsFor(local)
	return g.active.Load() < slots && g.offUntil.Load() == 0
}

// pressure switches spinning off for a cool-down: a spinner was
// descheduled from since until now. If it lost its core soon after the last
// cool-down ended (within four times that cool-down's length), the
// pressure has lasted and the cool-down doubles; after a calm spell it
// starts over from the shortest. So a spinner that lost its core once, to a
// thread that had a slice to run, pauses spinning for a moment, while a CPU
// that stays oversubscribed (the first spin after each cool-down loses its
// core) turns spinning off for longer and longer.
func (g *spinGovernor) pressure(since, now time.Time) {
	d := int64(minSpinCooldown)
	if last, end := g.cooldown.Load(), g.lastEnd.Load(); end != 0 && since.UnixNano()-end < 4*last {
		d = min(2*last, int64(maxSpinCooldown))
	}
	g.cooldown.Store(d)
	end := now.UnixNano() + d
	g.lastEnd.Store(end)
	if left := end - time.Now().UnixNano(); left > 0 {
		g.offUntil.Store(end)
		g.ender.Reset(time.Duration(left))
	}
}

// osYield gives up the CPU to another runnable thread, if there is one
// (sched_yield). It is a raw system call: it never blocks.
func osYield() { syscall.RawSyscall(syscall.SYS_SCHED_YIELD, 0, 0, 0) }

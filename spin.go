package shmipc

import (
	"runtime"
	"runtime/metrics"
	"sync/atomic"
	"syscall"
	"time"
)

// Spinning: how the receive loop keeps looking at its queue for a while
// after it drained it (consume.go), and how the process rations that.

// spinWatch keeps a spinner's clock: budget, preemption, yielding.
type spinWatch struct {
	begin, last, lastYield, lastSocket, lastLook time.Time
	// alone: the process runs its goroutines on one processor, which the
	// spinner holds: it lets the others run between every two rounds of
	// looks, since they include the readers it hands data to.
	alone bool
	// reader: the spinner is a polling reader, which waits for one
	// stream's data (the loop serves them all: it yields later).
	reader bool
}

// procs caches GOMAXPROCS for spinners: runtime.GOMAXPROCS takes the
// scheduler's lock. The runtime may change it (it follows the cgroup's CPU
// limit), so a spin reads it again once procsRefresh has passed.
var procs procsCache

type procsCache struct {
	n  atomic.Int32
	at atomic.Int64 // when n was read (UnixNano)
}

const procsRefresh = 5 * time.Millisecond

// get returns GOMAXPROCS as of at most procsRefresh before now.
func (c *procsCache) get(now time.Time) int {
	if now.UnixNano()-c.at.Load() > int64(procsRefresh) || c.n.Load() == 0 {
		c.read(now)
	}
	return int(c.n.Load())
}

// read reads GOMAXPROCS at now and sizes the governor for it.
func (c *procsCache) read(now time.Time) {
	n := runtime.GOMAXPROCS(0)
	c.n.Store(int32(n))
	c.at.Store(now.UnixNano())
	spinning.resize(spinSlots(n))
}

// check looks at the clock between rounds of looks. It returns spinGaveUp
// when the spinner must stop, spinFramesWaiting every socketCheckEvery (for
// the receive loop to look at the socket), and spinFound to go on.
func (w *spinWatch) check(s *Session) int {
	var now time.Time
	if w.alone {
		runtime.Gosched() // the readers' turn; the time it takes is not a preemption
		now = time.Now()
		w.last = now
	} else if now = time.Now(); (w.reader && s.cons.cpuShared) || now.Sub(w.begin) >= yieldOSAfter {
		osYield() // to any thread waiting for the CPU, perhaps the peer
		after := time.Now()
		s.cons.cpuShared = after.Sub(now) > yieldRanOthers
		now = after
	}
	if now.Sub(w.last) > preemptedGap {
		// Descheduled: spinning only takes a core from someone.
		spinning.pressure(w.last, now)
		return spinGaveUp
	}
	w.last = now
	if now.Sub(w.begin) >= time.Duration(s.cons.budget) {
		s.cons.miss()
		return spinGaveUp
	}
	if s.IsClosed() {
		return spinGaveUp
	}
	if now.Sub(w.lastYield) >= yieldEvery || (!w.alone && w.othersWait(s, now)) {
		runtime.Gosched()
		w.last, w.lastYield = time.Now(), now
	}
	if now.Sub(w.lastSocket) >= socketCheckEvery {
		w.lastSocket = now
		return spinFramesWaiting
	}
	return spinFound
}

// othersWait reports, at most every lookRunnableEvery, whether goroutines
// wait to run. Those a spinner made runnable (readers it handed data to,
// the work a polling reader's caller handed off) wait on its processor
// until it yields or a thread woken for them takes them: in gRPC calls
// 2-9 % of goroutine wake-ups then waited over 64 µs (under 1 % without
// spinning). The count takes the scheduler's lock, hence not every round.
func (w *spinWatch) othersWait(s *Session, now time.Time) bool {
	if now.Sub(w.lastLook) < lookRunnableEvery {
		return false
	}
	w.lastLook = now
	c := &s.cons
	if c.runnable == nil {
		c.runnable = []metrics.Sample{{Name: "/sched/goroutines/runnable:goroutines"}}
	}
	metrics.Read(c.runnable)
	return c.runnable[0].Value.Uint64() > 0
}

const lookRunnableEvery = 4 * time.Microsecond

// yieldOSAfter is how long a receive loop spins before it yields the OS
// thread between rounds. Spinning longer usually means the peer is waiting
// for the very core the spinner holds; yielding sooner costs a system call
// per round while many streams keep the loop busy.
const yieldOSAfter = 5 * time.Microsecond

// yieldRanOthers is how long a yield of the OS thread takes only if
// another thread ran meanwhile (a bare sched_yield takes 1-2 µs). Then the
// spinner shares its CPU, often with the peer's spinner, which the
// scheduler may leave there for tens of milliseconds while the other CPU
// idles: each side then spins out yieldOSAfter before the other may run,
// and a round trip takes over 20 µs (12-14 yielding at once). So until a
// yield comes back at once, a polling reader yields from the start of each
// wait; the loop keeps yieldOSAfter (sooner cost many streams throughput).
const yieldRanOthers = 4 * time.Microsecond

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
	slots    atomic.Int32 // how many goroutines may spin at once (resize)
	active   atomic.Int32 // how many do
	offUntil atomic.Int64 // no spinning before this time (UnixNano); 0 once it has passed
	cooldown atomic.Int64 // the length of the last cool-down, in ns
	lastEnd  atomic.Int64 // when the last cool-down ended or ends (UnixNano)
	// ender clears offUntil when the cool-down is over, so that enter,
	// called on every wait, never reads the clock.
	ender *time.Timer
}

var spinning = newSpinGovernor(spinSlots(runtime.GOMAXPROCS(0)))

func newSpinGovernor(slots int) *spinGovernor {
	g := &spinGovernor{}
	g.resize(slots)
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

// enter takes a spinning slot if one is free and no cool-down is running.
func (g *spinGovernor) enter() bool {
	slots := g.slots.Load()
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

// pressure switches spinning off for a cool-down: a spinner was
// descheduled from since until now. If that came within four cool-downs'
// length of the last one's end, the pressure has lasted and the cool-down
// doubles; otherwise it starts over from the shortest. So one lost slice
// pauses spinning for a moment, while a CPU that stays oversubscribed turns
// it off for longer and longer.
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

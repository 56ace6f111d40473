package shmipc

import (
	"sync/atomic"
	"time"

	"github.com/goshm/shmipc/internal/wire"
)

// Who reads the socket: the receive loop, or a reader waiting for its data.
//
// The wake-up for a message (a Polling frame) arrives on the socket. When
// the receive loop reads it, the message reaches its reader through a
// goroutine hand-off: the loop drains the queue and readies the reader, and
// readying a goroutine while a processor is idle wakes a second OS thread
// for it. Between the two ends of a ping-pong that is a thread wake-up per
// message, on top of the socket round trip that a Unix socket's reader
// pays alone: there the goroutine the kernel's wake-up readies is the
// reader itself. It matters when spinning is off (the CPU is busy), so that
// every message needs a wake-up.
//
// So while spinning does not pay (no spinning slot free, a cool-down after
// the CPU was found oversubscribed, or a budget spent on spins that found
// nothing), a lone reader reads the socket itself (it "leads"): the
// wake-up readies it directly, it drains the queue, delivering what is for
// other streams too, and goes back to its caller with its data. The socket
// is a token, held by one goroutine at a time:
//   - the receive loop holds it, and lends it (lendSocket) when a reader that
//     slept because the loop held it (wanted) is about to get its data and
//     no other reader sleeps;
//   - a reader about to sleep takes it if it is free, and reads frames until
//     its own stream is notified (lead). It handles Polling frames only: any
//     other frame, and any error, it hands to the receive loop with the
//     socket (handBack);
//   - a leader that got its data leaves the socket free for its next wait,
//     and a timer gives it back to the receive loop if no reader takes it
//     within one to two lend periods; if another reader sleeps, the loop
//     is woken at once instead. A reader that begins to sleep while the
//     socket is free takes it, so no reader waits on a socket nobody reads.
//     The lend period starts at socketLendTime and doubles, up to
//     maxSocketLendTime, each time the timer finds the socket taken again
//     since it was set: while readers keep taking it the timer rarely
//     fires, and once it finds the socket untouched for a period, the loop
//     takes it and the period starts over.
//
// Whatever wakes a reader (its data delivered by someone else, a close, a
// deadline set) also kicks it out of its socket read when it leads
// (Stream.notify), as a kick does the receive loop.
type socketTurn struct {
	held    atomic.Bool            // the receive loop or a leader reads frames
	toLoop  atomic.Bool            // a leader handed the socket to the receive loop
	blocked atomic.Pointer[Stream] // the stream whose reader is in a socket read
	wanted  atomic.Pointer[Stream] // a lone reader slept while the loop read
	wantSeq atomic.Uint64          // its stream's delivered count then
	back    chan struct{}          // wakes a receive loop that lent the socket
	timer   *time.Timer            // gives a free socket back to the loop
	armed   atomic.Bool            // timer is set
	period  atomic.Int64           // the lend period, in ns
	frees   atomic.Uint64          // how often the socket was left free
	seen    atomic.Uint64          // frees when the timer was set

	// Left by a leader for the receive loop, written before toLoop is set:
	// a frame it read and does not handle, or the error that ended its
	// reading.
	h       wire.Header
	payload []byte
	err     error
}

// The lend period is about how long the socket may stay free after a
// leader got its data, before the receive loop takes it back (one to two
// periods). A reader in a request-reply exchange waits again well within
// the shortest, socketLendTime; the loop taking the socket back costs a
// wake-up, and frames other than wake-ups for a waiting reader (a stream
// the peer opens, a close) wait at most two periods meanwhile.
//
// The period grows while readers keep taking the socket because the timer
// itself is costly there: each time it fires the runtime wakes a thread,
// on a small machine often on the core the two processes were not using.
// Between two processes with spinning off (example/pingpong -spin 0), a
// 64 B round trip took 15–26 µs at p50 and 25 µs of CPU per side with a
// fixed 500 µs period, 11 µs and 15–17 µs with the period growing to
// 8 ms (a Unix socket: 9 µs and 12 µs).
const (
	socketLendTime    = 500 * time.Microsecond
	maxSocketLendTime = 8 * time.Millisecond
)

func (t *socketTurn) init() {
	t.held.Store(true) // the receive loop reads from the start
	t.period.Store(int64(socketLendTime))
	t.back = make(chan struct{}, 1)
	t.timer = time.AfterFunc(time.Hour, t.check)
	t.timer.Stop()
}

// free leaves the socket to whichever reader waits next, and sees that the
// receive loop takes it back if none does within one to two lend
// periods. The timer is set once per period, not per call, and no
// clock is read: moving the timer on every message would make the runtime
// wake its network poller each time.
func (t *socketTurn) free() {
	t.frees.Add(1)
	t.held.Store(false)
	if !t.armed.Load() && t.armed.CompareAndSwap(false, true) {
		t.seen.Store(t.frees.Load())
		t.timer.Reset(time.Duration(t.period.Load()))
	}
}

// lengthen doubles the lend period, up to maxSocketLendTime: readers keep
// taking the socket. Only the timer's function calls it.
func (t *socketTurn) lengthen() {
	if p := t.period.Load(); p < int64(maxSocketLendTime) {
		t.period.Store(min(2*p, int64(maxSocketLendTime)))
	}
}

// check runs on the timer: it wakes the receive loop if the socket is free
// and was not freed again for a whole period, and waits another, longer
// period if it was. While a reader holds the socket the timer stays off;
// its next free sets it, for a longer period too. When the loop is woken
// the period starts over from socketLendTime.
func (t *socketTurn) check() {
	t.armed.Store(false)
	if t.held.Load() {
		t.lengthen()
		return
	}
	n := t.frees.Load()
	if n == t.seen.Load() {
		t.period.Store(int64(socketLendTime))
		t.signal()
		return
	}
	t.lengthen()
	if t.armed.CompareAndSwap(false, true) {
		t.seen.Store(n)
		t.timer.Reset(time.Duration(t.period.Load()))
	}
}

func (t *socketTurn) signal() {
	select {
	case t.back <- struct{}{}:
	default:
	}
}

// othersSleep reports whether a reader sleeps that will not come back for
// the socket by itself: any sleeping reader but st's, and st's too unless
// it was notified since it began to sleep (handed data, say: it is about to
// wake). A reader that counted itself and has not yet begun to sleep counts
// too: that leans towards the loop keeping the socket, which costs a
// hand-off at worst, while a socket lent to nobody waits for the lend timer.
//
// Whether st's reader was notified matters because the request the loop
// acts on can be stale: st's reader, handed data, woke and came back for
// more while the loop still held the socket, and went to sleep without
// renewing its request (lead). Lent then, the socket went unread for up to
// two lend periods: gRPC calls of 1 MiB had a p99 of 8.9–9 ms in two of
// eight benchmark runs (docs/bench/results-2026-11-23e). A reader that
// begins to sleep after the loop freed the socket takes it instead.
func (s *Session) othersSleep(st *Stream) bool {
	n := s.sleepers.Load()
	if st != nil && st.sleeping.Load() && st.notified.Load() != st.sleptAt.Load() {
		n--
	}
	return n > 0
}

// mayLend reports whether the receive loop should lend the socket now: a
// reader wants it, has been handed data since it asked, and no other reader
// sleeps.
func (s *Session) mayLend() bool {
	st := s.sock.wanted.Load()
	return st != nil && st.delivered.Load() != s.sock.wantSeq.Load() &&
		!s.othersSleep(st) && !s.IsClosed()
}

// lendSocket leaves the socket to readers and waits until the receive loop
// has it again. It returns what a leader left: a frame to handle, or the
// error that ends the loop.
func (s *Session) lendSocket() (wire.Header, []byte, error) {
	t := &s.sock
	st := t.wanted.Swap(nil)
	t.free()
	// A reader that began to sleep while the loop held the socket did not
	// take it: read on for it. (It counted itself before it looked.)
	if (st == nil || s.othersSleep(st)) && t.held.CompareAndSwap(false, true) {
		return nil, nil, nil
	}
	closed := s.closed
	for {
		select {
		case <-t.back:
		case <-closed:
			closed = nil // a leader's read fails now: it hands the socket back
		}
		if t.toLoop.CompareAndSwap(true, false) {
			h, payload, err := t.h, t.payload, t.err
			t.h, t.payload, t.err = nil, nil, nil
			return h, payload, err
		}
		if t.held.CompareAndSwap(false, true) {
			return nil, nil, nil
		}
	}
}

// lead reads the socket for st's reader, about to sleep for its data, if
// the socket is free. It reports false, and leaves the reader to sleep, if
// not. Otherwise it returns once st was notified or the socket went back to
// the receive loop.
//
// A free socket is taken even when spinning pays: the receive loop, which
// would spin, waits for the socket to come back, so a reader that slept
// instead would wait for the lend timer (up to two lend periods) whenever
// its data came with a wake-up. gRPC's reader, waiting between the pieces of
// a large message, did so: with the lend period at 8 ms, 256 KiB – 1 MiB
// calls had a p99 of 7–14 ms instead of 2–3 ms.
func (s *Session) lead(st *Stream) bool {
	t := &s.sock
	if !t.held.CompareAndSwap(false, true) {
		if s.mayPoll() {
			// Spinning pays now: the receive loop, spinning after what it
			// harvests, catches the next message without a wake-up at all.
			return false
		}
		if s.sleepers.Load() == 1 {
			t.wantSeq.Store(st.delivered.Load())
			t.wanted.Store(st)
		}
		return false
	}
	s.leading = true
	for {
		t.blocked.Store(st)
		select {
		case <-st.readNotify:
			t.blocked.Store(nil)
			s.leading = false
			t.free()
			if s.sleepers.Load() > 1 { // st's reader counts itself still
				t.signal()
			}
			return true
		default:
		}
		h, payload, err := s.ec.readFrame(s.conf.MaxFallbackFrameSize)
		t.blocked.Store(nil)
		if err != nil {
			if isTimeout(err) && !s.IsClosed() {
				// Kicked: drain, then read on (as the receive loop does).
				_ = s.ec.conn.SetReadDeadline(time.Time{})
				s.cons.kicked.Store(false)
				if err = s.access(s.consumeNow); err == nil {
					continue
				}
			}
			s.handBack(nil, nil, err)
			return true
		}
		if h.Type() != wire.TypePolling {
			s.handBack(h, payload, nil)
			return true
		}
		if err := s.access(func() error { return s.handleFrameInOrder(h, payload) }); err != nil {
			s.handBack(nil, nil, err)
			return true
		}
		s.ec.shrink()
	}
}

// handBack gives the socket straight to the receive loop, with a frame for
// it to handle or the error that ends it.
func (s *Session) handBack(h wire.Header, payload []byte, err error) {
	t := &s.sock
	s.leading = false
	t.h, t.payload, t.err = h, payload, err
	t.toLoop.Store(true)
	t.signal()
}

package shmipc

import (
	"time"

	"github.com/goshm/shmipc/internal/shm"
)

// Busy polling: a reader that finds its stream empty consumes the queue
// itself, as the loop would, instead of parking until the loop hands it
// its data; when its data comes it is on a CPU already, and no thread is
// woken on the reply's way. It hands other streams their data as it goes,
// and stops before a close element (only the loop applies closes), when
// the loop asks for the token, when its stream is signalled (what would
// wake it if parked), at its deadline, and when its spin ends.

// poll polls the receive queue for st, whose mu the caller does not hold,
// until deadline at the latest. It reports false if it did not poll: the
// token was taken, another reader waits, or spinning does not pay now.
func (st *Stream) poll(deadline time.Time) bool {
	s := st.s
	if s.waiting.Load() > 0 || !s.tok.tryReader() {
		return false
	}
	if s.cons.budget <= 0 || !spinning.enter() {
		s.tok.giveBack() // the working flag was not touched
		return false
	}
	defer spinning.exit()
	var handOver bool
	err := s.access(func() (err error) { handOver, err = s.pollHeld(st, deadline); return })
	switch {
	case err != nil:
		s.closeWithError(err) // a fault has closed it already
		s.tok.giveBack()
	case handOver:
		if !s.tok.handOver() {
			s.ec.interrupt()
		}
	default:
		s.cons.slept = time.Now().UnixNano()
		s.tok.giveBack()
	}
	return true
}

// pollHeld is poll's work with the token, inside an access: drain and spin,
// then let go, or report that the loop must take over (and parked readers).
func (s *Session) pollHeld(st *Stream, deadline time.Time) (handOver bool, err error) {
	s.recvQ.SetWorking(true)
	now := time.Now()
	w := spinWatch{begin: now, last: now, lastYield: now, lastLook: now, alone: procs.get(now) == 1, reader: true}
	for {
		// At most a queue's worth at a time: a peer that keeps publishing
		// for other streams must not keep the reader from its own.
		_, stopped, err := s.drain(drainReader, int(s.recvQ.Cap()))
		if err != nil {
			return false, err
		}
		if stopped {
			return true, nil
		}
		if len(st.readNotify) > 0 {
			s.cons.hit()
			break
		}
		if s.IsClosed() {
			return false, nil
		}
		for range pollCheckEvery {
			if !s.recvQ.LooksEmpty() {
				break
			}
			shm.CPURelax()
		}
		if s.tok.wanted.Load() {
			return true, nil
		}
		if (!deadline.IsZero() && !time.Now().Before(deadline)) || w.check(s) == spinGaveUp {
			break
		}
	}
	for range 3 {
		if s.waiting.Load() > 0 || s.tok.wanted.Load() {
			return true, nil
		}
		if s.clearWorking() {
			return false, nil
		}
		// Something came just before the flag was cleared: take it too.
		if _, stopped, err := s.drain(drainReader, int(s.recvQ.Cap())); err != nil || stopped {
			return true, err
		}
	}
	return true, nil
}

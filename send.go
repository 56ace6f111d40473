package shmipc

import (
	"cmp"
	"errors"
	"fmt"
	"time"

	"github.com/goshm/shmipc/internal/shm"
)

// Waiting for space (back-pressure): the first pause, and the longest.
const (
	minSpacePause = 20 * time.Microsecond
	maxSpacePause = time.Millisecond
)

// putElem publishes e on the send queue and wakes the peer if it is not
// already draining. While the queue is full it waits (docs/protocol.md §7.6 lets
// a sender retry), until the stream st is closed or past its write
// deadline, or Config.WriteSpaceTimeout passes. It reports whether e was
// published. It runs inside an access, with st's writer lock held, which
// keeps st's reference on the queue region.
func (s *Session) putElem(e shm.Elem, st *Stream) (bool, error) {
	var wait spaceWait
	for {
		if err := s.sendable(); err != nil {
			return false, err
		}
		ok, err := s.sendQ.Put(e)
		if err != nil {
			s.closeWithError(err)
			return false, s.closedErr()
		}
		if ok {
			if s.sendQ.MarkWorking() {
				if err := s.wakePeer(e.ID); err != nil {
					return true, s.sendFailed("send wake-up", err)
				}
			} else {
				s.counters.of(e.ID).wakeupsSaved.Add(1)
			}
			return true, nil
		}
		if err := wait.pause(s, st, nil); err != nil {
			if err == errSpaceTimeout {
				return false, &spaceTimeout{msg: fmt.Sprintf("shmipc: IO queue full for %v: the peer is not consuming", wait.waited()), cause: ErrQueueFull}
			}
			return false, err
		}
	}
}

// wakePeer sends the peer, which has stopped draining its queue (the caller
// has just set the working flag for it), a Polling frame.
func (s *Session) wakePeer(id uint32) error {
	s.counters.of(id).wakeupsSent.Add(1)
	return s.ec.writePolling(s.version)
}

var errSpaceTimeout = errors.New("no space in time")

// spaceWait paces a writer that waits for the peer to free space: pauses
// that grow from minSpacePause to maxSpacePause, until the stream's write
// deadline (looked at before each pause) or Config.WriteSpaceTimeout.
type spaceWait struct {
	start time.Time
	delay time.Duration
	max   time.Duration // the longest pause; maxSpacePause if zero
}

// pause sleeps once, for the writer of st, or until wake (if not nil) is
// signalled. It returns errSpaceTimeout when the time is up, or the error
// that stops the writer (stream or session closed).
func (w *spaceWait) pause(s *Session, st *Stream, wake <-chan struct{}) error {
	now := time.Now()
	if w.start.IsZero() {
		s.counters.of(0).spaceWaits.Add(1)
		w.start, w.delay = now, minSpacePause
	}
	limit := w.start.Add(s.conf.WriteSpaceTimeout)
	// The deadline as it is now: moving it applies to a waiting writer.
	if d := st.wDeadline.Load(); d != nil && !d.IsZero() && d.Before(limit) {
		limit = *d
	}
	if err := st.writer.usable(); err != nil { // closed meanwhile
		return err
	}
	if err := st.writeDeadlineErr(); err != nil {
		return err
	}
	if !now.Before(limit) {
		return errSpaceTimeout
	}
	d := min(w.delay, limit.Sub(now))
	// Only the stream's writer (it holds the writer lock) uses its timer:
	// waiting allocates once.
	if st.spaceTimer == nil {
		st.spaceTimer = time.NewTimer(d)
	} else {
		st.spaceTimer.Reset(d)
	}
	t := st.spaceTimer
	select {
	case <-t.C:
	case <-wake:
		t.Stop()
	case <-s.closed:
		t.Stop()
		return s.closedErr()
	}
	w.delay = min(2*w.delay, cmp.Or(w.max, maxSpacePause))
	return nil
}

func (w *spaceWait) waited() time.Duration { return time.Since(w.start).Round(time.Millisecond) }

// sendFallbackFrame sends one FallbackData frame, bounded by the stream's
// write deadline (zero: none) too. A failed write ends the session, unless
// the deadline passed before any of the frame was written.
func (s *Session) sendFallbackFrame(id uint32, data [][]byte, deadline time.Time) error {
	if err := s.sendable(); err != nil {
		return err
	}
	if err := s.ec.writeFallback(s.version, id, data, deadline); err != nil {
		if errors.Is(err, ErrTimeout) && !errors.Is(err, errFrameTorn) {
			return err // nothing of the frame was written: only this write fails
		}
		return s.sendFailed("send fallback data", err)
	}
	return nil
}

// sendStreamClose tells the peer a stream is closed, inside an access: by a
// close element, or a StreamClose frame if the queue is full or the stream
// sends fallback data (lest the close overtake data on the socket).
func (s *Session) sendStreamClose(id uint32, byFrame bool) {
	if s.sendable() != nil {
		return
	}
	var queued bool
	var err error
	if !byFrame {
		if !s.queueRegion.Acquire() {
			return
		}
		queued, err = func() (bool, error) {
			// Released even when a fault in the queue unwinds from here (the
			// caller's access recovers it): a reference left would keep the
			// region mapped after the session.
			defer s.queueRegion.Release()
			ok, err := s.sendQ.Put(shm.Elem{ID: id, Status: shm.StatusClosed})
			if ok && s.sendQ.MarkWorking() {
				err = s.wakePeer(id)
			}
			return ok, err
		}()
	}
	if !queued && err == nil {
		err = s.ec.writeStreamClose(s.version, id)
	}
	if err != nil {
		_ = s.sendFailed(fmt.Sprintf("send close of stream %d", id), err)
	}
}

// freeSegments returns the shared-memory segments among segs to the buffer
// region. An error means the peer corrupted the region; the session is
// closed. It runs inside an access.
func (s *Session) freeSegments(segs []shm.Segment) error {
	for _, seg := range segs {
		if seg.List == shm.HeapSegment {
			continue
		}
		if err := s.buf.Push(int(seg.List), seg.Off); err != nil {
			s.closeWithError(err)
			return err
		}
	}
	return nil
}

package shmipc

import (
	"fmt"
	"time"

	"github.com/goshm/shmipc/internal/shm"
)

// grow appends a segment with room for want bytes (unless contiguous, for as
// much of want as one slice gives): a slice from the stream's kept slot or
// the free lists, after a wait for room in turn (shm.SpaceQueues) if need
// be, or heap memory for fallback data. It runs inside an access.
func (w *streamWriter) grow(want int, contiguous bool) error {
	st := w.st
	buf := st.s.buf
	if st.fallback.Load() || w.heap || buf.NeverFits(uint64(w.size+want), want, contiguous) {
		w.appendHeap(want)
		return nil
	}
	if li, off, ok := st.takeKept(want); ok {
		w.segs = append(w.segs, shm.Segment{Data: buf.SliceData(li, off), List: int32(li), Off: off})
		return nil
	}
	var wait spaceWait
	// A writer that holds no slice leaves each list's reserve to those that
	// do (shm.Buffer.Alloc), and waits for room in turn (shm.SpaceQueues),
	// unless it never waits.
	leave := len(w.segs) == 0 && !st.s.conf.FallbackWhenFull
	asked := false
	class, queued := -1, false
	quit := func() {
		if queued {
			buf.Space().Leave(class, st.spaceCh)
			queued = false
		}
	}
	// Deferred, so that a fault in alloc leaves the queue too: a writer left
	// in it would keep every later one of its class waiting.
	defer quit()
	join := func() {
		if st.spaceCh == nil {
			st.spaceCh = make(chan struct{}, 1)
		}
		select {
		case <-st.spaceCh: // a wake-up left over from an earlier wait
		default:
		}
		buf.Space().Join(class, st.spaceCh)
		queued = true
	}
	if leave && buf.Space().Waiting() {
		class = buf.Class(want, !contiguous)
		if buf.Space().Waiters(class) > 0 {
			// Others wait for this class: after them, unless the stream
			// holds received slices.
			asked = true
			if st.holdsReceived() {
				leave = false
			} else {
				join()
			}
		}
	}
	head := false
	for {
		if queued && !head && buf.Space().IsHead(class, st.spaceCh) {
			// Its turn: it looks for everyone in the queue, so it looks
			// often. Room the peer frees wakes nobody.
			head = true
			wait.delay, wait.max = minSpacePause, headSpacePause
		}
		if !queued || head {
			li, off, err := buf.Alloc(want, !contiguous, leave)
			if err != nil {
				st.s.closeWithError(err)
				return errorf("%w: %w", ErrSessionClosed, err)
			}
			if li >= 0 {
				w.segs = append(w.segs, shm.Segment{Data: buf.SliceData(li, off), List: int32(li), Off: off})
				return nil
			}
			if leave && !asked {
				// Short of room: does the stream hold received slices?
				asked = true
				if st.holdsReceived() {
					leave = false
					quit()
					continue
				}
			}
		}
		waitedLong := !wait.start.IsZero() && time.Since(wait.start) >= heldSpaceWait
		if st.s.conf.FallbackWhenFull || waitedLong && (len(w.segs) > 0 || st.holdsReceived()) {
			// A writer that holds slices, or whose reader does, waits only
			// briefly: writers holding slices while waiting for more could
			// hold the whole region between them and wait for ever. Most
			// shortages are parked slices, back within one look. Falling
			// back is not undone.
			w.appendHeap(want)
			return nil
		}
		if leave && !queued {
			class = buf.Class(want, !contiguous)
			join()
		}
		var wake <-chan struct{}
		if queued {
			wake = st.spaceCh
		}
		if err := wait.pause(st.s, st, wake); err != nil {
			if err == errSpaceTimeout {
				return &spaceTimeout{msg: fmt.Sprintf("shmipc: no shared memory for %d more bytes for %v: the peer is not releasing what it received", want, wait.waited())}
			}
			return err
		}
	}
}

const (
	// headSpacePause is the longest pause of the writer at the head of a
	// queue for room: the writers behind it do not look at all.
	headSpacePause = 50 * time.Microsecond
	// heldSpaceWait is how long a writer that holds part of its message
	// waits for more before the rest goes as fallback data: one look of the
	// region's creator (circulationPeriods.Look), which unparks slices.
	heldSpaceWait = 50 * time.Millisecond
)

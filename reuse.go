package shmipc

import "math"

// Slice reuse: a stream keeps one slice it received, once read, for the
// next message it sends.
//
// Without it, every message costs two operations on a free list shared by
// both processes: the receiver pushes the slices it has read, and the
// sender of the next message pops others. Those lists' heads and tails are
// cache lines that both processes write, and with many streams the two
// processes contend for them. In a request-reply exchange a stream instead
// keeps the slice of the message it just read and writes its next message
// in it: the same slice then goes back and forth on the stream without
// touching the free lists, and its data is already in the caches.
//
// Only slices of the smallest class are kept (small messages are where the
// list operations weigh), one per stream, and used only for a message
// piece that fits in one. A process's streams keep at most 1/keepShare of
// the class of a region between them, so that many open streams cannot
// starve the list. PROTOCOL.md §6.6 allows it: a peer may hold
// slices, and the root slice of a message may have been allocated by the
// other process (the reference implementations' stream pools do the same).
// A kept slice goes back to its list when the stream lets go of the buffer
// region (dropRef: Close, or the end of the session); until then it counts
// as in flight.

// keepShare: the streams of a process keep at most 1/keepShare of the
// smallest class of a region (307 of the 2457 slices of the default
// layout).
const keepShare = 8

// The kept slot of a stream: keptNone, keptShut once the stream has let go
// of the region, or the slice as keptValue encodes it.
const (
	keptNone uint64 = 0
	keptShut uint64 = math.MaxUint64
)

func keptValue(li int, off uint32) uint64 { return uint64(li)<<32 | uint64(off) }

func keptSlice(v uint64) (li int, off uint32) { return int(v >> 32), uint32(v) }

// freeReceived returns the shared-memory segments among segs, which the
// stream's reader has finished with, to the buffer region, keeping one
// slice of the smallest class for the stream's next message. It runs
// inside an access.
func (st *Stream) freeReceived(segs []segment) error {
	s, m := st.s, st.s.buf
	if st.kept.Load() != keptNone {
		return s.freeSegments(segs)
	}
	smallest := int32(m.bySize[0])
	for i, seg := range segs {
		if seg.list != smallest {
			continue
		}
		if m.kept.Add(1) > m.keepLimit {
			m.kept.Add(-1)
			break
		}
		if !st.kept.CompareAndSwap(keptNone, keptValue(int(seg.list), seg.off)) {
			m.kept.Add(-1)
			break
		}
		if err := s.freeSegments(segs[:i]); err != nil {
			return err
		}
		return s.freeSegments(segs[i+1:])
	}
	return s.freeSegments(segs)
}

// takeKept hands the kept slice to a writer that needs room for want more
// bytes, if it holds them.
func (st *Stream) takeKept(want int) (li int, off uint32, ok bool) {
	v := st.kept.Load()
	if v == keptNone || v == keptShut {
		return 0, 0, false
	}
	li, off = keptSlice(v)
	if want > int(st.s.buf.lists[li].sliceCap) || !st.kept.CompareAndSwap(v, keptNone) {
		return 0, 0, false
	}
	st.s.buf.kept.Add(-1)
	return li, off, true
}

// dropKept returns the kept slice to its list for good: the stream keeps
// none from now on.
func (st *Stream) dropKept() {
	v := st.kept.Swap(keptShut)
	if v == keptNone || v == keptShut {
		return
	}
	st.s.buf.kept.Add(-1)
	li, off := keptSlice(v)
	_ = st.s.access(func() error {
		if err := st.s.buf.push(li, off); err != nil {
			st.s.closeWithError(err)
			return err
		}
		return nil
	})
}

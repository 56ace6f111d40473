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
// piece that fits in one. At most 1/keepShare of the class of a region may
// be kept by a process's streams, so that many open streams cannot starve
// the list. PROTOCOL.md §6.6 allows it: a peer may hold
// slices, and the root slice of a message may have been allocated by the
// other process (the reference implementations' stream pools do the same).
// A kept slice goes back to its list when the stream lets go of the buffer
// region (dropRef: Close, or the end of the session), when the peer closes
// the stream (peerClose: it sends nothing more), and, for a session closed
// locally, before its connection closes (dropAllKept), since a peer may
// count its free lists as soon as it sees the end. Until then it counts as
// in flight.

// keepShare: at most 1/keepShare of the smallest class of a region may be
// kept by the streams of a process (307 of the 2457 slices of the default
// layout). A stream asks once, when it first has a slice to keep, and holds
// its permission until it lets go of the region, so that the count shared
// by the process's streams is not touched per message.
const keepShare = 8

// The kept slot of a stream: keptNone until it may keep a slice, keptFree
// while it may and holds none, keptShut once it has let go of the region,
// or the slice it holds as keptValue encodes it (never 0 or 1: a slice
// header lies at offset 44 or beyond).
const (
	keptNone uint64 = 0
	keptFree uint64 = 1
	keptShut uint64 = math.MaxUint64
)

func keptValue(li int, off uint32) uint64 { return uint64(li)<<32 | uint64(off) }

func keptSlice(v uint64) (li int, off uint32) { return int(v >> 32), uint32(v) }

// holdsSlice reports whether slot value v is a kept slice.
func holdsSlice(v uint64) bool { return v != keptNone && v != keptFree && v != keptShut }

// freeReceived returns the shared-memory segments among segs, which the
// stream's reader has finished with, to the buffer region, keeping one
// slice of the smallest class for the stream's next message. It runs
// inside an access, with st.mu held.
func (st *Stream) freeReceived(segs []segment) error {
	s := st.s
	v := st.kept.Load()
	if v != keptNone && v != keptFree {
		return s.freeSegments(segs)
	}
	smallest := int32(s.buf.bySize[0])
	for i, seg := range segs {
		if seg.list != smallest {
			continue
		}
		if v == keptNone && !st.mayKeep() {
			break
		}
		if !st.kept.CompareAndSwap(keptFree, keptValue(int(seg.list), seg.off)) {
			break // the stream let go of the region meanwhile
		}
		if err := s.freeSegments(segs[:i]); err != nil {
			return err
		}
		return s.freeSegments(segs[i+1:])
	}
	return s.freeSegments(segs)
}

// mayKeep asks for the stream's permission to keep slices, within the
// process's share of the region, and reports whether it has it.
func (st *Stream) mayKeep() bool {
	m := st.s.buf
	if m.keepers.Add(1) > m.keepLimit {
		m.keepers.Add(-1)
		return false
	}
	if !st.kept.CompareAndSwap(keptNone, keptFree) {
		m.keepers.Add(-1) // the stream let go of the region meanwhile
		return false
	}
	return true
}

// takeKept hands the kept slice to a writer that needs room for want more
// bytes, if it holds them.
func (st *Stream) takeKept(want int) (li int, off uint32, ok bool) {
	v := st.kept.Load()
	if !holdsSlice(v) {
		return 0, 0, false
	}
	li, off = keptSlice(v)
	if want > int(st.s.buf.lists[li].sliceCap) || !st.kept.CompareAndSwap(v, keptFree) {
		return 0, 0, false
	}
	st.s.buf.unhold(li, off) // now this process's own, to be sent
	return li, off, true
}

// dropKept returns the kept slice to its list and the stream's permission
// to the process, for good: the stream keeps none from now on.
func (st *Stream) dropKept() {
	if li, off, ok := st.shutKept(); ok {
		_ = st.s.access(func() error { return st.s.freeSegments([]segment{{list: int32(li), off: off}}) })
	}
}

// shutKept shuts the stream's kept slot for good, gives back its permission
// to keep, and returns the slice it held, if any, for the caller to free.
func (st *Stream) shutKept() (li int, off uint32, ok bool) {
	v := st.kept.Swap(keptShut)
	if v == keptNone || v == keptShut {
		return 0, 0, false
	}
	st.s.buf.keepers.Add(-1)
	if !holdsSlice(v) {
		return 0, 0, false
	}
	li, off = keptSlice(v)
	return li, off, true
}

// dropAllKept returns the slices kept by the session's streams to their
// lists as the session ends, before its connection closes, so that the peer
// finds them free when it sees the end. It runs inside closeWithError, so
// it cannot end the session on a fault or a corrupt list as an access
// would: either ends the work quietly.
func (s *Session) dropAllKept() {
	s.mu.Lock()
	streams := make([]*Stream, 0, len(s.streams))
	for _, st := range s.streams {
		streams = append(streams, st)
	}
	s.mu.Unlock()
	quietly(func() {
		for _, st := range streams {
			if li, off, ok := st.shutKept(); ok {
				if s.buf.push(li, off) != nil {
					return
				}
			}
		}
	})
}

package shmipc

import (
	"math"

	"github.com/goshm/shmipc/internal/shm"
)

// Slice reuse: a stream keeps one slice it received, once read, for the
// next message it sends, so that a request-reply exchange passes one slice
// back and forth instead of pushing and popping on free lists both
// processes write. docs/protocol.md §9.6 allows it: a peer may hold slices, and
// the root slice of a message may have been allocated by the other process.
//
// Only slices up to keepMaxCap are kept, used only for a message piece that
// fits in one. A stream holds permission to keep slices of one class, and at
// most 1/keepShare of a class may be kept by a process's streams, so that
// many open streams cannot starve its list.
//
// A kept slice goes back when the stream lets go of the buffer region
// (dropRef), when the peer closes the stream (peerClose), and, for a session
// closed locally, before its connection closes (dropAllKept), since a peer
// may count its free lists as soon as it sees the end.

// The kept slot of a stream: keptNone until it may keep a slice, keptShut
// once it has let go of the region, keptFreeFor(li) while it may keep
// slices of list li and holds none, or the slice it holds as keptValue
// encodes it. The low word tells them apart: 0 none, 1 free, a slice
// header's offset (44 or beyond) for a slice; the high word is the list.
const (
	keptNone uint64 = 0
	keptShut uint64 = math.MaxUint64
)

func keptValue(li int, off uint32) uint64 { return uint64(li)<<32 | uint64(off) }

func keptFreeFor(li int) uint64 { return keptValue(li, 1) }

func keptSlice(v uint64) (li int, off uint32) { return int(v >> 32), uint32(v) }

// holdsSlice reports whether slot value v is a kept slice.
func holdsSlice(v uint64) bool { return v != keptShut && uint32(v) > 1 }

// freeReceived frees the segments among segs, which the stream's reader has
// finished with, keeping one slice of a keepable class for the stream's next
// message; a slice of another class replaces the permission it held. It
// runs inside an access, with st.mu held.
func (st *Stream) freeReceived(segs []shm.Segment) error {
	s := st.s
	v := st.kept.Load()
	if v == keptShut {
		return s.freeSegments(segs)
	}
	for i, seg := range segs {
		if !s.buf.Keepable(seg.List) {
			continue
		}
		li := int(seg.List)
		if v != keptNone && int(v>>32) == li {
			if holdsSlice(v) {
				break // it holds one of this class already
			}
		} else if v != keptNone {
			// Permission, and maybe a slice, of another class: give them
			// up for this one, which the stream's messages now come in.
			if !st.kept.CompareAndSwap(v, keptNone) {
				break // taken by the writer, or the stream let go of the region
			}
			s.buf.Unkeep(int(v >> 32))
			if holdsSlice(v) {
				oli, ooff := keptSlice(v)
				if err := s.freeSegments([]shm.Segment{{List: int32(oli), Off: ooff}}); err != nil {
					return err
				}
			}
			v = keptNone
		}
		if v == keptNone && !st.mayKeep(li) {
			break
		}
		if !st.kept.CompareAndSwap(keptFreeFor(li), keptValue(li, seg.Off)) {
			break // the stream let go of the region meanwhile
		}
		shm.PrefetchForWrite(seg.Data)
		if err := s.freeSegments(segs[:i]); err != nil {
			return err
		}
		return s.freeSegments(segs[i+1:])
	}
	return s.freeSegments(segs)
}

// mayKeep asks for the stream's permission to keep slices of list li,
// within the process's share of the list, and reports whether it has it.
func (st *Stream) mayKeep(li int) bool {
	m := st.s.buf
	if !m.MayKeep(li) {
		return false
	}
	if !st.kept.CompareAndSwap(keptNone, keptFreeFor(li)) {
		m.Unkeep(li) // the stream let go of the region meanwhile
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
	if want > st.s.buf.SliceCap(li) || !st.kept.CompareAndSwap(v, keptFreeFor(li)) {
		return 0, 0, false
	}
	st.s.buf.Unhold(li, off) // now this process's own, to be sent
	return li, off, true
}

// dropKept returns the kept slice to its list and the stream's permission
// to the process, for good.
func (st *Stream) dropKept() {
	if li, off, ok := st.shutKept(); ok {
		_ = st.s.access(func() error { return st.s.freeSegments([]shm.Segment{{List: int32(li), Off: off}}) })
	}
}

// shutKept shuts the stream's kept slot for good, gives back its permission
// to keep, and returns the slice it held, if any, for the caller to free.
func (st *Stream) shutKept() (li int, off uint32, ok bool) {
	v := st.kept.Swap(keptShut)
	if v == keptNone || v == keptShut {
		return 0, 0, false
	}
	st.s.buf.Unkeep(int(v >> 32))
	li, off = keptSlice(v)
	return li, off, holdsSlice(v)
}

// dropAllKept returns the slices kept by the session's streams to their
// lists before its connection closes. It runs inside closeWithError, so a
// fault or a corrupt list ends the work quietly instead of the session.
func (s *Session) dropAllKept() {
	streams := s.streamList()
	shm.Quietly(func() {
		for _, st := range streams {
			if li, off, ok := st.shutKept(); ok {
				if s.buf.Push(li, off) != nil {
					return
				}
			}
		}
	})
}

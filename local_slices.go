package shmipc

import (
	"runtime"
	"sync/atomic"
)

// Local slices: between two sessions of one process (paired, spin.go), a
// large slice that a stream has read waits on the processor it was read on
// for the next large message written there.
//
// A writer of a paired session hands its message over on its own
// processor, so the reader reads it there, and in a request-reply exchange
// the reply is written there too, into a slice the writer takes. From the
// free list, that slice is whichever one the FIFO list has rotated to: one
// written and read some round trips ago, on either processor. For small
// messages a stream keeps the slice it read (reuse.go), so its data stays
// in the caches of the processor the stream runs on. Large slices are not
// kept by streams (keepMaxCap): there are few of them, and a stream that
// moves to the other processor (a paired stream yields for fairness now
// and then, stream.go) would take its slices' megabytes with it; keeping
// them that way, while readers yielded after every large message, made 8
// streams of 1 MB in one process half again as slow in the VM state where
// data crossing between the cores is dear. Slices left per processor
// instead stay where their data is, whichever stream comes to use them.
//
// On the 2-vCPU AMD EPYC VM, 8 streams in one process (BenchmarkPingPong,
// 0.4-0.5 s runs alternating with the build before, each tagged by a C
// busy-spin probe; readers still yielding after every large message) took
// per round trip, in the state where data crossing between the cores is
// dear: 256 KB 5.9-6.1 µs against 15.4-16.5 µs, 512 KB 12.4-13.0 against
// 36.2-39.2, 1 MB 25.7-27.9 against 79.9-88.1, 4 MB 110-124 against
// 349-374; in the other state 256 KB 3.6 against 5.6, 512 KB 7.1 against
// 8.8, 1 MB 14.3 against 16.4. So the two states differed by less than 2x,
// against 3-5x before. A writer found its slice in the slots for 96-100 %
// of the messages of 8 streams of 256 KB to 4 MB.
//
// Each processor has localDepth slots (a request-reply exchange writes
// two messages per round trip, and reads and frees two). A slice in a slot
// stays held (bufferManager.held), as a kept slice does, until a writer
// takes it. A manager's slots hold at most 1/localShare of each list, so
// that writers of the peer's manager (the other session of the pair maps
// the region apart) always find most of the list. They are used only while
// no writer of the process waits for room (space_queue.go): room goes
// round the queue in turn, and a writer that took from a slot would jump
// it (64 streams of 1 MB: the slowest made 0.4 % of the fastest one's round
// trips). A writer that finds the lists empty takes from any processor's
// slots before it waits. The slots are emptied onto the lists when the
// last paired stream using the manager lets go of the region, and when a
// session using it ends, so that closing every stream gives back every
// slice.
//
// The processor is the hardware's (currentCPU), not the Go runtime's: what
// matters is whose caches hold the data. Where it cannot be read cheaply
// every thread uses the same slots, which still hands back the slice
// freed last, the one most likely to be in the caches.
const (
	localDepth = 2
	localShare = 8
)

// cpuSlices are the slots of one processor, a cache line of their own: each
// holds a slice as keptValue encodes it (reuse.go), or 0.
type cpuSlices struct {
	slot [localDepth]atomic.Uint64
	_    [64 - 8*localDepth]byte
}

// localSlots are a manager's slots: one set per processor (rounded up to a
// power of two, at most 256; processors beyond share a set), and per list
// the count of its slices in them. A manager gets them with its first
// paired stream (localOpen): most managers serve sessions with other
// processes only, and on a machine of many processors the slots take
// kilobytes.
type localSlots struct {
	cpus  []cpuSlices
	count []atomic.Int32
}

// initLocal sets the limits of the lists whose slices streams do not keep.
func (m *bufferManager) initLocal() {
	for i := range m.lists {
		if l := &m.lists[i]; l.sliceCap > keepMaxCap {
			l.localLimit = int32(l.count / localShare)
		}
	}
}

// localOpen counts a paired stream that may use the local slots, and sets
// the slots up for the first.
func (m *bufferManager) localOpen() {
	m.localStreams.Add(1)
	if m.local.Load() != nil {
		return
	}
	n := 1
	for n < runtime.NumCPU() && n < 256 {
		n <<= 1
	}
	m.local.CompareAndSwap(nil, &localSlots{cpus: make([]cpuSlices, n), count: make([]atomic.Int32, len(m.lists))})
}

// localClose uncounts a paired stream; the last one empties the slots. It
// runs inside an access (push touches the lists).
func (m *bufferManager) localClose() error {
	if m.localStreams.Add(-1) == 0 {
		return m.drainLocal()
	}
	return nil
}

// putLocal puts the slice at off of list li, which a paired stream has
// read, in the current processor's slots, and reports whether it did.
// The slice stays held. The caller counts as a paired stream (localOpen).
func (m *bufferManager) putLocal(li int, off uint32) (bool, error) {
	ls := m.local.Load()
	if ls == nil || m.lists[li].localLimit == 0 || m.space.waiting.Load() > 0 {
		return false, nil
	}
	if ls.count[li].Add(1) > m.lists[li].localLimit {
		ls.count[li].Add(-1)
		return false, nil
	}
	c := &ls.cpus[currentCPU()&(len(ls.cpus)-1)]
	v := keptValue(li, off)
	for i := range c.slot {
		if c.slot[i].CompareAndSwap(0, v) {
			// The last paired stream may have let go meanwhile, its
			// drain not seeing this slot: then empty it again. (Either
			// that drain sees the slot, or this sees the count at 0.)
			if m.localStreams.Load() == 0 {
				return true, m.drainLocal()
			}
			return true, nil
		}
	}
	ls.count[li].Add(-1)
	return false, nil
}

// takeLocal takes from the current processor's slots a slice of at least
// want bytes, for a writer of a paired stream; not while writers wait for
// room, whose turn it would take.
func (m *bufferManager) takeLocal(want int) (li int, off uint32, ok bool) {
	ls := m.local.Load()
	if ls == nil || m.space.waiting.Load() > 0 {
		return 0, 0, false
	}
	return m.takeLocalAt(ls, currentCPU(), want)
}

// stealLocal takes a slice of at least want bytes from any processor's
// slots, for a writer that found the lists short.
func (m *bufferManager) stealLocal(want int) (li int, off uint32, ok bool) {
	ls := m.local.Load()
	if ls == nil {
		return 0, 0, false
	}
	for cpu := range ls.cpus {
		if li, off, ok = m.takeLocalAt(ls, cpu, want); ok {
			return li, off, true
		}
	}
	return 0, 0, false
}

// takeLocalAt takes a slice of at least want bytes from the slots of
// processor cpu, and makes it this process's own to send (unheld).
func (m *bufferManager) takeLocalAt(ls *localSlots, cpu, want int) (li int, off uint32, ok bool) {
	c := &ls.cpus[cpu&(len(ls.cpus)-1)]
	for i := range c.slot {
		v := c.slot[i].Load()
		if v == 0 {
			continue
		}
		li, off = keptSlice(v)
		if want > int(m.lists[li].sliceCap) || !c.slot[i].CompareAndSwap(v, 0) {
			continue
		}
		ls.count[li].Add(-1)
		m.unhold(li, off)
		return li, off, true
	}
	return 0, 0, false
}

// drainLocal pushes every slice in the slots back on its list. It runs
// inside an access, or quietly as a session ends.
func (m *bufferManager) drainLocal() error {
	ls := m.local.Load()
	if ls == nil {
		return nil
	}
	for c := range ls.cpus {
		for i := range ls.cpus[c].slot {
			v := ls.cpus[c].slot[i].Swap(0)
			if v == 0 {
				continue
			}
			li, off := keptSlice(v)
			ls.count[li].Add(-1)
			if err := m.push(li, off); err != nil {
				return err
			}
		}
	}
	return nil
}

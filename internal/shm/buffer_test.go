package shm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
)

// Unit tests of the buffer manager (buffer.go) on regions in Go memory:
// the free lists, size classes, allocation and the checks of readChain.

// bufTestPlans are three small lists, laid out largest first so that the
// size classes cannot follow region order by accident.
var bufTestPlans = []ListPlan{{SliceCap: 256, Count: 2}, {SliceCap: 16, Count: 4}, {SliceCap: 64, Count: 3}}

// listOf returns the index of the list whose slices hold sliceCap bytes.
func listOf(t *testing.T, m *Buffer, sliceCap uint32) int {
	t.Helper()
	for i, l := range m.lists {
		if l.sliceCap == sliceCap {
			return i
		}
	}
	t.Fatalf("no list of %d-byte slices", sliceCap)
	return -1
}

func counterOf(m *Buffer, li int, field uint32) int32 {
	return int32(binary.LittleEndian.Uint32(m.mem[m.lists[li].header+field:]))
}

func TestBufferManagerLayout(t *testing.T) {
	m, peer := newHeapBuffer(t, bufTestPlans...)
	if len(m.lists) != len(bufTestPlans) {
		t.Fatalf("%d lists, want %d", len(m.lists), len(bufTestPlans))
	}
	var capacity uint64
	for i, p := range bufTestPlans {
		l := m.lists[i]
		if l.sliceCap != p.SliceCap || l.count != p.Count {
			t.Errorf("list %d: %d slices of %d bytes, want %d of %d", i, l.count, l.sliceCap, p.Count, p.SliceCap)
		}
		capacity += uint64(p.Count-1) * uint64(p.SliceCap)
	}
	if m.capacity != capacity || peer.capacity != capacity {
		t.Errorf("capacity %d (mapper %d), want %d: the last slice of each list is never handed out", m.capacity, peer.capacity, capacity)
	}
	if m.maxSliceCap() != 256 || m.usable != 256 {
		t.Errorf("largest slice %d, largest usable %d; want 256, 256", m.maxSliceCap(), m.usable)
	}
	if got := fmt.Sprint(m.freeCounts()); got != "[2 4 3]" {
		t.Errorf("free counts %s, want [2 4 3]", got)
	}
}

// TestBufferPopPush: a list hands out all its slices but the last, a pushed
// slice goes to the back of the list, and both processes see one list.
func TestBufferPopPush(t *testing.T) {
	m, peer := newHeapBuffer(t, bufTestPlans...)
	li := listOf(t, m, 16)
	l := m.lists[li]
	seen := map[uint32]bool{}
	var got []uint32
	for range l.count - 1 {
		off, err := m.Pop(li)
		if err != nil || off == 0 {
			t.Fatalf("pop %d of %d: offset %d, %v", len(got)+1, l.count-1, off, err)
		}
		if at, err := m.locate(off); err != nil || at != li {
			t.Fatalf("pop returned offset %d, in list %d (%v), want a slice of list %d", off, at, err, li)
		}
		if seen[off] {
			t.Fatalf("pop returned the slice at %d twice", off)
		}
		seen[off] = true
		got = append(got, off)
	}
	if off, err := m.Pop(li); off != 0 || err != nil {
		t.Fatalf("pop with one slice left: offset %d, %v; want 0: the last slice stays", off, err)
	}
	if f := peer.freeCounts()[li]; f != 1 {
		t.Errorf("the mapper sees %d free slices, want 1", f)
	}
	if c, p := counterOf(m, li, creatorCounter), counterOf(m, li, mapperCounter); c != int32(l.count-1) || p != 0 {
		t.Errorf("creator counter %d, mapper counter %d; want %d, 0", c, p, l.count-1)
	}
	last := l.area + (l.count-1)*l.stride // the slice no pop handed out

	// The mapper frees two slices; the creator gets the old last slice
	// first, then the first one freed; the second freed stays.
	for _, off := range got[:2] {
		if err := peer.Push(li, off); err != nil {
			t.Fatalf("push %d: %v", off, err)
		}
	}
	if c := counterOf(m, li, mapperCounter); c != -2 {
		t.Errorf("mapper counter %d after two pushes, want -2", c)
	}
	for _, want := range []uint32{last, got[0]} {
		if off, err := m.Pop(li); off != want || err != nil {
			t.Fatalf("pop after the pushes: offset %d, %v; want %d (first in, first out)", off, err, want)
		}
	}
	if off, _ := m.Pop(li); off != 0 {
		t.Fatalf("pop with one slice left returned %d", off)
	}
}

// TestBufferAllocSizeClasses: alloc takes the smallest slice that holds n,
// then larger ones, and smaller ones only when the message may be split.
func TestBufferAllocSizeClasses(t *testing.T) {
	m, _ := newHeapBuffer(t, bufTestPlans...)
	capOf := func(n int, split bool) uint32 {
		t.Helper()
		li, off, err := m.Alloc(n, split, false)
		if err != nil {
			t.Fatalf("alloc(%d, %v): %v", n, split, err)
		}
		if li < 0 {
			return 0
		}
		if at, err := m.locate(off); err != nil || at != li {
			t.Fatalf("alloc(%d, %v) returned list %d and offset %d, in list %d (%v)", n, split, li, off, at, err)
		}
		if got := len(m.SliceData(li, off)); got != int(m.lists[li].sliceCap) {
			t.Fatalf("slice data of %d bytes in a list of %d-byte slices", got, m.lists[li].sliceCap)
		}
		return m.lists[li].sliceCap
	}
	expect := func(n int, split bool, want uint32) {
		t.Helper()
		if got := capOf(n, split); got != want {
			t.Errorf("alloc(%d, split %v) gave a %d-byte slice, want %d", n, split, got, want)
		}
	}
	expect(257, false, 0)  // larger than every slice, and not to be split
	expect(1, false, 16)   // 16: 2 left
	expect(16, false, 16)  // 1 left
	expect(17, false, 64)  // 64: 1 left
	expect(65, false, 256) // 256: none left
	expect(300, true, 64)  // split: the largest smaller slice left
	expect(200, false, 0)  // no slice of 200 or more left
	expect(8, false, 16)   // 16: none left
	expect(8, false, 0)    // nothing left at all
	expect(8, true, 0)     // not even split
	expect(1000, true, 0)  // nor from the top
	if got := fmt.Sprint(m.freeCounts()); got != "[1 1 1]" {
		t.Errorf("free counts after exhaustion %s, want [1 1 1]", got)
	}
}

// TestBufferExhaustion: two processes allocating at once get every usable
// slice exactly once, and freeing them all restores the lists.
func TestBufferExhaustion(t *testing.T) {
	m, peer := newHeapBuffer(t, ListPlan{SliceCap: 16, Count: 200}, ListPlan{SliceCap: 64, Count: 100})
	initial := fmt.Sprint(m.freeCounts())
	var mu sync.Mutex
	owner := map[uint32]int{}
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	held := make([][]Segment, 2)
	for side, bm := range []*Buffer{m, peer} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				li, off, err := bm.Alloc(1, true, false)
				if err != nil {
					errs <- err
					return
				}
				if li < 0 {
					return
				}
				mu.Lock()
				prev, dup := owner[off]
				owner[off] = side
				mu.Unlock()
				if dup {
					errs <- fmt.Errorf("slice at %d handed to side %d and to side %d", off, prev, side)
					return
				}
				held[side] = append(held[side], Segment{List: int32(li), Off: off})
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if want := 199 + 99; len(owner) != want {
		t.Errorf("%d slices handed out, want %d", len(owner), want)
	}
	for side, bm := range []*Buffer{peer, m} { // each frees what the other took
		for _, s := range held[1-side] {
			if err := bm.Push(int(s.List), s.Off); err != nil {
				t.Fatal(err)
			}
		}
	}
	if got := fmt.Sprint(m.freeCounts()); got != initial {
		t.Errorf("free counts %s after freeing everything, want %s", got, initial)
	}
	if li, off, err := m.Alloc(64, false, false); li < 0 || err != nil {
		t.Errorf("alloc after freeing everything: list %d offset %d, %v", li, off, err)
	}
}

// TestBufferCorruptFreeList: a free list whose head, links or tail lead off
// its slices fails pop, alloc and push with ErrProtocol and leaves the free
// count as it was.
func TestBufferCorruptFreeList(t *testing.T) {
	le := binary.LittleEndian
	t.Run("head not a slice", func(t *testing.T) {
		m, _ := newHeapBuffer(t, bufTestPlans...)
		li := listOf(t, m, 16)
		le.PutUint32(m.mem[m.lists[li].header+listHeadOff:], m.lists[li].stride+4)
		if off, err := m.Pop(li); off != 0 || !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "head") {
			t.Errorf("pop: offset %d, %v; want ErrProtocol about the head", off, err)
		}
		if li2, _, err := m.Alloc(1, false, false); !errors.Is(err, ErrProtocol) || li2 != li {
			t.Errorf("alloc: list %d, %v; want ErrProtocol from list %d", li2, err, li)
		}
		if f := m.freeCounts()[li]; f != 4 {
			t.Errorf("free count %d after failed pops, want 4", f)
		}
	})
	t.Run("free slice links off the list", func(t *testing.T) {
		m, _ := newHeapBuffer(t, bufTestPlans...)
		li := listOf(t, m, 16)
		l := m.lists[li]
		le.PutUint32(m.mem[l.area+sliceNextOff:], l.count*l.stride) // one past the last slice
		if off, err := m.Pop(li); off != 0 || !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "links") {
			t.Errorf("pop: offset %d, %v; want ErrProtocol about the link", off, err)
		}
		if f := m.freeCounts()[li]; f != 4 {
			t.Errorf("free count %d after a failed pop, want 4", f)
		}
	})
	t.Run("tail not a slice", func(t *testing.T) {
		m, _ := newHeapBuffer(t, bufTestPlans...)
		li := listOf(t, m, 16)
		off, err := m.Pop(li)
		if err != nil || off == 0 {
			t.Fatalf("pop: %d, %v", off, err)
		}
		le.PutUint32(m.mem[m.lists[li].header+listTailOff:], 0xFFFFFF00)
		if err := m.Push(li, off); !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "tail") {
			t.Errorf("push: %v; want ErrProtocol about the tail", err)
		}
		if f := m.freeCounts()[li]; f != 3 {
			t.Errorf("free count %d after a failed push, want 3", f)
		}
	})
}

// TestNewBufferManagerRejects: a layout that does not fit the mapping is
// refused before anything is read through it.
func TestNewBufferManagerRejects(t *testing.T) {
	le := binary.LittleEndian
	size := int(bufferRegionSize(bufTestPlans))
	cases := []struct {
		name   string
		size   int
		damage func(mem []byte)
		want   string
	}{
		{"no room for the header", 4, nil, "no header"},
		{"no lists", size, func(b []byte) { le.PutUint16(b, 0) }, "no lists"},
		{"used beyond the region", size, func(b []byte) { le.PutUint32(b[4:], uint32(size)) }, "claims"},
		{"more list headers than used bytes", size, func(b []byte) { le.PutUint16(b, 0xFFFF) }, "claims"},
		{"list with no slices", size, func(b []byte) { le.PutUint32(b[BufferHeaderSize+listCountOff:], 0) }, "no slices"},
		{"slice size not a multiple of 4", size, func(b []byte) { le.PutUint32(b[BufferHeaderSize+listCapOff:], 254) }, "multiple of 4"},
		{"list past the used bytes", size, func(b []byte) { le.PutUint32(b[bufferRegionSize(bufTestPlans[:2])+listCountOff:], 4) }, "past"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			mem := alignedBytes(max(tc.size, BufferHeaderSize))[:tc.size]
			if tc.size >= BufferHeaderSize {
				InitBuffer(mem, bufTestPlans)
			}
			if tc.damage != nil {
				tc.damage(mem)
			}
			if _, err := NewBuffer(RegionOf(mem), false); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("newBufferManager: %v; want an error saying %q", err, tc.want)
			}
		})
	}
	t.Run("two lists of one size", func(t *testing.T) {
		plans := []ListPlan{{SliceCap: 64, Count: 2}, {SliceCap: 64, Count: 3}}
		mem := alignedBytes(int(bufferRegionSize(plans)))
		InitBuffer(mem, plans)
		if _, err := NewBuffer(RegionOf(mem), false); err == nil || !strings.Contains(err.Error(), "two lists") {
			t.Errorf("newBufferManager: %v; want an error about two lists of one size", err)
		}
	})
}

// A writer that finds the large lists empty splits its message over
// smaller slices, but not into slices far smaller than the message.
func TestAllocSplitsNoFinerThanAnEighth(t *testing.T) {
	const sqSize = 256 << 10
	m := createTestBuffer(t, 4<<20, DefaultPeriods(), ListPlan{4096, 509}, ListPlan{sqSize, 7}) // half and half
	small, large := m.bySize[0], m.bySize[1]
	// Take every large slice that can be handed out.
	var held []uint32
	for {
		li, off, err := m.Alloc(sqSize, false, false)
		if err != nil {
			t.Fatal(err)
		}
		if li < 0 {
			break
		}
		if li != large {
			t.Fatalf("a contiguous %d bytes came from list %d", sqSize, li)
		}
		held = append(held, off)
	}
	if len(held) == 0 {
		t.Fatal("no large slice could be taken")
	}
	smallCap := int(m.lists[small].sliceCap)
	for _, tc := range []struct {
		n    int
		want int // list, -1 for none
	}{
		{sqSize, -1},                          // 4 KiB is 1/64 of it
		{maxSplitPieces * smallCap, small},    // exactly an eighth
		{maxSplitPieces * (smallCap + 1), -1}, // just over
		{smallCap / 2, small},
	} {
		li, off, err := m.Alloc(tc.n, true, false)
		if err != nil {
			t.Fatal(err)
		}
		if li != tc.want {
			t.Errorf("alloc(%d, split) took list %d, want %d", tc.n, li, tc.want)
		}
		if li >= 0 {
			if err := m.Push(li, off); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, off := range held {
		if err := m.Push(large, off); err != nil {
			t.Fatal(err)
		}
	}
}

// A writer that holds nothing begins a message that needs several slices
// only when the lists it may split it over have room for all of it beyond
// their reserves; once it holds the first slice it may take the reserves.
func TestAllocBeginsSplitMessageOnlyWithRoomForAll(t *testing.T) {
	const small, big = 128 << 10, 1 << 20
	m := createTestBuffer(t, 16<<20, DefaultPeriods(), ListPlan{small, 63}, ListPlan{big, 7}) // half and half
	sl, bl := m.bySize[0], m.bySize[1]
	spare := func() int32 {
		l := &m.lists[sl]
		return shmLoadInt32(m.i32(l.header+listFreeOff)) + m.circ.lists[sl].parked.Load() - l.reserve - 1
	}
	type held struct {
		li  int
		off uint32
	}
	var taken []held
	t.Cleanup(func() {
		for _, h := range taken {
			if err := m.Push(h.li, h.off); err != nil {
				t.Error(err)
			}
		}
	})
	take := func(n int, split bool) int {
		li, off, err := m.Alloc(n, split, false)
		if err != nil {
			t.Fatal(err)
		}
		if li >= 0 {
			taken = append(taken, held{li, off})
		}
		return li
	}
	for take(big, false) == bl { // every big slice
	}
	for spare() > 4 {
		if take(small, false) != sl {
			t.Fatal("no small slice left")
		}
	}
	// Room for 4 small slices: half of a big message.
	li, off, err := m.Alloc(big, true, true)
	if err != nil || li >= 0 {
		if li >= 0 {
			taken = append(taken, held{li, off})
		}
		t.Fatalf("a writer holding nothing began a %d-byte message with room for %d: list %d, %v", big, 4*m.lists[sl].sliceCap, li, err)
	}
	if li, off, err = m.Alloc(4*int(m.lists[sl].sliceCap), true, true); err != nil || li != sl {
		t.Fatalf("a message that fits the room: list %d, %v", li, err)
	}
	taken = append(taken, held{li, off})
	// A writer that holds slices takes the rest, reserve included.
	for take(big, true) == sl {
	}
	if got, want := spare(), -m.lists[sl].reserve; got != want {
		t.Fatalf("a writer holding slices left %d spare slices, want %d (none of the reserve)", got, want)
	}
}

// createTestBuffer creates a memfd buffer region of size bytes laid out as
// plans, with circulation control at periods p, as a client does, used by
// one session.
func createTestBuffer(t *testing.T, size int, p Periods, plans ...ListPlan) *Buffer {
	t.Helper()
	m, err := CreateBuffer(true, "test_buffer", size, 0o600, plans, p)
	if err != nil {
		t.Fatal(err)
	}
	m.AddSession(1)
	t.Cleanup(func() {
		m.AddSession(-1)
		m.region.Release()
	})
	return m
}

package shmipc

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"unsafe"
)

// Unit tests of the buffer manager (buffer.go) on regions in Go memory:
// the free lists, size classes, allocation and the checks of readChain.

// bufTestPlans are three small lists, laid out largest first so that the
// size classes cannot follow region order by accident.
var bufTestPlans = []listPlan{{sliceCap: 256, count: 2}, {sliceCap: 16, count: 4}, {sliceCap: 64, count: 3}}

// listOf returns the index of the list whose slices hold sliceCap bytes.
func listOf(t *testing.T, m *bufferManager, sliceCap uint32) int {
	t.Helper()
	for i, l := range m.lists {
		if l.sliceCap == sliceCap {
			return i
		}
	}
	t.Fatalf("no list of %d-byte slices", sliceCap)
	return -1
}

func counterOf(m *bufferManager, li int, field uint32) int32 {
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
		if l.sliceCap != p.sliceCap || l.count != p.count {
			t.Errorf("list %d: %d slices of %d bytes, want %d of %d", i, l.count, l.sliceCap, p.count, p.sliceCap)
		}
		capacity += uint64(p.count-1) * uint64(p.sliceCap)
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
		off, err := m.pop(li)
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
	if off, err := m.pop(li); off != 0 || err != nil {
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
		if err := peer.push(li, off); err != nil {
			t.Fatalf("push %d: %v", off, err)
		}
	}
	if c := counterOf(m, li, mapperCounter); c != -2 {
		t.Errorf("mapper counter %d after two pushes, want -2", c)
	}
	for _, want := range []uint32{last, got[0]} {
		if off, err := m.pop(li); off != want || err != nil {
			t.Fatalf("pop after the pushes: offset %d, %v; want %d (first in, first out)", off, err, want)
		}
	}
	if off, _ := m.pop(li); off != 0 {
		t.Fatalf("pop with one slice left returned %d", off)
	}
}

// TestBufferAllocSizeClasses: alloc takes the smallest slice that holds n,
// then larger ones, and smaller ones only when the message may be split.
func TestBufferAllocSizeClasses(t *testing.T) {
	m, _ := newHeapBuffer(t, bufTestPlans...)
	capOf := func(n int, split bool) uint32 {
		t.Helper()
		li, off, err := m.alloc(n, split, false)
		if err != nil {
			t.Fatalf("alloc(%d, %v): %v", n, split, err)
		}
		if li < 0 {
			return 0
		}
		if at, err := m.locate(off); err != nil || at != li {
			t.Fatalf("alloc(%d, %v) returned list %d and offset %d, in list %d (%v)", n, split, li, off, at, err)
		}
		if got := len(m.sliceData(li, off)); got != int(m.lists[li].sliceCap) {
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
	m, peer := newHeapBuffer(t, listPlan{sliceCap: 16, count: 200}, listPlan{sliceCap: 64, count: 100})
	initial := fmt.Sprint(m.freeCounts())
	var mu sync.Mutex
	owner := map[uint32]int{}
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	held := make([][]segment, 2)
	for side, bm := range []*bufferManager{m, peer} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				li, off, err := bm.alloc(1, true, false)
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
				held[side] = append(held[side], segment{list: int32(li), off: off})
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
	for side, bm := range []*bufferManager{peer, m} { // each frees what the other took
		for _, s := range held[1-side] {
			if err := bm.push(int(s.list), s.off); err != nil {
				t.Fatal(err)
			}
		}
	}
	if got := fmt.Sprint(m.freeCounts()); got != initial {
		t.Errorf("free counts %s after freeing everything, want %s", got, initial)
	}
	if li, off, err := m.alloc(64, false, false); li < 0 || err != nil {
		t.Errorf("alloc after freeing everything: list %d offset %d, %v", li, off, err)
	}
}

// TestBufferReadChainHeld: the slices of a message read and not yet freed
// are held; the same message read again is rejected (the peer published it
// twice), and so is another message that links to one of them, without
// releasing the first message's slices. Once freed, and once a writer takes
// a kept slice, the slices can come back in a message.
func TestBufferReadChainHeld(t *testing.T) {
	m, peer := newHeapBuffer(t, listPlan{sliceCap: 16, count: 8})
	root, offs := bufTestMsg(t, m, "ab", "cd", "ef")
	got, err := peer.readChain(nil, root)
	if err != nil || chainText(got) != "abcdef" {
		t.Fatalf("first read: %q, %v", chainText(got), err)
	}
	checkRejected(t, peer, root, "published twice")
	other, _ := bufTestMsg(t, m, "gh")
	m.linkSlice(other, 2, offs[1])
	checkRejected(t, peer, other, "published twice")
	if _, err := peer.readChain(nil, root); err == nil {
		t.Fatal("a rejected read released the first message's slices")
	}
	for _, sl := range got {
		if err := peer.push(int(sl.list), sl.off); err != nil {
			t.Fatal(err)
		}
	}
	again, _ := bufTestMsg(t, m, "ij", "kl", "mn", "op", "qr")
	if got, err := peer.readChain(nil, again); err != nil || chainText(got) != "ijklmnopqr" {
		t.Fatalf("a message in freed slices: %q, %v", chainText(got), err)
	}
	st := &Stream{s: &Session{buf: peer}}
	st.kept.Store(keptValue(int(got[0].list), got[0].off))
	if li, off, ok := st.takeKept(8); !ok || li != int(got[0].list) || off != got[0].off {
		t.Fatalf("takeKept: %d %d %v", li, off, ok)
	}
	peer.linkSlice(got[0].off, 2, 0)
	if back, err := peer.readChain(nil, got[0].off); err != nil || len(back) != 1 {
		t.Errorf("a kept slice sent and published back: %d slices, %v", len(back), err)
	}
}

// TestBufferHeldBits: with slices enough for several cache lines of held
// bits, each slice has a bit of its own (holding one marks no other), and
// neighbouring slices have theirs on different lines.
func TestBufferHeldBits(t *testing.T) {
	m, _ := newHeapBuffer(t, listPlan{sliceCap: 16, count: 700}, listPlan{sliceCap: 64, count: 900})
	seen := make(map[[2]uintptr]bool)
	var prevLine uintptr
	n := 0
	for li := range m.lists {
		l := &m.lists[li]
		for k := uint32(0); k < l.count; k++ {
			off := l.area + k*l.stride
			w, bit := m.heldBit(li, off)
			key := [2]uintptr{uintptr(unsafe.Pointer(w)), uintptr(bit)}
			if seen[key] {
				t.Fatalf("list %d slice %d shares its held bit with another slice", li, k)
			}
			seen[key] = true
			line := (uintptr(unsafe.Pointer(w)) - uintptr(unsafe.Pointer(&m.held[0]))) / 64
			if n > 0 && line == prevLine {
				t.Errorf("list %d slice %d: held bit on the same cache line as the slice before", li, k)
			}
			prevLine = line
			n++
			if !m.hold(li, off) || m.hold(li, off) {
				t.Fatalf("list %d slice %d: hold did not report the first hold alone", li, k)
			}
		}
	}
	for li := range m.lists {
		l := &m.lists[li]
		for k := uint32(0); k < l.count; k++ {
			m.unhold(li, l.area+k*l.stride)
		}
	}
	for i := range m.held {
		if m.held[i].Load() != 0 {
			t.Fatalf("word %d of held is %#x after every slice was released", i, m.held[i].Load())
		}
	}
}

// bufTestMsg builds a message of parts, one slice per part, each from the
// smallest list that holds it, and returns the offset of its first slice.
func bufTestMsg(t *testing.T, m *bufferManager, parts ...string) (root uint32, offs []uint32) {
	t.Helper()
	lists := make([]int, len(parts))
	for i, p := range parts {
		li, off, err := m.alloc(len(p), false, false)
		if err != nil || li < 0 {
			t.Fatalf("alloc(%d): list %d, %v", len(p), li, err)
		}
		copy(m.sliceData(li, off), p)
		lists[i], offs = li, append(offs, off)
	}
	for i, off := range offs {
		var next uint32
		if i+1 < len(offs) {
			next = offs[i+1]
		}
		m.linkSlice(off, len(parts[i]), next)
	}
	return offs[0], offs
}

func chainText(slices []segment) string {
	var b strings.Builder
	for _, s := range slices {
		b.Write(s.data)
	}
	return b.String()
}

// TestBufferReadChain: a message of several slices of different lists reads
// back in order; empty slices are freed and left out.
func TestBufferReadChain(t *testing.T) {
	m, peer := newHeapBuffer(t, bufTestPlans...)
	root, offs := bufTestMsg(t, m, "first", "", strings.Repeat("s", 40), "last")
	before := peer.freeCounts()
	dst := []segment{{off: 1}} // what the caller had: kept in front
	got, err := peer.readChain(dst, root)
	if err != nil {
		t.Fatalf("readChain: %v", err)
	}
	if len(got) != 4 || got[0].off != 1 {
		t.Fatalf("readChain returned %d slices, want the caller's one and 3", len(got))
	}
	if text := chainText(got[1:]); text != "first"+strings.Repeat("s", 40)+"last" {
		t.Errorf("message %q", text)
	}
	for i, want := range []uint32{offs[0], offs[2], offs[3]} {
		if got[1+i].off != want {
			t.Errorf("slice %d at %d, want %d", i, got[1+i].off, want)
		}
		if li, _ := m.locate(want); got[1+i].list != int32(li) {
			t.Errorf("slice %d in list %d, want %d", i, got[1+i].list, li)
		}
	}
	empty, _ := m.locate(offs[1])
	after := peer.freeCounts()
	for i := range after {
		want := before[i]
		if i == empty {
			want++
		}
		if after[i] != want {
			t.Errorf("list %d: %d free slices after reading, want %d (only the empty slice is freed)", i, after[i], want)
		}
	}
}

// TestBufferReadChainRejects: a root or a link that is not a slice, a
// slice linked twice and a header that does not fit its list end the read
// with ErrProtocol; nothing is freed, not even the chain's empty slices, and
// the caller's slices are returned unchanged.
func TestBufferReadChainRejects(t *testing.T) {
	le := binary.LittleEndian
	setNext := func(m *bufferManager, a, b uint32) {
		le.PutUint32(m.mem[a+sliceNextOff:], b)
		m.setFlags(a, flagInUse|flagHasNext)
	}
	cases := []struct {
		name string
		msg  func(m *bufferManager) uint32 // builds the damaged message, returns its root
		want string
	}{
		{"root 0", func(*bufferManager) uint32 { return 0 }, "before the first slice"},
		{"root on the manager header", func(*bufferManager) uint32 { return 4 }, "before the first slice"},
		{"root on a list header", func(m *bufferManager) uint32 { return m.lists[1].header }, "not the start of a slice"},
		{"root past the region", func(m *bufferManager) uint32 { return uint32(len(m.mem)) }, "not the start of a slice"},
		{"root 0xFFFFFFF0", func(*bufferManager) uint32 { return 0xFFFFFFF0 }, "not the start of a slice"},
		{"root misaligned by 4", func(m *bufferManager) uint32 { r, _ := bufTestMsg(t, m, "x"); return r + 4 }, "not the start of a slice"},
		{"root on slice data", func(m *bufferManager) uint32 { r, _ := bufTestMsg(t, m, "x"); return r + sliceHeaderSize }, "not the start of a slice"},
		{"next past the region", func(m *bufferManager) uint32 {
			r, _ := bufTestMsg(t, m, "a", "")
			setNext(m, r, 0xFFFFFF00)
			return r
		}, "not the start of a slice"},
		{"self-loop", func(m *bufferManager) uint32 {
			r, _ := bufTestMsg(t, m, "a")
			setNext(m, r, r)
			return r
		}, "twice"},
		{"cycle A-B-A with an empty slice", func(m *bufferManager) uint32 {
			r, offs := bufTestMsg(t, m, "a", "")
			setNext(m, offs[1], r)
			return r
		}, "twice"},
		{"a slice linked twice", func(m *bufferManager) uint32 {
			r, offs := bufTestMsg(t, m, "a", "b", "c")
			setNext(m, offs[2], offs[1])
			return r
		}, "twice"},
		{"cap of another list", func(m *bufferManager) uint32 {
			r, _ := bufTestMsg(t, m, "a")
			le.PutUint32(m.mem[r+sliceCapOff:], 64)
			return r
		}, "cap 64"},
		{"size beyond cap", func(m *bufferManager) uint32 {
			r, _ := bufTestMsg(t, m, "a")
			le.PutUint32(m.mem[r+sliceSizeOff:], 17)
			return r
		}, "beyond its cap"},
		{"start+size beyond cap", func(m *bufferManager) uint32 {
			r, _ := bufTestMsg(t, m, "a")
			le.PutUint32(m.mem[r+sliceStartOff:], 15)
			le.PutUint32(m.mem[r+sliceSizeOff:], 2)
			return r
		}, "beyond its cap"},
		{"start+size wrapping 32 bits", func(m *bufferManager) uint32 {
			r, _ := bufTestMsg(t, m, "a", "")
			le.PutUint32(m.mem[r+sliceStartOff:], 0xFFFFFFFF)
			le.PutUint32(m.mem[r+sliceSizeOff:], 2)
			return r
		}, "beyond its cap"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m, peer := newHeapBuffer(t, bufTestPlans...)
			root := tc.msg(m)
			checkRejected(t, peer, root, tc.want)
		})
	}
}

// checkRejected reads the message at root, which must fail with ErrProtocol
// naming want, free nothing and leave the caller's slices as they were.
func checkRejected(t *testing.T, m *bufferManager, root uint32, want string) {
	t.Helper()
	before := fmt.Sprint(m.freeCounts())
	dst := []segment{{off: 7}}
	got, err := m.readChain(dst, root)
	if !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), want) {
		t.Errorf("readChain: %v; want ErrProtocol saying %q", err, want)
	}
	if len(got) != 1 || got[0].off != 7 {
		t.Errorf("readChain returned %d slices on error, want the caller's one", len(got))
	}
	if after := fmt.Sprint(m.freeCounts()); after != before {
		t.Errorf("free counts %s after a rejected read, were %s: nothing may be freed", after, before)
	}
}

// TestBufferReadChainLongCycle: a long chain that links back to an earlier
// slice is a cycle.
func TestBufferReadChainLongCycle(t *testing.T) {
	const length = 64
	for _, back := range []int{0, 31, 37} {
		t.Run(fmt.Sprint("back to slice ", back), func(t *testing.T) {
			m, peer := newHeapBuffer(t, listPlan{sliceCap: 16, count: 3 * length / 2})
			parts := make([]string, length)
			for i := range parts {
				parts[i] = fmt.Sprintf("%02d", i)
			}
			root, offs := bufTestMsg(t, m, parts...)
			got, err := peer.readChain(nil, root)
			if err != nil || len(got) != len(parts) {
				t.Fatalf("the intact chain: %d slices, %v", len(got), err)
			}
			for _, sl := range got { // read and handed back, as by a writer taking them
				peer.unhold(int(sl.list), sl.off)
			}
			le := binary.LittleEndian
			le.PutUint32(m.mem[offs[len(offs)-1]+sliceNextOff:], offs[back])
			m.setFlags(offs[len(offs)-1], flagInUse|flagHasNext)
			checkRejected(t, peer, root, "twice")
		})
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
		if off, err := m.pop(li); off != 0 || !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "head") {
			t.Errorf("pop: offset %d, %v; want ErrProtocol about the head", off, err)
		}
		if li2, _, err := m.alloc(1, false, false); !errors.Is(err, ErrProtocol) || li2 != li {
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
		if off, err := m.pop(li); off != 0 || !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "links") {
			t.Errorf("pop: offset %d, %v; want ErrProtocol about the link", off, err)
		}
		if f := m.freeCounts()[li]; f != 4 {
			t.Errorf("free count %d after a failed pop, want 4", f)
		}
	})
	t.Run("tail not a slice", func(t *testing.T) {
		m, _ := newHeapBuffer(t, bufTestPlans...)
		li := listOf(t, m, 16)
		off, err := m.pop(li)
		if err != nil || off == 0 {
			t.Fatalf("pop: %d, %v", off, err)
		}
		le.PutUint32(m.mem[m.lists[li].header+listTailOff:], 0xFFFFFF00)
		if err := m.push(li, off); !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "tail") {
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
		{"list with no slices", size, func(b []byte) { le.PutUint32(b[managerHeaderSize+listCountOff:], 0) }, "no slices"},
		{"slice size not a multiple of 4", size, func(b []byte) { le.PutUint32(b[managerHeaderSize+listCapOff:], 254) }, "multiple of 4"},
		{"list past the used bytes", size, func(b []byte) { le.PutUint32(b[bufferRegionSize(bufTestPlans[:2])+listCountOff:], 4) }, "past"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			mem := alignedBytes(max(tc.size, managerHeaderSize))[:tc.size]
			if tc.size >= managerHeaderSize {
				initBufferRegion(mem, bufTestPlans)
			}
			if tc.damage != nil {
				tc.damage(mem)
			}
			if _, err := newBufferManager(heapRegion(mem), false); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("newBufferManager: %v; want an error saying %q", err, tc.want)
			}
		})
	}
	t.Run("two lists of one size", func(t *testing.T) {
		plans := []listPlan{{sliceCap: 64, count: 2}, {sliceCap: 64, count: 3}}
		mem := alignedBytes(int(bufferRegionSize(plans)))
		initBufferRegion(mem, plans)
		if _, err := newBufferManager(heapRegion(mem), false); err == nil || !strings.Contains(err.Error(), "two lists") {
			t.Errorf("newBufferManager: %v; want an error about two lists of one size", err)
		}
	})
}

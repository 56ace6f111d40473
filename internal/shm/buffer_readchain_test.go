package shm

// Reading a message's chain of slices: in order, held until freed, and
// refused when the peer's links are wrong (not a slice, linked twice, a
// cycle, a header that does not fit its list).

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"testing"
	"unsafe"
)

// TestBufferReadChainHeld: the slices of a message read and not yet freed
// are held; the same message read again is rejected (the peer published it
// twice), and so is another message that links to one of them, without
// releasing the first message's slices. Once freed, and once a writer takes
// a kept slice, the slices can come back in a message.
func TestBufferReadChainHeld(t *testing.T) {
	m, peer := newHeapBuffer(t, ListPlan{SliceCap: 16, Count: 8})
	root, offs := bufTestMsg(t, m, "ab", "cd", "ef")
	got, err := peer.ReadChain(nil, root)
	if err != nil || chainText(got) != "abcdef" {
		t.Fatalf("first read: %q, %v", chainText(got), err)
	}
	checkRejected(t, peer, root, "published twice")
	other, _ := bufTestMsg(t, m, "gh")
	m.LinkSlice(other, 2, offs[1])
	checkRejected(t, peer, other, "published twice")
	if _, err := peer.ReadChain(nil, root); err == nil {
		t.Fatal("a rejected read released the first message's slices")
	}
	for _, sl := range got {
		if err := peer.Push(int(sl.List), sl.Off); err != nil {
			t.Fatal(err)
		}
	}
	again, _ := bufTestMsg(t, m, "ij", "kl", "mn", "op", "qr")
	if got, err := peer.ReadChain(nil, again); err != nil || chainText(got) != "ijklmnopqr" {
		t.Fatalf("a message in freed slices: %q, %v", chainText(got), err)
	}
	peer.Unhold(int(got[0].List), got[0].Off) // a writer of this process takes it, as a stream that kept it does
	peer.LinkSlice(got[0].Off, 2, 0)
	if back, err := peer.ReadChain(nil, got[0].Off); err != nil || len(back) != 1 {
		t.Errorf("a kept slice sent and published back: %d slices, %v", len(back), err)
	}
}

// TestBufferHeldBits: with slices enough for several cache lines of held
// bits, each slice has a bit of its own (holding one marks no other), and
// neighbouring slices have theirs on different lines.
func TestBufferHeldBits(t *testing.T) {
	m, _ := newHeapBuffer(t, ListPlan{SliceCap: 16, Count: 700}, ListPlan{SliceCap: 64, Count: 900})
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
			m.Unhold(li, l.area+k*l.stride)
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
func bufTestMsg(t *testing.T, m *Buffer, parts ...string) (root uint32, offs []uint32) {
	t.Helper()
	lists := make([]int, len(parts))
	for i, p := range parts {
		li, off, err := m.Alloc(len(p), false, false)
		if err != nil || li < 0 {
			t.Fatalf("alloc(%d): list %d, %v", len(p), li, err)
		}
		copy(m.SliceData(li, off), p)
		lists[i], offs = li, append(offs, off)
	}
	for i, off := range offs {
		var next uint32
		if i+1 < len(offs) {
			next = offs[i+1]
		}
		m.LinkSlice(off, len(parts[i]), next)
	}
	return offs[0], offs
}

func chainText(slices []Segment) string {
	var b strings.Builder
	for _, s := range slices {
		b.Write(s.Data)
	}
	return b.String()
}

// TestBufferReadChain: a message of several slices of different lists reads
// back in order; empty slices are freed and left out.
func TestBufferReadChain(t *testing.T) {
	m, peer := newHeapBuffer(t, bufTestPlans...)
	root, offs := bufTestMsg(t, m, "first", "", strings.Repeat("s", 40), "last")
	before := peer.freeCounts()
	dst := []Segment{{Off: 1}} // what the caller had: kept in front
	got, err := peer.ReadChain(dst, root)
	if err != nil {
		t.Fatalf("readChain: %v", err)
	}
	if len(got) != 4 || got[0].Off != 1 {
		t.Fatalf("readChain returned %d slices, want the caller's one and 3", len(got))
	}
	if text := chainText(got[1:]); text != "first"+strings.Repeat("s", 40)+"last" {
		t.Errorf("message %q", text)
	}
	for i, want := range []uint32{offs[0], offs[2], offs[3]} {
		if got[1+i].Off != want {
			t.Errorf("slice %d at %d, want %d", i, got[1+i].Off, want)
		}
		if li, _ := m.locate(want); got[1+i].List != int32(li) {
			t.Errorf("slice %d in list %d, want %d", i, got[1+i].List, li)
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
	setNext := func(m *Buffer, a, b uint32) {
		le.PutUint32(m.mem[a+sliceNextOff:], b)
		m.setFlags(a, flagInUse|flagHasNext)
	}
	cases := []struct {
		name string
		msg  func(m *Buffer) uint32 // builds the damaged message, returns its root
		want string
	}{
		{"root 0", func(*Buffer) uint32 { return 0 }, "before the first slice"},
		{"root on the manager header", func(*Buffer) uint32 { return 4 }, "before the first slice"},
		{"root on a list header", func(m *Buffer) uint32 { return m.lists[1].header }, "not the start of a slice"},
		{"root past the region", func(m *Buffer) uint32 { return uint32(len(m.mem)) }, "not the start of a slice"},
		{"root 0xFFFFFFF0", func(*Buffer) uint32 { return 0xFFFFFFF0 }, "not the start of a slice"},
		{"root misaligned by 4", func(m *Buffer) uint32 { r, _ := bufTestMsg(t, m, "x"); return r + 4 }, "not the start of a slice"},
		{"root on slice data", func(m *Buffer) uint32 { r, _ := bufTestMsg(t, m, "x"); return r + SliceHeaderSize }, "not the start of a slice"},
		{"next past the region", func(m *Buffer) uint32 {
			r, _ := bufTestMsg(t, m, "a", "")
			setNext(m, r, 0xFFFFFF00)
			return r
		}, "not the start of a slice"},
		{"self-loop", func(m *Buffer) uint32 {
			r, _ := bufTestMsg(t, m, "a")
			setNext(m, r, r)
			return r
		}, "twice"},
		{"cycle A-B-A with an empty slice", func(m *Buffer) uint32 {
			r, offs := bufTestMsg(t, m, "a", "")
			setNext(m, offs[1], r)
			return r
		}, "twice"},
		{"a slice linked twice", func(m *Buffer) uint32 {
			r, offs := bufTestMsg(t, m, "a", "b", "c")
			setNext(m, offs[2], offs[1])
			return r
		}, "twice"},
		{"cap of another list", func(m *Buffer) uint32 {
			r, _ := bufTestMsg(t, m, "a")
			le.PutUint32(m.mem[r+sliceCapOff:], 64)
			return r
		}, "cap 64"},
		{"size beyond cap", func(m *Buffer) uint32 {
			r, _ := bufTestMsg(t, m, "a")
			le.PutUint32(m.mem[r+sliceSizeOff:], 17)
			return r
		}, "beyond its cap"},
		{"start+size beyond cap", func(m *Buffer) uint32 {
			r, _ := bufTestMsg(t, m, "a")
			le.PutUint32(m.mem[r+sliceStartOff:], 15)
			le.PutUint32(m.mem[r+sliceSizeOff:], 2)
			return r
		}, "beyond its cap"},
		{"start+size wrapping 32 bits", func(m *Buffer) uint32 {
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
func checkRejected(t *testing.T, m *Buffer, root uint32, want string) {
	t.Helper()
	before := fmt.Sprint(m.freeCounts())
	dst := []Segment{{Off: 7}}
	got, err := m.ReadChain(dst, root)
	if !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), want) {
		t.Errorf("readChain: %v; want ErrProtocol saying %q", err, want)
	}
	if len(got) != 1 || got[0].Off != 7 {
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
			m, peer := newHeapBuffer(t, ListPlan{SliceCap: 16, Count: 3 * length / 2})
			parts := make([]string, length)
			for i := range parts {
				parts[i] = fmt.Sprintf("%02d", i)
			}
			root, offs := bufTestMsg(t, m, parts...)
			got, err := peer.ReadChain(nil, root)
			if err != nil || len(got) != len(parts) {
				t.Fatalf("the intact chain: %d slices, %v", len(got), err)
			}
			for _, sl := range got { // read and handed back, as by a writer taking them
				peer.Unhold(int(sl.List), sl.Off)
			}
			le := binary.LittleEndian
			le.PutUint32(m.mem[offs[len(offs)-1]+sliceNextOff:], offs[back])
			m.setFlags(offs[len(offs)-1], flagInUse|flagHasNext)
			checkRejected(t, peer, root, "twice")
		})
	}
}

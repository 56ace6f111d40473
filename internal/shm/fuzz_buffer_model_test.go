package shm

// The model FuzzBufferRegion and FuzzReadChain drive a buffer manager with:
// an op script whose every result it checks.

import (
	"encoding/binary"
	"errors"
	"math"
	"testing"
	"unsafe"
)

// ---------------------------------------------------------------------------
// 3 and 4. Buffer region targets

// fzBufModel drives a buffer manager with an op script and checks every
// result. While pristine is set the region has only been used through the
// API, so every operation must succeed exactly as docs/protocol.md §6 says;
// afterwards only memory safety and error classification are checked.
type fzBufModel struct {
	t        *testing.T
	m        *Buffer
	pristine bool
	owned    []Segment // slices we hold (popped or received)
	initFree []int32
	ownedBy  []int32 // slices held per list while pristine
	scratch  []Segment
}

func newFzBufModel(t *testing.T, m *Buffer, pristine bool) *fzBufModel {
	fm := &fzBufModel{t: t, m: m, pristine: pristine, initFree: m.freeCounts(), ownedBy: make([]int32, len(m.lists))}
	fm.checkLayout()
	return fm
}

// checkLayout checks the manager's copy of the layout against the mapping.
func (fm *fzBufModel) checkLayout() {
	t, m := fm.t, fm.m
	var total uint64
	prevEnd := uint64(BufferHeaderSize)
	for i, l := range m.lists {
		if uint64(l.header) != prevEnd || l.area != l.header+ListHeaderSize || l.stride != l.sliceCap+SliceHeaderSize ||
			l.count == 0 || l.sliceCap == 0 || l.sliceCap%4 != 0 || uint64(l.area)+uint64(l.count)*uint64(l.stride) > uint64(len(m.mem)) {
			t.Fatalf("list %d %+v is inconsistent with a %d-byte region", i, l, len(m.mem))
		}
		prevEnd = uint64(l.end())
		total += uint64(l.count)
	}
	if uint64(m.slices) != total {
		t.Fatalf("manager counts %d slices, lists hold %d", m.slices, total)
	}
	for k := 1; k < len(m.bySize); k++ {
		if m.lists[m.bySize[k-1]].sliceCap >= m.lists[m.bySize[k]].sliceCap {
			t.Fatalf("bySize not strictly ascending")
		}
	}
}

// isSlice is an independent check that off is the header of a slice of li.
func (fm *fzBufModel) isSlice(li int, off uint32) bool {
	l := fm.m.lists[li]
	return off >= l.area && off < l.end() && (off-l.area)%l.stride == 0
}

func (fm *fzBufModel) wantProtocol(op string, err error) {
	if err == nil {
		return
	}
	if fm.pristine {
		fm.t.Fatalf("%s on an uncorrupted region: %v", op, err)
	}
	if !errors.Is(err, ErrProtocol) {
		fm.t.Fatalf("%s: error %q does not wrap ErrProtocol", op, err)
	}
}

// took records a slice handed out by pop or alloc.
func (fm *fzBufModel) took(op string, li int, off uint32) {
	if li < 0 || li >= len(fm.m.lists) || !fm.isSlice(li, off) {
		fm.t.Fatalf("%s returned list %d offset %d, not a slice of that list", op, li, off)
	}
	if fm.m.mem[off+sliceFlagsOff] != flagInUse {
		fm.t.Fatalf("%s: slice %d has flags %#x, want %#x", op, off, fm.m.mem[off+sliceFlagsOff], flagInUse)
	}
	if fm.pristine {
		for _, s := range fm.owned {
			if s.Off == off {
				fm.t.Fatalf("%s handed out slice %d, which is already in use", op, off)
			}
		}
		fm.ownedBy[li]++
	}
	fm.owned = append(fm.owned, Segment{List: int32(li), Off: off})
}

// checkFree checks the free counts against what we hold.
func (fm *fzBufModel) checkFree() {
	if !fm.pristine {
		return
	}
	free := fm.m.freeCounts()
	for i := range free {
		if free[i] != fm.initFree[i]-fm.ownedBy[i] {
			fm.t.Fatalf("list %d: free count %d, want %d - %d held", i, free[i], fm.initFree[i], fm.ownedBy[i])
		}
	}
}

func (fm *fzBufModel) dropOwned(k int) Segment {
	s := fm.owned[k]
	fm.owned[k] = fm.owned[len(fm.owned)-1]
	fm.owned = fm.owned[:len(fm.owned)-1]
	if fm.pristine {
		fm.ownedBy[s.List]--
	}
	return s
}

// value picks a value to write into a header: raw, or one of the offsets
// and boundary values that matter.
func (fm *fzBufModel) value(s *fzScript, li int) uint32 {
	l := fm.m.lists[li]
	sel, k, raw := s.u8(), s.u16(), s.u32()
	switch sel % 10 {
	case 0:
		return raw
	case 1:
		return uint32(k) % l.count * l.stride // relative offset of a slice
	case 2:
		return l.area + uint32(k)%l.count*l.stride // absolute offset of a slice
	case 3:
		return math.MaxUint32 - uint32(k&7)
	case 4:
		return 0
	case 5:
		return l.count * l.stride // one past the last slice
	case 6:
		return uint32(k & 0xFF)
	case 7:
		return uint32(int32(k)) - 0x8000 // small signed, for counters
	case 8:
		return l.sliceCap + uint32(k&3)
	default:
		other := fm.m.lists[int(k)%len(fm.m.lists)]
		return other.area + uint32(k>>4)%other.count*other.stride
	}
}

// checkChain checks slices readChain returned.
func (fm *fzBufModel) checkChain(got []Segment) {
	if uint64(len(got)) > uint64(fm.m.slices) {
		fm.t.Fatalf("readChain returned %d slices of a region with %d", len(got), fm.m.slices)
	}
	base := uintptr(unsafe.Pointer(unsafe.SliceData(fm.m.mem)))
	for _, s := range got {
		li := int(s.List)
		if li < 0 || li >= len(fm.m.lists) || !fm.isSlice(li, s.Off) {
			fm.t.Fatalf("readChain returned list %d offset %d, not a slice of it", li, s.Off)
		}
		if len(s.Data) == 0 || len(s.Data) > int(fm.m.lists[li].sliceCap) {
			fm.t.Fatalf("readChain returned %d bytes from a %d-byte slice", len(s.Data), fm.m.lists[li].sliceCap)
		}
		d := uint32(uintptr(unsafe.Pointer(unsafe.SliceData(s.Data))) - base)
		if d < s.Off+SliceHeaderSize || uint64(d)+uint64(cap(s.Data)) > uint64(s.Off)+SliceHeaderSize+uint64(fm.m.lists[li].sliceCap) {
			fm.t.Fatalf("readChain data at %d+%d lies outside slice %d", d, cap(s.Data), s.Off)
		}
	}
}

func (fm *fzBufModel) run(script []byte) {
	t, m := fm.t, fm.m
	s := &fzScript{b: script}
	nl := len(m.lists)
	for steps := 0; !s.done(); steps++ {
		op := s.u8()
		switch op % 12 {
		case 0, 1: // alloc
			n := int(s.u32() % (2*m.maxSliceCap() + 2))
			split := op&0x80 != 0
			li, off, err := m.Alloc(n, split, false)
			fm.wantProtocol("alloc", err)
			if err != nil {
				if off != 0 {
					t.Fatalf("alloc returned offset %d with error %v", off, err)
				}
				break
			}
			if off == 0 {
				if li != -1 {
					t.Fatalf("alloc returned list %d without a slice", li)
				}
				if fm.pristine {
					// No list that could serve may have a slice to spare:
					// one whose slices hold n, or for a split one whose
					// slices hold an eighth of it (maxSplitPieces).
					floor := min(n, int(m.usable)) / maxSplitPieces
					for i, free := range m.freeCounts() {
						if c := int(m.lists[i].sliceCap); free >= 2 && (c >= n || split && c >= floor) {
							t.Fatalf("alloc(%d, %v) failed while list %d (cap %d) has %d free", n, split, i, m.lists[i].sliceCap, free)
						}
					}
				}
				break
			}
			if fm.pristine && !split && int(m.lists[li].sliceCap) < n {
				t.Fatalf("alloc(%d) returned a slice of %d bytes", n, m.lists[li].sliceCap)
			}
			fm.took("alloc", li, off)
		case 2: // pop
			li := int(s.u8()) % nl
			var before int32
			if fm.pristine {
				before = m.freeCounts()[li]
			}
			off, err := m.Pop(li)
			fm.wantProtocol("pop", err)
			if off != 0 && err != nil {
				t.Fatalf("pop returned offset %d with error %v", off, err)
			}
			if off != 0 {
				fm.took("pop", li, off)
			} else if fm.pristine && before >= 2 {
				t.Fatalf("pop of list %d failed with %d free", li, before)
			}
		case 3: // push a slice we hold
			if len(fm.owned) == 0 {
				break
			}
			sl := fm.dropOwned(int(s.u16()) % len(fm.owned))
			fm.wantProtocol("push", m.Push(int(sl.List), sl.Off))
		case 4: // link held slices into a message and read it back
			k := 1 + int(s.u8()%4)
			if k > len(fm.owned) {
				break
			}
			chain := make([]Segment, 0, k)
			sizes := make([]uint32, 0, k)
			for range k {
				sl := fm.dropOwned(int(s.u16()) % len(fm.owned))
				// A slice received earlier goes into a message of ours as a
				// kept slice does: a writer takes it (takeKept), and it is
				// no longer held as received.
				m.Unhold(int(sl.List), sl.Off)
				if fm.pristine {
					fm.ownedBy[sl.List]++ // still held until readChain says otherwise
				}
				chain = append(chain, sl)
				size := s.u32() % (m.lists[sl.List].sliceCap + 1)
				if s.u8()&3 == 0 {
					size = 0
				}
				sizes = append(sizes, size)
			}
			for i, sl := range chain {
				var next uint32
				if i+1 < len(chain) {
					next = chain[i+1].Off
				}
				m.LinkSlice(sl.Off, int(sizes[i]), next)
			}
			got, err := m.ReadChain(fm.scratch[:0], chain[0].Off)
			fm.wantProtocol("readChain of a linked message", err)
			fm.checkChain(got)
			if fm.pristine {
				// Empty slices were freed; the others come back in order.
				j := 0
				for i, sl := range chain {
					if sizes[i] == 0 {
						fm.ownedBy[sl.List]--
						continue
					}
					if j >= len(got) || got[j].Off != sl.Off || got[j].List != sl.List || len(got[j].Data) != int(sizes[i]) {
						t.Fatalf("readChain of %v sizes %v returned %+v", chain, sizes, got)
					}
					want := m.SliceData(int(sl.List), sl.Off)[:sizes[i]]
					if unsafe.SliceData(got[j].Data) != unsafe.SliceData(want) {
						t.Fatalf("readChain data of slice %d is not its data area", sl.Off)
					}
					j++
				}
				if j != len(got) {
					t.Fatalf("readChain returned %d slices, want %d", len(got), j)
				}
			}
			for _, g := range got {
				fm.owned = append(fm.owned, Segment{List: g.List, Off: g.Off})
			}
			if err != nil {
				// readChain freed what it had appended; we cannot tell
				// which of the chain we still hold.
				fm.pristine = false
			}
			fm.scratch = got[:0]
		case 5: // readChain from a fuzz-chosen root, as a peer's queue element names
			var root uint32
			if s.u8()&1 == 0 {
				root = s.u32()
			} else {
				l := m.lists[int(s.u8())%nl]
				root = l.area + uint32(s.u16())%l.count*l.stride
			}
			fm.pristine = false // it may free slices that are free already
			got, err := m.ReadChain(fm.scratch[:0], root)
			fm.wantProtocol("readChain", err)
			if err != nil && len(got) != 0 {
				t.Fatalf("readChain failed (%v) but returned %d slices", err, len(got))
			}
			fm.checkChain(got)
			if s.u8()&1 == 0 {
				for _, g := range got {
					fm.wantProtocol("push", m.Push(int(g.List), g.Off))
				}
			} else {
				for _, g := range got {
					fm.owned = append(fm.owned, Segment{List: g.List, Off: g.Off})
				}
			}
			fm.scratch = got[:0]
		case 6: // locate
			off := s.u32()
			if s.u8()&1 == 0 {
				l := m.lists[int(s.u8())%nl]
				off = l.area + uint32(s.u16())%(l.count+1)*l.stride + uint32(s.u8()%3)
			}
			li, err := m.locate(off)
			want := -1
			for i := range m.lists {
				if fm.isSlice(i, off) {
					want = i
				}
			}
			if err != nil {
				if !errors.Is(err, ErrProtocol) {
					t.Fatalf("locate(%d): error %q does not wrap ErrProtocol", off, err)
				}
				if want >= 0 {
					t.Fatalf("locate(%d) failed (%v) but it is a slice of list %d", off, err, want)
				}
			} else if li != want {
				t.Fatalf("locate(%d) = %d, want %d", off, li, want)
			}
		case 7: // corrupt a list header field
			li := int(s.u8()) % nl
			field := uint32(s.u8() % (ListHeaderSize / 4))
			v := fm.value(s, li)
			binary.LittleEndian.PutUint32(m.mem[m.lists[li].header+4*field:], v)
			if field != creatorCounter/4 && field != mapperCounter/4 {
				fm.pristine = false
			}
		case 8: // corrupt a slice header field
			li := int(s.u8()) % nl
			l := m.lists[li]
			off := l.area + uint32(s.u16())%l.count*l.stride
			field := uint32(s.u8() % 5)
			v := fm.value(s, li)
			if field == 4 {
				m.mem[off+sliceFlagsOff] = byte(v)
			} else {
				binary.LittleEndian.PutUint32(m.mem[off+4*field:], v)
			}
			fm.pristine = false
		case 9: // sliceData of a held slice
			if len(fm.owned) == 0 {
				break
			}
			sl := fm.owned[int(s.u16())%len(fm.owned)]
			d := m.SliceData(int(sl.List), sl.Off)
			if len(d) != int(m.lists[sl.List].sliceCap) || cap(d) != len(d) {
				t.Fatalf("sliceData of %d: %d bytes, cap %d", sl.Off, len(d), cap(d))
			}
		case 10: // free counts
			fm.checkFree()
		case 11: // free everything we hold
			for len(fm.owned) > 0 {
				sl := fm.dropOwned(len(fm.owned) - 1)
				fm.wantProtocol("push", m.Push(int(sl.List), sl.Off))
			}
			fm.checkFree()
		}
	}
	fm.checkFree()
}

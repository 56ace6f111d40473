package shm

// FuzzQueue: the IO queues' region as a peer may leave it.

import (
	"encoding/binary"
	"errors"
	"math"
	"testing"
)

// ---------------------------------------------------------------------------
// 5. FuzzQueue

// fzQueueModel is the expected content of one queue while its counters have
// only been moved through put and pop.
type fzQueueModel struct {
	q        *Queue
	off      int // offset of this half in the region
	pristine bool
	elems    []Elem
	flag     uint32
}

// fzCountersSafe reports whether counters starting at c cannot cross from -1
// to 0 in the ops of one input, where slot numbering restarts (docs/protocol.md
// §7.4 counters are monotonic and never get there in practice).
func fzCountersSafe(c int64) bool { return c >= 0 || c < -(1<<40) }

func fzQueueSize(data []byte, sizeSel uint8) int {
	switch sel := int(sizeSel & 0x3F); sel {
	case 0:
		return len(data)
	default:
		return QueueRegionSize(uint32(16 * sel))
	}
}

func FuzzQueue(f *testing.F) {
	const fix = 0x80 // sizeSel bit: write the right capacity into both headers
	q16, q32 := fzValidQueue(16), fzValidQueue(32)
	var script []byte
	elem := func(op byte, id, off, status uint32) {
		script = append(script, op)
		script = binary.LittleEndian.AppendUint32(script, id)
		script = binary.LittleEndian.AppendUint32(script, off)
		script = binary.LittleEndian.AppendUint32(script, status)
	}
	for i := range 20 {
		elem(0, uint32(i+1), uint32(44+i*24), 0) // put on c2s
	}
	script = append(script, 1, 1, 1, 0x81, 5, 6, 0x85, 6, 7)
	elem(0x80, 9, 0, StatusClosed) // put on s2c
	script = append(script, 0x81, 0x81, 8)
	corrupt := append([]byte{}, script...)
	for _, field := range []byte{2, 3, 4} {
		for _, v := range []byte{0, 1, 2, 3, 4, 5, 6, 7} {
			corrupt = append(corrupt, field, v, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0x80, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1)
		}
	}
	corrupt = append(corrupt, 9, 30, 0, 4, 1, 2, 3, 4, 8, 1, 0)

	neg := append([]byte{}, q16...)
	for _, half := range []int{0, len(neg) / 2} {
		binary.LittleEndian.PutUint64(neg[half+queueHeadOff:], math.MaxUint64-2)
		binary.LittleEndian.PutUint64(neg[half+queueTailOff:], math.MaxUint64)
	}
	huge := append([]byte{}, q16...)
	binary.LittleEndian.PutUint64(huge[queueHeadOff:], math.MaxInt64-1)
	binary.LittleEndian.PutUint64(huge[queueTailOff:], math.MaxInt64)
	full := append([]byte{}, q16...)
	binary.LittleEndian.PutUint64(full[queueTailOff:], 16)
	over := append([]byte{}, q16...)
	binary.LittleEndian.PutUint64(over[queueTailOff:], 17)
	badCap := append([]byte{}, q16...)
	binary.LittleEndian.PutUint32(badCap[len(badCap)/2:], 15)

	for _, r := range [][]byte{q16, q32, neg, huge, full, over, badCap, q16[:len(q16)-2], {}} {
		f.Add(r, uint8(0), script)
		f.Add(r, uint8(0), corrupt)
	}
	f.Add([]byte{}, uint8(fix|1), script)
	f.Add([]byte{}, uint8(fix|3), corrupt)
	f.Add(q16, uint8(2), script)
	f.Add(q16[:100], uint8(fix|1), corrupt)
	f.Add(q16, uint8(0x3F|fix), corrupt)

	f.Fuzz(func(t *testing.T, data []byte, sizeSel uint8, script []byte) {
		size := fzQueueSize(data, sizeSel)
		mem := alignedBytes(size)[:size]
		copy(mem, data)
		if sizeSel&fix != 0 && size >= 2*queueHeaderSize && size%2 == 0 {
			half := size / 2
			c := uint32((half - queueHeaderSize) / queueElemSize)
			binary.LittleEndian.PutUint32(mem[queueCapOff:], c)
			binary.LittleEndian.PutUint32(mem[half+queueCapOff:], c)
		}

		// Independent check of the mapping rules (docs/protocol.md §7.1, §7.2).
		mapOK := func() bool {
			if size%2 != 0 {
				return false
			}
			half := size / 2
			if half < queueHeaderSize+queueElemSize || (half-queueHeaderSize)%queueElemSize != 0 {
				return false
			}
			c := (half - queueHeaderSize) / queueElemSize
			if c%16 != 0 || c > MaxQueueCap {
				return false
			}
			for _, h := range []int{0, half} {
				if int(binary.LittleEndian.Uint32(mem[h+queueCapOff:])) != c {
					return false
				}
				head := int64(binary.LittleEndian.Uint64(mem[h+queueHeadOff:]))
				tail := int64(binary.LittleEndian.Uint64(mem[h+queueTailOff:]))
				if head < 0 || tail < 0 {
					return false
				}
				if n := tail - head; n < 0 || n > int64(c) {
					return false
				}
			}
			return true
		}

		want := mapOK()
		c2s, s2c, err := MapQueues(mem)
		if (err == nil) != want {
			t.Fatalf("mapQueues of %d bytes: err %v, want success %v", size, err, want)
		}
		if err != nil {
			if c2s != nil || s2c != nil {
				t.Fatal("mapQueues returned queues with an error")
			}
			return
		}

		half := size / 2
		models := [2]*fzQueueModel{{q: c2s, off: 0}, {q: s2c, off: half}}
		// load (re)builds a model from the memory behind a freshly mapped queue.
		load := func(md *fzQueueModel) {
			q := md.q
			head := int64(binary.LittleEndian.Uint64(mem[md.off+queueHeadOff:]))
			tail := int64(binary.LittleEndian.Uint64(mem[md.off+queueTailOff:]))
			if q.ptail != tail || q.chead.Load() != head || q.cap != uint32((half-queueHeaderSize)/queueElemSize) {
				t.Fatalf("queue at %d mapped with tail %d head %d cap %d; memory says %d, %d", md.off, q.ptail, q.chead.Load(), q.cap, tail, head)
			}
			md.pristine = fzCountersSafe(head) && fzCountersSafe(tail)
			md.elems = md.elems[:0]
			for c := head; c != tail; c++ {
				md.elems = append(md.elems, fzReadElem(mem[md.off:], q.cap, c))
			}
			md.flag = binary.LittleEndian.Uint32(mem[md.off+queueFlagOff:])
		}
		load(models[0])
		load(models[1])

		s := &fzScript{b: script}
		for !s.done() {
			op := s.u8()
			md := models[op>>7]
			q := md.q
			hm := mem[md.off:]
			switch op & 0x7F % 10 {
			case 0: // put
				e := Elem{ID: s.u32(), Offset: s.u32(), Status: s.u32()}
				t0 := q.ptail
				head := int64(binary.LittleEndian.Uint64(hm[queueHeadOff:]))
				ok, err := q.Put(e)
				n := t0 - head
				switch {
				case n < 0 || n > int64(q.cap):
					if ok || err == nil || !errors.Is(err, ErrProtocol) {
						t.Fatalf("put with tail %d head %d cap %d: %v, %v; want an ErrProtocol error", t0, head, q.cap, ok, err)
					}
				case n == int64(q.cap):
					if ok || err != nil {
						t.Fatalf("put on a full queue: %v, %v", ok, err)
					}
				default:
					if !ok || err != nil {
						t.Fatalf("put with tail %d head %d cap %d: %v, %v; want success", t0, head, q.cap, ok, err)
					}
					if got := fzReadElem(hm, q.cap, t0); got != e {
						t.Fatalf("put wrote %+v at slot of %d, want %+v", got, t0, e)
					}
					if tail := int64(binary.LittleEndian.Uint64(hm[queueTailOff:])); tail != t0+1 || q.ptail != t0+1 {
						t.Fatalf("put published tail %d (local %d), want %d", tail, q.ptail, t0+1)
					}
				}
				if md.pristine {
					if wantOK := len(md.elems) < int(q.cap); ok != wantOK || err != nil {
						t.Fatalf("put with %d of %d queued: %v, %v", len(md.elems), q.cap, ok, err)
					}
					if ok {
						md.elems = append(md.elems, e)
					}
				}
			case 1: // pop
				h0 := q.chead.Load()
				tail := int64(binary.LittleEndian.Uint64(hm[queueTailOff:]))
				var slotElem Elem
				n := tail - h0
				if n > 0 && n <= int64(q.cap) {
					slotElem = fzReadElem(hm, q.cap, h0)
				}
				e, ok, err := q.pop()
				switch {
				case n < 0 || n > int64(q.cap):
					if ok || err == nil || !errors.Is(err, ErrProtocol) {
						t.Fatalf("pop with head %d tail %d cap %d: %v, %v; want an ErrProtocol error", h0, tail, q.cap, ok, err)
					}
				case n == 0:
					if ok || err != nil {
						t.Fatalf("pop on an empty queue: %v, %v", ok, err)
					}
				default:
					if !ok || err != nil || e != slotElem {
						t.Fatalf("pop with head %d tail %d: %+v, %v, %v; want %+v", h0, tail, e, ok, err, slotElem)
					}
					if head := int64(binary.LittleEndian.Uint64(hm[queueHeadOff:])); head != h0+1 || q.chead.Load() != h0+1 {
						t.Fatalf("pop published head %d (local %d), want %d", head, q.chead.Load(), h0+1)
					}
				}
				if md.pristine {
					if len(md.elems) == 0 {
						if ok || err != nil {
							t.Fatalf("pop of an empty queue: %+v, %v, %v", e, ok, err)
						}
					} else {
						if !ok || err != nil || e != md.elems[0] {
							t.Fatalf("pop: %+v, %v, %v; want %+v", e, ok, err, md.elems[0])
						}
						md.elems = md.elems[1:]
					}
				}
			case 2, 3: // corrupt head or tail
				off := queueHeadOff
				if op&0x7F%10 == 3 {
					off = queueTailOff
				}
				cur := int64(binary.LittleEndian.Uint64(hm[off:]))
				var v int64
				sel, raw := s.u8(), s.u64()
				switch sel % 8 {
				case 0:
					v = int64(raw)
				case 1:
					v = cur + int64(int8(raw))
				case 2:
					v = cur + int64(q.cap) + int64(raw%3) - 1
				case 3:
					v = cur - int64(q.cap) - int64(raw%3) + 1
				case 4:
					v = math.MaxInt64 - int64(raw%4)
				case 5:
					v = math.MinInt64 + int64(raw%4)
				case 6:
					v = -1 - int64(raw%4)
				default:
					v = int64(raw % 64)
				}
				binary.LittleEndian.PutUint64(hm[off:], uint64(v))
				if v != cur {
					md.pristine = false
				}
			case 4: // corrupt cap: read only at mapping, so nothing changes
				binary.LittleEndian.PutUint32(hm[queueCapOff:], s.u32())
			case 5: // markWorking
				got := q.MarkWorking()
				if got != (md.flag == 0) {
					t.Fatalf("markWorking with flag %d returned %v", md.flag, got)
				}
				if got {
					md.flag = 1
				}
			case 6: // setWorking
				on := s.u8()&1 != 0
				q.SetWorking(on)
				md.flag = 0
				if on {
					md.flag = 1
				}
			case 7: // corrupt the flag
				md.flag = s.u32()
				binary.LittleEndian.PutUint32(hm[queueFlagOff:], md.flag)
			case 8: // isEmpty
				tail := int64(binary.LittleEndian.Uint64(hm[queueTailOff:]))
				if got := q.IsEmpty(); got != (tail == q.chead.Load()) || (md.pristine && got != (len(md.elems) == 0)) {
					t.Fatalf("isEmpty = %v with tail %d head %d, %d queued", got, tail, q.chead.Load(), len(md.elems))
				}
			case 9: // raw write anywhere, then map again
				off := int(s.u32() % uint32(size))
				n := int(s.u8() % 9)
				for i := 0; i < n && off+i < size; i++ {
					mem[off+i] = s.u8()
				}
				want := mapOK()
				nc, ns, err := MapQueues(mem)
				if (err == nil) != want {
					t.Fatalf("remap: err %v, want success %v", err, want)
				}
				if err == nil {
					models[0].q, models[1].q = nc, ns
					load(models[0])
					load(models[1])
				} else if n > 0 {
					models[0].pristine, models[1].pristine = false, false
				}
			}
		}
	})
}

// fzReadElem reads the element for counter c of the queue half hm, as
// docs/protocol.md §7.3 places it.
func fzReadElem(hm []byte, cap uint32, c int64) Elem {
	off := queueHeaderSize + int(uint64(c)%uint64(cap))*queueElemSize
	return Elem{
		ID:     binary.LittleEndian.Uint32(hm[off:]),
		Offset: binary.LittleEndian.Uint32(hm[off+4:]),
		Status: binary.LittleEndian.Uint32(hm[off+8:]),
	}
}

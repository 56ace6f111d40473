package shmipc

// FuzzBufferRegion and FuzzReadChain, the buffer region targets, with their
// seed scripts and layouts.

import (
	"encoding/binary"
	"math"
	"testing"
)

// fzBufferScript is an op script for the seeds: allocate, send, free.
func fzBufferScript() []byte {
	var b []byte
	u32 := func(v uint32) { b = binary.LittleEndian.AppendUint32(b, v) }
	for i := range 6 {
		b = append(b, 0) // alloc
		u32(uint32(i * 10))
	}
	b = append(b, 2, 0, 2, 1) // pop lists 0 and 1
	b = append(b, 4, 2)       // send a 3-slice message
	for i := range 3 {
		b = append(b, byte(i), 0)
		u32(uint32(4 + i))
		b = append(b, 1)
	}
	b = append(b, 10, 9, 0, 0, 6, 0, 0, 0, 0, 0, 0)
	b = append(b, 3, 0, 0, 11, 10)
	b = append(b, 5, 1, 0, 0, 0, 0) // readChain at the first slice
	b = append(b, 11)
	return b
}

// fzCorruptScript corrupts list and slice headers, then reads and frees.
func fzCorruptScript() []byte {
	var b []byte
	b = append(b, 0x80, 4, 0, 0, 0) // alloc split
	b = append(b, 4, 0, 0, 0, 4, 0, 0, 0, 1)
	for field := range byte(9) {
		b = append(b, 7, 0, field, field, 1, 0, 0, 0, 0, 0)
		b = append(b, 2, 0, 0x80, 4, 0, 0, 0, 5, 1, 0, 3, 0, 0)
	}
	for field := range byte(5) {
		b = append(b, 8, 0, 1, 0, field, field+1, 2, 0, 0, 0, 0, 0)
		b = append(b, 5, 1, 0, 1, 0, 1, 2, 0)
	}
	b = append(b, 11)
	return b
}

func FuzzBufferRegion(f *testing.F) {
	valid := func(plans []listPlan) []byte {
		mem := make([]byte, bufferRegionSize(plans))
		initBufferRegion(mem, plans)
		return mem
	}
	small := valid([]listPlan{{sliceCap: 4, count: 3}, {sliceCap: 12, count: 2}})
	three := valid([]listPlan{{sliceCap: 8, count: 8}, {sliceCap: 32, count: 4}, {sliceCap: 64, count: 2}})
	script := fzBufferScript()
	corrupt := fzCorruptScript()
	mod := func(b []byte, off int, v uint32) []byte {
		c := append([]byte{}, b...)
		binary.LittleEndian.PutUint32(c[off:], v)
		return c
	}
	seeds := [][]byte{
		small,
		three,
		valid([]listPlan{{sliceCap: 4, count: 1}}),
		valid([]listPlan{{sliceCap: 1 << 10, count: 2}}),
		mod(small, 0, 0),                                  // no lists
		mod(small, 0, 3),                                  // more lists than fit
		mod(small, 4, uint32(len(small))),                 // used too large
		mod(small, managerHeaderSize+listCapOff, 6),       // cap not a multiple of 4
		mod(small, managerHeaderSize+listCapOff, 12),      // duplicate cap
		mod(small, managerHeaderSize+listCountOff, 0),     // no slices
		mod(small, managerHeaderSize+listCountOff, 1<<30), // past the end
		mod(small, managerHeaderSize+listCapOff, math.MaxUint32-3),
		mod(small, managerHeaderSize+listHeadOff, 3),
		mod(small, managerHeaderSize+listTailOff, 1<<31),
		mod(small, managerHeaderSize+listFreeOff, math.MaxInt32),
		mod(three, managerHeaderSize+listHeaderSize+sliceNextOff, 7),
		small[:managerHeaderSize+listHeaderSize],
		{},
	}
	for i, s := range seeds {
		f.Add(s, script, i%2 == 0)
		f.Add(s, corrupt, i%2 == 1)
	}

	f.Fuzz(func(t *testing.T, data, script []byte, creator bool) {
		mem := alignedBytes(max(len(data), managerHeaderSize))
		copy(mem, data)
		m, err := newBufferManager(heapRegion(mem), creator)
		if err != nil {
			if m != nil {
				t.Fatalf("newBufferManager returned a manager and error %v", err)
			}
			return
		}
		newFzBufModel(t, m, false).run(script)
	})
}

// fzLayouts are the valid regions FuzzReadChain starts from.
var fzLayouts = []struct {
	size  uint32
	sizes []SizePercentPair
}{
	{1 << 20, ReferenceSliceSizes()},
	{16 << 10, []SizePercentPair{{64, 50}, {256, 30}, {1024, 20}}},
	{4 << 10, []SizePercentPair{{4, 100}}},
	{1 << 10, []SizePercentPair{{4, 50}, {8, 50}}},
	{4 << 10, []SizePercentPair{{128, 40}, {32, 40}, {512, 20}}},
}

func FuzzReadChain(f *testing.F) {
	script := fzBufferScript()
	corrupt := fzCorruptScript()
	for i := range fzLayouts {
		f.Add(uint8(i), script)
		f.Add(uint8(i)|0x80, corrupt)
		f.Add(uint8(i), append(append([]byte{}, script...), corrupt...))
	}
	// A cycle: link a slice to itself, then read it.
	f.Add(uint8(1), []byte{2, 0, 2, 0, 4, 1, 0, 0, 5, 0, 0, 0, 1, 1, 0, 0, 0, 1,
		8, 0, 0, 0, 3, 2, 0, 0, 0, 0, 0, 5, 1, 0, 0, 0, 0, 11})

	type template struct {
		mem  []byte
		size int
	}
	templates := make([]template, len(fzLayouts))
	for i, l := range fzLayouts {
		plans, err := planLists(l.size, l.sizes)
		if err != nil {
			f.Fatalf("layout %d: %v", i, err)
		}
		// The region ends right after its last slice, so a slice past the
		// last one would be outside the mapping.
		size := int(bufferRegionSize(plans))
		mem := make([]byte, size)
		initBufferRegion(mem, plans)
		templates[i] = template{mem: mem, size: size}
	}

	f.Fuzz(func(t *testing.T, layout uint8, script []byte) {
		tp := templates[int(layout&0x7F)%len(templates)]
		mem := alignedBytes(tp.size)[:tp.size]
		copy(mem, tp.mem)
		m, err := newBufferManager(heapRegion(mem), layout&0x80 == 0)
		if err != nil {
			t.Fatalf("valid layout %d: %v", layout, err)
		}
		newFzBufModel(t, m, true).run(script)
	})
}

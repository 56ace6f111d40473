package shm

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
	valid := func(plans []ListPlan) []byte {
		mem := make([]byte, bufferRegionSize(plans))
		InitBuffer(mem, plans)
		return mem
	}
	small := valid([]ListPlan{{SliceCap: 4, Count: 3}, {SliceCap: 12, Count: 2}})
	three := valid([]ListPlan{{SliceCap: 8, Count: 8}, {SliceCap: 32, Count: 4}, {SliceCap: 64, Count: 2}})
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
		valid([]ListPlan{{SliceCap: 4, Count: 1}}),
		valid([]ListPlan{{SliceCap: 1 << 10, Count: 2}}),
		mod(small, 0, 0),                                 // no lists
		mod(small, 0, 3),                                 // more lists than fit
		mod(small, 4, uint32(len(small))),                // used too large
		mod(small, BufferHeaderSize+listCapOff, 6),       // cap not a multiple of 4
		mod(small, BufferHeaderSize+listCapOff, 12),      // duplicate cap
		mod(small, BufferHeaderSize+listCountOff, 0),     // no slices
		mod(small, BufferHeaderSize+listCountOff, 1<<30), // past the end
		mod(small, BufferHeaderSize+listCapOff, math.MaxUint32-3),
		mod(small, BufferHeaderSize+listHeadOff, 3),
		mod(small, BufferHeaderSize+listTailOff, 1<<31),
		mod(small, BufferHeaderSize+listFreeOff, math.MaxInt32),
		mod(three, BufferHeaderSize+ListHeaderSize+sliceNextOff, 7),
		small[:BufferHeaderSize+ListHeaderSize],
		{},
	}
	for i, s := range seeds {
		f.Add(s, script, i%2 == 0)
		f.Add(s, corrupt, i%2 == 1)
	}

	f.Fuzz(func(t *testing.T, data, script []byte, creator bool) {
		mem := alignedBytes(max(len(data), BufferHeaderSize))
		copy(mem, data)
		m, err := NewBuffer(RegionOf(mem), creator)
		if err != nil {
			if m != nil {
				t.Fatalf("newBufferManager returned a manager and error %v", err)
			}
			return
		}
		newFzBufModel(t, m, false).run(script)
	})
}

// fzLayouts are the valid regions FuzzReadChain starts from: those
// Config's BufferSliceSizes make of ReferenceSliceSizes() in 1 MiB; of
// {64, 50%}, {256, 30%}, {1024, 20%} in 16 KiB; {4, 100%} in 4 KiB;
// {4, 50%}, {8, 50%} in 1 KiB; and {128, 40%}, {32, 40%}, {512, 20%} in 4 KiB.
var fzLayouts = [][]ListPlan{
	{{8172, 63}, {32748, 9}, {131052, 1}},
	{{64, 96}, {256, 17}, {1024, 3}},
	{{4, 168}},
	{{4, 19}, {8, 16}},
	{{32, 30}, {128, 10}, {512, 1}},
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
	for i, plans := range fzLayouts {
		// The region ends right after its last slice, so a slice past the
		// last one would be outside the mapping.
		size := int(bufferRegionSize(plans))
		mem := make([]byte, size)
		InitBuffer(mem, plans)
		templates[i] = template{mem: mem, size: size}
	}

	f.Fuzz(func(t *testing.T, layout uint8, script []byte) {
		tp := templates[int(layout&0x7F)%len(templates)]
		mem := alignedBytes(tp.size)[:tp.size]
		copy(mem, tp.mem)
		m, err := NewBuffer(RegionOf(mem), layout&0x80 == 0)
		if err != nil {
			t.Fatalf("valid layout %d: %v", layout, err)
		}
		newFzBufModel(t, m, true).run(script)
	})
}

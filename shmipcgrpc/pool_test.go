package shmipcgrpc

import (
	"testing"
)

// TestDirtyPool: Get returns buffers of the length asked for, a buffer put
// back is handed out again for a request of its size class, and buffers
// outside the classes are allocated, not pooled.
func TestDirtyPool(t *testing.T) {
	p := &dirtyPool{}
	for _, n := range []int{0, 1, 255, 256, 257, 16 << 10, 1<<20 + 1, 1 << 24, 1<<24 + 1} {
		b := p.Get(n)
		if len(*b) != n {
			t.Fatalf("Get(%d) returned %d bytes", n, len(*b))
		}
		if n > 0 && n <= 1<<24 && cap(*b) != 1<<poolClass(n) {
			t.Fatalf("Get(%d) has capacity %d, want %d", n, cap(*b), 1<<poolClass(n))
		}
		p.Put(b)
	}

	// Reuse: mark a buffer, put a prefix of it back, get one of the same
	// class. sync.Pool may drop it (a GC in between), so try a few times.
	reused := false
	for range 10 {
		b := p.Get(16 << 10)
		(*b)[0] = 0xAB
		first := &(*b)[0]
		*b = (*b)[:100]
		p.Put(b)
		c := p.Get(10 << 10)
		if len(*c) != 10<<10 {
			t.Fatalf("Get(10 KiB) returned %d bytes", len(*c))
		}
		if &(*c)[0] == first {
			reused = true
			if (*c)[0] != 0xAB {
				t.Fatal("the reused buffer was cleared")
			}
			break
		}
	}
	if !reused {
		t.Fatal("a buffer put back was never handed out again")
	}

	// A buffer the pool did not make is not kept.
	foreign := make([]byte, 1000)
	p.Put(&foreign)
	if b := p.Get(1000); cap(*b) != 1024 {
		t.Fatalf("Get(1000) has capacity %d after a foreign Put", cap(*b))
	}
}

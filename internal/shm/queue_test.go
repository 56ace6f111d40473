package shm

import (
	"encoding/binary"
	"errors"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"unsafe"
)

// Unit tests of the IO queue (queue.go) on a region in Go memory, mapped
// twice as the two processes of a session map it: the producer puts on its
// view, the consumer pops from its own.

func putAll(t *testing.T, q *Queue, elems ...Elem) {
	t.Helper()
	for _, e := range elems {
		if ok, err := q.Put(e); !ok || err != nil {
			t.Fatalf("put %+v: %v, %v", e, ok, err)
		}
	}
}

func queueCounter(mem []byte, off int) *int64 {
	return (*int64)(unsafe.Pointer(&mem[off]))
}

// TestQueueFIFO: elements cross from one process's view to the other's in
// order and intact, through several wraps of the ring, and each half of the
// region is its own queue.
func TestQueueFIFO(t *testing.T) {
	_, client, server := newHeapQueues(t, 16)
	prod, cons := client[0], server[0]
	next := uint32(1)
	for round := range 5 {
		n := 3 + 5*round // 3, 8, 13, 18 (full, then one more), 23
		var sent []Elem
		for range n {
			e := Elem{ID: next, Offset: next * 20, Status: next % 2}
			ok, err := prod.Put(e)
			if err != nil {
				t.Fatal(err)
			}
			if !ok {
				break
			}
			sent = append(sent, e)
			next++
		}
		if want := min(n, 16); len(sent) != want {
			t.Fatalf("round %d: %d puts succeeded, want %d", round, len(sent), want)
		}
		if d := prod.Depth(); d != int64(len(sent)) {
			t.Errorf("round %d: producer sees depth %d, want %d", round, d, len(sent))
		}
		for i, want := range sent {
			got, ok, err := cons.pop()
			if !ok || err != nil || got != want {
				t.Fatalf("round %d pop %d: %+v %v %v, want %+v", round, i, got, ok, err, want)
			}
		}
		if _, ok, err := cons.pop(); ok || err != nil {
			t.Fatalf("round %d: pop from an empty queue: %v, %v", round, ok, err)
		}
		if !cons.IsEmpty() || prod.Depth() != 0 {
			t.Errorf("round %d: empty %v, depth %d after popping everything", round, cons.IsEmpty(), prod.Depth())
		}
	}
	if _, ok, _ := server[1].pop(); ok {
		t.Error("the server-to-client queue has an element; only the client-to-server one was used")
	}
}

// TestQueueFull: a full queue refuses an element without an error, and
// takes one again as soon as the consumer has popped.
func TestQueueFull(t *testing.T) {
	_, client, server := newHeapQueues(t, 16)
	prod, cons := server[1], client[1]
	for i := range uint32(16) {
		putAll(t, prod, Elem{ID: i + 1})
	}
	if ok, err := prod.Put(Elem{ID: 99}); ok || err != nil {
		t.Fatalf("put on a full queue: %v, %v; want false, nil", ok, err)
	}
	if e, ok, err := cons.pop(); !ok || err != nil || e.ID != 1 {
		t.Fatalf("pop: %+v %v %v", e, ok, err)
	}
	putAll(t, prod, Elem{ID: 17})
	for want := uint32(2); want <= 17; want++ {
		if e, ok, err := cons.pop(); !ok || err != nil || e.ID != want {
			t.Fatalf("pop: %+v %v %v, want id %d", e, ok, err, want)
		}
	}
}

// TestQueuePeekSkip: peek shows the oldest element without taking it, and
// what skip takes is what peek returned even if the slot is rewritten in
// between.
func TestQueuePeekSkip(t *testing.T) {
	mem, client, server := newHeapQueues(t, 16)
	putAll(t, client[0], Elem{ID: 5, Offset: 8}, Elem{ID: 7, Offset: 16})
	q := server[0]
	for range 2 {
		if e, ok, err := q.Peek(); !ok || err != nil || e.ID != 5 {
			t.Fatalf("peek: %+v %v %v, want id 5", e, ok, err)
		}
	}
	binary.LittleEndian.PutUint32(mem[queueHeaderSize+elemIDOff:], 666) // the peer rewrites slot 0
	q.Skip()
	if e, ok, err := q.Peek(); !ok || err != nil || e.ID != 7 {
		t.Fatalf("peek after skip: %+v %v %v, want id 7", e, ok, err)
	}
	if d := client[0].Depth(); d != 1 {
		t.Errorf("the producer sees depth %d after one skip, want 1", d)
	}
}

// TestQueueConsumerOwnsHead: the consumer keeps its own head, so a head
// rewritten in shared memory changes nothing it pops and is put right by
// its next pop.
func TestQueueConsumerOwnsHead(t *testing.T) {
	mem, client, server := newHeapQueues(t, 16)
	putAll(t, client[0], Elem{ID: 1}, Elem{ID: 2}, Elem{ID: 3})
	head := queueCounter(mem, queueHeadOff)
	if e, _, _ := server[0].pop(); e.ID != 1 {
		t.Fatalf("first pop: id %d", e.ID)
	}
	atomic.StoreInt64(head, 1000)
	if e, ok, err := server[0].pop(); !ok || err != nil || e.ID != 2 {
		t.Fatalf("pop after the head was rewritten: %+v %v %v, want id 2", e, ok, err)
	}
	if h := atomic.LoadInt64(head); h != 2 {
		t.Errorf("shared head %d after the pop, want 2", h)
	}
}

// TestQueueCorruptCounters: counters the peer moved too far apart, or
// backwards, make put and pop fail with ErrProtocol instead of reading or
// writing a slot that is not theirs.
func TestQueueCorruptCounters(t *testing.T) {
	cases := []struct {
		name       string
		counterOff int   // the counter the peer owns
		to         int64 // relative to the other counter
		consumer   bool  // the consumer sees the damage (else the producer)
	}{
		{"tail past capacity", queueTailOff, 17, true},
		{"tail 2^32 ahead", queueTailOff, 1 << 32, true},
		{"tail behind head", queueTailOff, -1, true},
		{"head ahead of tail", queueHeadOff, 1, false},
		{"head 2^32 behind tail", queueHeadOff, -1 << 32, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			mem, client, server := newHeapQueues(t, 16)
			putAll(t, client[0], Elem{ID: 1}, Elem{ID: 2})
			if _, ok, err := server[0].pop(); !ok || err != nil {
				t.Fatalf("pop: %v %v", ok, err)
			}
			// now head 1, tail 2
			other := int64(1)
			if tc.counterOff == queueHeadOff {
				other = 2
			}
			atomic.StoreInt64(queueCounter(mem, tc.counterOff), other+tc.to)
			var err error
			if tc.consumer {
				_, _, err = server[0].pop()
			} else {
				_, err = client[0].Put(Elem{ID: 3})
			}
			if !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "apart") {
				t.Errorf("got %v, want ErrProtocol saying the counters are too far apart", err)
			}
		})
	}
}

// TestQueueWorkingFlag: the producer's wake-up test succeeds once per
// clearing of the flag by the consumer, and the flag is shared memory.
func TestQueueWorkingFlag(t *testing.T) {
	mem, client, server := newHeapQueues(t, 16)
	flag := (*uint32)(unsafe.Pointer(&mem[queueFlagOff]))
	prod, cons := client[0], server[0]
	if !prod.MarkWorking() {
		t.Fatal("markWorking on a clear flag reported false: no wake-up would be sent")
	}
	if prod.MarkWorking() {
		t.Error("markWorking reported true twice: a second wake-up for one sleep")
	}
	cons.SetWorking(false)
	if atomic.LoadUint32(flag) != 0 {
		t.Error("setWorking(false) did not clear the shared flag")
	}
	cons.SetWorking(true)
	if prod.MarkWorking() {
		t.Error("markWorking reported true while the consumer works")
	}
	cons.SetWorking(false)
	if !prod.MarkWorking() || atomic.LoadUint32(flag) != 1 {
		t.Error("markWorking after the consumer slept did not set the flag")
	}
	if !server[1].MarkWorking() {
		t.Error("the other half's flag was set too")
	}
}

// TestMapQueuesRejects: a queue region whose size, capacity fields or
// counters cannot be right is refused.
func TestMapQueuesRejects(t *testing.T) {
	le := binary.LittleEndian
	size := QueueRegionSize(16)
	cases := []struct {
		name   string
		size   int
		damage func(mem []byte)
		want   string
	}{
		{"odd size", size + 1, nil, "cannot hold"},
		{"too small for one element each", 2 * queueHeaderSize, nil, "cannot hold"},
		{"capacity not a multiple of 16", QueueRegionSize(24), nil, "multiple of 16"},
		{"halves not whole elements", size + 2, nil, "multiple of 16"},
		{"first capacity field wrong", size, func(m []byte) { le.PutUint32(m[queueCapOff:], 32) }, "client-to-server"},
		{"second capacity field wrong", size, func(m []byte) { le.PutUint32(m[size/2+queueCapOff:], 8) }, "server-to-client"},
		{"negative head", size, func(m []byte) { le.PutUint64(m[queueHeadOff:], 1<<63) }, "negative"},
		{"tail behind head", size, func(m []byte) { le.PutUint64(m[queueHeadOff:], 5); le.PutUint64(m[queueTailOff:], 4) }, "apart"},
		{"tail beyond capacity", size, func(m []byte) { le.PutUint64(m[size/2+queueTailOff:], 17) }, "apart"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			mem := alignedBytes(tc.size)[:tc.size]
			if tc.size >= 2*queueHeaderSize {
				InitQueues(mem, uint32(max(0, (tc.size/2-queueHeaderSize)/queueElemSize)))
			}
			if tc.damage != nil {
				tc.damage(mem)
			}
			if _, _, err := MapQueues(mem); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("mapQueues: %v; want an error saying %q", err, tc.want)
			}
		})
	}
	t.Run("counters of a running session", func(t *testing.T) {
		mem := alignedBytes(size)
		InitQueues(mem, 16)
		le.PutUint64(mem[queueHeadOff:], 1<<40)
		le.PutUint64(mem[queueTailOff:], 1<<40+16)
		c2s, _, err := MapQueues(mem)
		if err != nil {
			t.Fatalf("mapQueues of a full queue far into its life: %v", err)
		}
		if ok, err := c2s.Put(Elem{ID: 1}); ok || err != nil {
			t.Errorf("put on the full queue: %v, %v; want false, nil", ok, err)
		}
		if c2s.Depth() != 16 {
			t.Errorf("depth %d, want 16", c2s.Depth())
		}
	})
}

// TestQueueConcurrent: a producer and a consumer running at once pass many
// elements through a small ring, none lost, duplicated or reordered.
func TestQueueConcurrent(t *testing.T) {
	_, client, server := newHeapQueues(t, 16)
	const n = 20000
	done := make(chan error, 1)
	go func() {
		for i := uint32(1); i <= n; {
			ok, err := client[0].Put(Elem{ID: i, Offset: ^i})
			if err != nil {
				done <- err
				return
			}
			if ok {
				i++
			} else {
				runtime.Gosched()
			}
		}
		done <- nil
	}()
	for want := uint32(1); want <= n; {
		e, ok, err := server[0].pop()
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			runtime.Gosched()
			continue
		}
		if e.ID != want || e.Offset != ^want {
			t.Fatalf("popped %+v, want id %d", e, want)
		}
		want++
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

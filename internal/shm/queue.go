package shm

import (
	"encoding/binary"
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"
)

// IO queue layout (docs/protocol.md §7). The queue region holds two queues: the
// first half carries client→server elements, the second server→client.
const (
	queueHeaderSize = 24
	queueElemSize   = 12 // u32 stream id, u32 root slice offset, u32 status
	MaxQueueCap     = 1 << 20

	elemIDOff     = 0
	elemOffsetOff = 4
	elemStatusOff = 8
)

// Stream states carried in the status field (docs/protocol.md §9.3).
const (
	StatusOpened = 0
	StatusClosed = 1
	StatusMask   = 0xFF
)

// QueueRegionSize is the size of a queue region with cap elements per half.
func QueueRegionSize(cap uint32) int {
	return 2 * (queueHeaderSize + queueElemSize*int(cap))
}

// Elem is an IO queue element: a stream id, the offset of its message's
// root slice header (0 for none) and the stream's status.
type Elem struct {
	ID     uint32
	Offset uint32
	Status uint32
}

// Queue is one half of a queue region, produced into by one process and
// consumed by the other. Each side keeps its own counter locally and only
// reads the other side's from shared memory, checking it before use.
type Queue struct {
	mem  []byte
	cap  uint32
	head *int64
	tail *int64
	flag *uint32

	mu    sync.Mutex   // serialises producers in this process
	ptail int64        // producer: next tail; guarded by mu
	chead atomic.Int64 // consumer: next head; written by the receive loop
}

// InitQueues writes both queue headers of a new, zero-filled region.
func InitQueues(mem []byte, cap uint32) {
	half := len(mem) / 2
	binary.LittleEndian.PutUint32(mem[queueCapOff:], cap)
	binary.LittleEndian.PutUint32(mem[half+queueCapOff:], cap)
}

// MapQueues checks a queue region and returns its two halves: the
// client→server queue, then the server→client queue.
func MapQueues(mem []byte) (c2s, s2c *Queue, err error) {
	size := len(mem)
	if size%2 != 0 || size/2 < queueHeaderSize+queueElemSize {
		return nil, nil, fmt.Errorf("queue region of %d bytes cannot hold two queues", size)
	}
	half := size / 2
	want := (half - queueHeaderSize) / queueElemSize
	if (half-queueHeaderSize)%queueElemSize != 0 || want%16 != 0 || want > MaxQueueCap {
		return nil, nil, fmt.Errorf("queue region of %d bytes does not hold two queues of a capacity that is a multiple of 16 up to %d", size, MaxQueueCap)
	}
	if c2s, err = newQueue(mem[:half], uint32(want)); err != nil {
		return nil, nil, fmt.Errorf("client-to-server queue: %w", err)
	}
	if s2c, err = newQueue(mem[half:], uint32(want)); err != nil {
		return nil, nil, fmt.Errorf("server-to-client queue: %w", err)
	}
	return c2s, s2c, nil
}

func newQueue(mem []byte, want uint32) (*Queue, error) {
	if got := binary.LittleEndian.Uint32(mem[queueCapOff:]); got != want {
		return nil, fmt.Errorf("header says capacity %d, its size says %d", got, want)
	}
	q := &Queue{
		mem:  mem,
		cap:  want,
		head: (*int64)(unsafe.Pointer(&mem[queueHeadOff])),
		tail: (*int64)(unsafe.Pointer(&mem[queueTailOff])),
		flag: (*uint32)(unsafe.Pointer(&mem[queueFlagOff])),
	}
	// A new session starts from whatever counters the region holds (zero
	// when the client has just created it); they only need to be sane.
	q.ptail = shmLoadInt64(q.tail)
	head := shmLoadInt64(q.head)
	q.chead.Store(head)
	if head < 0 || q.ptail < 0 {
		return nil, fmt.Errorf("negative counters: head %d, tail %d", head, q.ptail)
	}
	if n := q.ptail - head; n < 0 || n > int64(q.cap) {
		return nil, fmt.Errorf("head %d and tail %d are %d apart, capacity %d", head, q.ptail, n, q.cap)
	}
	return q, nil
}

// Cap is the number of elements the queue holds.
func (q *Queue) Cap() uint32 { return q.cap }

func (q *Queue) slot(counter int64) []byte {
	off := queueHeaderSize + int(uint64(counter)%uint64(q.cap))*queueElemSize
	return q.mem[off : off+queueElemSize]
}

func (q *Queue) corrupt(head, tail int64) error {
	return fmt.Errorf("%w: IO queue: head %d and tail %d are %d apart, capacity %d", ErrProtocol, head, tail, tail-head, q.cap)
}

// Put appends an element. It reports false when the queue is full. The
// tail is published with a sequentially consistent store, after the
// element and the message it names have been written.
func (q *Queue) Put(e Elem) (bool, error) {
	q.mu.Lock()
	defer q.mu.Unlock() // deferred: a fault in a shrunk mapping must not leave it locked
	t := q.ptail
	h := shmLoadInt64(q.head)
	if n := t - h; n < 0 || n > int64(q.cap) {
		return false, q.corrupt(h, t)
	} else if n == int64(q.cap) {
		return false, nil
	}
	s := q.slot(t)
	binary.LittleEndian.PutUint32(s[elemIDOff:], e.ID)
	binary.LittleEndian.PutUint32(s[elemOffsetOff:], e.Offset)
	binary.LittleEndian.PutUint32(s[elemStatusOff:], e.Status)
	q.ptail = t + 1
	shmStoreInt64(q.tail, t+1)
	return true, nil
}

// Peek returns the oldest element without removing it, or false when the
// queue is empty; skip then removes it. Only one goroutine at a time may
// consume. The element is read once: what Skip removes is what Peek
// returned, whatever the peer writes into the slot meanwhile.
func (q *Queue) Peek() (Elem, bool, error) {
	h := q.chead.Load()
	t := shmLoadInt64(q.tail)
	if n := t - h; n < 0 || n > int64(q.cap) {
		return Elem{}, false, q.corrupt(h, t)
	} else if n == 0 {
		return Elem{}, false, nil
	}
	s := q.slot(h)
	e := Elem{
		ID:     binary.LittleEndian.Uint32(s[elemIDOff:]),
		Offset: binary.LittleEndian.Uint32(s[elemOffsetOff:]),
		Status: binary.LittleEndian.Uint32(s[elemStatusOff:]),
	}
	return e, true, nil
}

// Skip removes the element Peek returned.
func (q *Queue) Skip() {
	h := q.chead.Load() + 1
	q.chead.Store(h)
	shmStoreInt64(q.head, h)
}

// Depth counts the elements published and not yet taken, as this side sees.
func (q *Queue) Depth() int64 {
	return max(0, shmLoadInt64(q.tail)-shmLoadInt64(q.head))
}

// IsEmpty reports whether the consumer has taken every element published.
func (q *Queue) IsEmpty() bool {
	return shmLoadInt64(q.tail) == q.chead.Load()
}

// LooksEmpty is IsEmpty for a spinner. It also reads the slot the next
// element will be written to, so that the element's cache line is fetched
// from the producer's core along with the tail's rather than after it.
func (q *Queue) LooksEmpty() bool {
	h := q.chead.Load()
	_ = shmLoadUint32((*uint32)(unsafe.Pointer(&q.slot(h)[0])))
	return shmLoadInt64(q.tail) == h
}

// MarkWorking sets the working flag if it was clear; the producer sends a
// wake-up only then (docs/protocol.md §7.5). Loading first spares an awake
// consumer a write to the shared line; the load is still ordered after the
// tail store, as both are sequentially consistent.
func (q *Queue) MarkWorking() bool {
	return shmLoadUint32(q.flag) == 0 && shmCASUint32(q.flag, 0, 1)
}

// SetWorking stores the consumer's working flag.
func (q *Queue) SetWorking(on bool) {
	var v uint32
	if on {
		v = 1
	}
	shmStoreUint32(q.flag, v)
}

package shmipc

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
	maxQueueCap     = 1 << 20

	elemIDOff     = 0
	elemOffsetOff = 4
	elemStatusOff = 8
)

// Stream states carried in the status field (docs/protocol.md §9.3).
const (
	statusOpened = 0
	statusClosed = 1
	statusMask   = 0xFF
)

// queueRegionSize is the size of a queue region whose halves hold cap
// elements each.
func queueRegionSize(cap uint32) int {
	return 2 * (queueHeaderSize + queueElemSize*int(cap))
}

type queueElem struct {
	id     uint32
	offset uint32
	status uint32
}

// ioQueue is one half of a queue region, produced into by one process and
// consumed by the other. Each side keeps its own counter locally and only
// reads the other side's from shared memory, checking it before use.
type ioQueue struct {
	mem  []byte
	cap  uint32
	head *int64
	tail *int64
	flag *uint32

	mu    sync.Mutex   // serialises producers in this process
	ptail int64        // producer: next tail; guarded by mu
	chead atomic.Int64 // consumer: next head; written by the receive loop
}

// initQueueRegion writes both queue headers of a new, zero-filled region.
func initQueueRegion(mem []byte, cap uint32) {
	half := len(mem) / 2
	binary.LittleEndian.PutUint32(mem[queueCapOff:], cap)
	binary.LittleEndian.PutUint32(mem[half+queueCapOff:], cap)
}

// mapQueues checks a queue region and returns its two halves: the
// client→server queue, then the server→client queue.
func mapQueues(mem []byte) (c2s, s2c *ioQueue, err error) {
	size := len(mem)
	if size%2 != 0 || size/2 < queueHeaderSize+queueElemSize {
		return nil, nil, fmt.Errorf("queue region of %d bytes cannot hold two queues", size)
	}
	half := size / 2
	want := (half - queueHeaderSize) / queueElemSize
	if (half-queueHeaderSize)%queueElemSize != 0 || want%16 != 0 || want > maxQueueCap {
		return nil, nil, fmt.Errorf("queue region of %d bytes does not hold two queues of a capacity that is a multiple of 16 up to %d", size, maxQueueCap)
	}
	if c2s, err = newQueue(mem[:half], uint32(want)); err != nil {
		return nil, nil, fmt.Errorf("client-to-server queue: %w", err)
	}
	if s2c, err = newQueue(mem[half:], uint32(want)); err != nil {
		return nil, nil, fmt.Errorf("server-to-client queue: %w", err)
	}
	return c2s, s2c, nil
}

func newQueue(mem []byte, want uint32) (*ioQueue, error) {
	if got := binary.LittleEndian.Uint32(mem[queueCapOff:]); got != want {
		return nil, fmt.Errorf("header says capacity %d, its size says %d", got, want)
	}
	q := &ioQueue{
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

func (q *ioQueue) slot(counter int64) []byte {
	off := queueHeaderSize + int(uint64(counter)%uint64(q.cap))*queueElemSize
	return q.mem[off : off+queueElemSize]
}

func (q *ioQueue) corrupt(head, tail int64) error {
	return fmt.Errorf("%w: IO queue: head %d and tail %d are %d apart, capacity %d", ErrProtocol, head, tail, tail-head, q.cap)
}

// put appends an element. It reports false when the queue is full. The
// tail is published with a sequentially consistent store, after the
// element and the message it names have been written.
func (q *ioQueue) put(e queueElem) (bool, error) {
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
	binary.LittleEndian.PutUint32(s[elemIDOff:], e.id)
	binary.LittleEndian.PutUint32(s[elemOffsetOff:], e.offset)
	binary.LittleEndian.PutUint32(s[elemStatusOff:], e.status)
	q.ptail = t + 1
	shmStoreInt64(q.tail, t+1)
	return true, nil
}

// peek returns the oldest element without removing it, or false when the
// queue is empty; skip then removes it. Only one goroutine at a time may
// consume. The element is read once: what skip removes is what peek
// returned, whatever the peer writes into the slot meanwhile.
func (q *ioQueue) peek() (queueElem, bool, error) {
	h := q.chead.Load()
	t := shmLoadInt64(q.tail)
	if n := t - h; n < 0 || n > int64(q.cap) {
		return queueElem{}, false, q.corrupt(h, t)
	} else if n == 0 {
		return queueElem{}, false, nil
	}
	s := q.slot(h)
	e := queueElem{
		id:     binary.LittleEndian.Uint32(s[elemIDOff:]),
		offset: binary.LittleEndian.Uint32(s[elemOffsetOff:]),
		status: binary.LittleEndian.Uint32(s[elemStatusOff:]),
	}
	return e, true, nil
}

// skip removes the element peek returned.
func (q *ioQueue) skip() {
	h := q.chead.Load() + 1
	q.chead.Store(h)
	shmStoreInt64(q.head, h)
}

// depth is the number of elements published and not yet taken, as far as
// this side can tell.
func (q *ioQueue) depth() int64 {
	return max(0, shmLoadInt64(q.tail)-shmLoadInt64(q.head))
}

// isEmpty reports whether the consumer has taken every element published.
func (q *ioQueue) isEmpty() bool {
	return shmLoadInt64(q.tail) == q.chead.Load()
}

// looksEmpty is isEmpty for a spinner. It also reads the slot the next
// element will be written to, so that the element's cache line is fetched
// from the producer's core along with the tail's rather than after it.
func (q *ioQueue) looksEmpty() bool {
	h := q.chead.Load()
	_ = shmLoadUint32((*uint32)(unsafe.Pointer(&q.slot(h)[0])))
	return shmLoadInt64(q.tail) == h
}

// markWorking sets the working flag if it was clear; the producer sends a
// wake-up only then (docs/protocol.md §7.5). Loading first spares an awake
// consumer a write to the shared line; the load is still ordered after the
// tail store, as both are sequentially consistent.
func (q *ioQueue) markWorking() bool {
	return shmLoadUint32(q.flag) == 0 && shmCASUint32(q.flag, 0, 1)
}

// setWorking stores the consumer's working flag.
func (q *ioQueue) setWorking(on bool) {
	var v uint32
	if on {
		v = 1
	}
	shmStoreUint32(q.flag, v)
}

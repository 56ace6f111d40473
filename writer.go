package shmipc

import (
	"fmt"
	"io"
	"os"
	"slices"
	"unsafe"

	"github.com/goshm/shmipc/internal/shm"
)

// BufferWriter builds an outgoing message directly in shared memory. Nothing
// is sent until Stream.Flush.
//
// A BufferWriter is not safe for concurrent use, nor together with
// Stream.Write on the same stream.
type BufferWriter interface {
	io.ByteWriter
	io.StringWriter

	// Reserve returns n contiguous bytes at the end of the message for the
	// caller to fill. They belong to the message and stay valid until the
	// next Flush or Close. When shared memory cannot hold n bytes in one
	// slice, the bytes are private memory and the message will be sent as
	// fallback data. Reserve is for serialising a message in place; to
	// send bytes you already hold, use WriteBytes. A negative n, or one
	// over MaxReserve, is an error (not a panic, as make's would be).
	Reserve(n int) ([]byte, error)

	// WriteBytes appends a copy of p to the message.
	WriteBytes(p []byte) (int, error)

	// Len is the number of bytes in the message so far.
	Len() int
}

// minHeapSegment is the smallest private segment of a writer that fell back.
const minHeapSegment = 64 << 10

// streamWriter is the sending side of a stream: the message being built.
// It is used by one goroutine at a time (see BufferWriter).
type streamWriter struct {
	st   *Stream
	segs []shm.Segment
	size int
	heap bool // some segment is private memory: the message goes as fallback
	// closedUnsent: Close discarded a message built and not yet flushed,
	// whose Flush must then fail rather than find nothing to send.
	closedUnsent bool
}

func (w *streamWriter) last() *shm.Segment {
	if len(w.segs) == 0 {
		return nil
	}
	return &w.segs[len(w.segs)-1]
}

func (w *streamWriter) appendHeap(want int) {
	w.heap = true
	w.segs = append(w.segs, shm.Segment{Data: make([]byte, max(want, minHeapSegment)), List: shm.HeapSegment})
}

// usable reports whether the writer may build a message now.
func (w *streamWriter) usable() error {
	st := w.st
	if err := st.s.sendable(); err != nil {
		return err
	}
	if st.writeClosed.Load() {
		return st.writeClosedErr()
	}
	return nil
}

// MaxReserve is the most bytes one BufferWriter.Reserve (or netpoll
// Malloc) hands out: 1 TiB, more than any machine holds and far below what
// makes make([]byte, n) panic. A count beyond it, such as a length prefix
// read from a corrupt message, gets an error that wraps ErrLimitExceeded;
// one that fits it but not in memory fails as make([]byte, n) does.
const MaxReserve = 1 << 40

// reserve returns n contiguous bytes at the end of the message.
func (w *streamWriter) reserve(n int) ([]byte, error) {
	if n < 0 {
		return nil, errNegative
	}
	if uint64(n) > MaxReserve {
		return nil, fmt.Errorf("%w: Reserve of %d bytes, more than MaxReserve (%d)", ErrLimitExceeded, n, MaxReserve)
	}
	if err := w.usable(); err != nil {
		return nil, err
	}
	l := w.last()
	if l == nil || len(l.Data)-l.N < n {
		if err := w.grow(n, true); err != nil {
			return nil, err
		}
		l = w.last()
	}
	p := l.Data[l.N : l.N+n : l.N+n]
	if l.List != shm.HeapSegment {
		commitPages(p)
	}
	l.N += n
	w.size += n
	return p, nil
}

// commitPages writes a zero to every page of p, a piece of a slice about to
// be handed to the application. Regions are sparse, and a page that cannot
// be committed (a full tmpfs) faults on its first write: here, inside the
// caller's access, that is an error, not a crash in application code.
func commitPages(p []byte) {
	pageSize := os.Getpagesize()
	if len(p) == 0 {
		return
	}
	p[0] = 0
	for i := pageSize - int(uintptr(unsafe.Pointer(&p[0]))%uintptr(pageSize)); i < len(p); i += pageSize {
		p[i] = 0
	}
}

// writeTo appends a copy of p, taking slices as it goes.
func writeTo[T string | []byte](w *streamWriter, p T) (int, error) {
	if err := w.usable(); err != nil {
		return 0, err
	}
	return w.fill(len(p), func(dst []byte, done int) { copyCached(dst, p[done:]) })
}

// fill adds n bytes to the message, taking slices as it goes, and lets put
// write each piece dst of them, done bytes in. On error it keeps what it
// added and returns how much that is.
func (w *streamWriter) fill(n int, put func(dst []byte, done int)) (int, error) {
	done := 0
	for done < n {
		l := w.last()
		if l == nil || l.N == len(l.Data) {
			if err := w.grow(n-done, false); err != nil {
				w.size += done
				return done, err
			}
			l = w.last()
		}
		c := min(len(l.Data)-l.N, n-done)
		put(l.Data[l.N:l.N+c], done)
		l.N += c
		done += c
	}
	w.size += done
	return done, nil
}

// reset forgets the message after it was sent or its slices freed.
func (w *streamWriter) reset() {
	clear(w.segs)
	w.segs = w.segs[:0]
	w.size = 0
	w.heap = false
}

// discard frees the slices of an unsent message. The message is dropped
// even when a fault cuts the frees short, so that none is freed twice.
func (w *streamWriter) discard() error {
	defer w.reset()
	return w.st.s.freeSegments(w.segs)
}

// locate returns the segment and offset of message position pos (< size).
func (w *streamWriter) locate(pos int) (int, int) {
	for i := range w.segs {
		if pos < w.segs[i].N {
			return i, pos
		}
		pos -= w.segs[i].N
	}
	return len(w.segs), pos
}

// appendRange appends to dst the memory holding message bytes [from, to).
func (w *streamWriter) appendRange(dst [][]byte, from, to int) [][]byte {
	if from >= to {
		return dst
	}
	i, off := w.locate(from)
	for left := to - from; left > 0; i, off = i+1, 0 {
		d := w.segs[i].Data[off:w.segs[i].N]
		if len(d) == 0 {
			continue
		}
		d = d[:min(len(d), left):min(len(d), left)]
		dst = append(dst, d)
		left -= len(d)
	}
	return dst
}

// copyAt copies src over the message bytes from position pos.
func (w *streamWriter) copyAt(pos int, src []byte) {
	if len(src) == 0 {
		return
	}
	i, off := w.locate(pos)
	for ; len(src) > 0; i, off = i+1, 0 {
		c := copyCached(w.segs[i].Data[off:w.segs[i].N], src)
		src = src[c:]
	}
}

// owns reports whether p lies in a segment's memory beyond the bytes it
// sends, where WriteDirect leaves the bytes it moves.
func (w *streamWriter) owns(p []byte) bool {
	if len(p) == 0 {
		return true
	}
	lo := uintptr(unsafe.Pointer(unsafe.SliceData(p)))
	hi := lo + uintptr(len(p))
	for i := range w.segs {
		d := w.segs[i].Data
		base := uintptr(unsafe.Pointer(unsafe.SliceData(d)))
		if lo >= base+uintptr(w.segs[i].N) && hi <= base+uintptr(cap(d)) {
			return true
		}
	}
	return false
}

// truncateKeep shrinks the message to n bytes without freeing or reusing
// the memory of the bytes cut, which the caller may still write into (for
// WriteDirect): segments keep their capacity, and their length is cut so
// that nothing is appended there.
func (w *streamWriter) truncateKeep(n int) {
	left := n
	for i := range w.segs {
		seg := &w.segs[i]
		seg.N = min(seg.N, left)
		left -= seg.N
		seg.Data = seg.Data[:seg.N]
	}
	w.size = n
}

// truncate shrinks the message to n bytes (for MallocAck), freeing the
// segments after the one holding byte n-1.
func (w *streamWriter) truncate(n int) error {
	if n == 0 {
		return w.discard()
	}
	keep, left := 0, n
	for keep < len(w.segs) && left > w.segs[keep].N {
		left -= w.segs[keep].N
		keep++
	}
	// left <= segs[keep].n: the message ends in segment keep.
	w.segs[keep].N = left
	err := w.st.s.freeSegments(w.segs[keep+1:])
	clear(w.segs[keep+1:])
	w.segs = w.segs[:keep+1]
	w.heap = slices.ContainsFunc(w.segs, func(seg shm.Segment) bool { return seg.List == shm.HeapSegment })
	w.size = n
	return err
}

// dropEmpty frees the segments that send nothing, which WriteDirect and
// Reserve(0) leave, so that only segments with data are linked. They leave
// the message before they are freed, as in discard.
func (w *streamWriter) dropEmpty() error {
	kept := w.segs[:0]
	var empty []shm.Segment
	for _, seg := range w.segs {
		if seg.N == 0 {
			empty = append(empty, seg)
		} else {
			kept = append(kept, seg)
		}
	}
	clear(w.segs[len(kept):])
	w.segs = kept
	return w.st.s.freeSegments(empty)
}

type bufferWriter Stream

// locked runs f on the stream's writer, holding its lock, in an access.
func (b *bufferWriter) locked(f func(w *streamWriter) error) error {
	st := (*Stream)(b)
	st.lockWriter()
	defer st.unlockWriter()
	return st.s.access(func() error { return f(&st.writer) })
}

func (b *bufferWriter) Reserve(n int) (p []byte, err error) {
	err = b.locked(func(w *streamWriter) (err error) { p, err = w.reserve(n); return err })
	return p, err
}

func (b *bufferWriter) WriteBytes(p []byte) (n int, err error) {
	err = b.locked(func(w *streamWriter) (err error) { n, err = writeTo(w, p); return err })
	return n, err
}

func (b *bufferWriter) WriteString(s string) (n int, err error) {
	err = b.locked(func(w *streamWriter) (err error) { n, err = writeTo(w, s); return err })
	return n, err
}

func (b *bufferWriter) WriteByte(c byte) error {
	return b.locked(func(w *streamWriter) error {
		p, err := w.reserve(1)
		if err == nil {
			p[0] = c
		}
		return err
	})
}

func (b *bufferWriter) Len() int {
	st := (*Stream)(b)
	st.lockWriter()
	defer st.unlockWriter()
	return st.writer.size
}

// copyChunk bounds the pieces copyCached copies at once.
const copyChunk = 256 << 10

// copyCached is copy in pieces under a MiB. From a MiB on, the runtime's
// copy on amd64 writes around the caches (non-temporal stores), while what
// is copied here is read right away, by the peer or the reader's caller.
func copyCached[T string | []byte](dst []byte, src T) int {
	n := min(len(dst), len(src))
	for off := 0; off < n; off += copyChunk {
		copy(dst[off:min(off+copyChunk, n)], src[off:n])
	}
	return n
}

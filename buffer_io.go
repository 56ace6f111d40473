package shmipc

import (
	"errors"
	"fmt"
	"io"
	"unsafe"
)

// BufferReader reads a stream's received bytes, zero-copy where it can.
//
// Slices returned by ReadBytes and Peek point into shared memory when the
// bytes lie in one slice of the buffer region, and into a private copy
// otherwise. Either way they stay valid until ReleasePreviousRead,
// Stream.ReleaseReadAndReuse, Stream.Read or Stream.Close is called; after
// that the memory may be reused by either process. Do not write into them.
//
// A BufferReader is not safe for concurrent use.
type BufferReader interface {
	io.ByteReader

	// ReadBytes returns the next n bytes, blocking until they have arrived.
	// If the stream ends first it returns io.EOF when nothing was left and
	// io.ErrUnexpectedEOF when fewer than n bytes were.
	ReadBytes(n int) ([]byte, error)

	// Peek returns the next n bytes without consuming them, blocking like
	// ReadBytes. The slice is valid until the next read or release.
	Peek(n int) ([]byte, error)

	// Discard skips the next n bytes, blocking like ReadBytes.
	Discard(n int) (int, error)

	// Len is the number of received bytes not yet read. It never blocks.
	Len() int

	// ReleasePreviousRead returns every slice of shared memory that has been
	// read completely to the buffer region. Slices returned by earlier reads
	// become invalid.
	ReleasePreviousRead()
}

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
	// fallback data.
	Reserve(n int) ([]byte, error)

	// WriteBytes appends a copy of p to the message.
	WriteBytes(p []byte) (int, error)

	// Len is the number of bytes in the message so far.
	Len() int
}

// segment is one piece of a received or outgoing message: a slice of the
// buffer region (list >= 0) or private memory (list < 0).
type segment struct {
	data []byte
	n    int // writer: bytes used in data
	list int32
	off  uint32
}

const heapSegment = -1

// minHeapSegment is the smallest private segment a writer allocates once it
// has to fall back.
const minHeapSegment = 64 << 10

// streamReader is the receiving side of a stream. All fields are guarded by
// the stream's mutex: the receive loop appends, readers consume.
//
// segs[:done] have been read completely but not released; segs[done:] hold
// unread data, of which the first pos bytes of segs[done] have been read.
type streamReader struct {
	st     *Stream
	segs   []segment
	done   int
	pos    int
	unread int
	// arena holds copies of reads that span segments. Its bytes stay valid
	// until the next release, so it is only reset then; a read that does not
	// fit gets a new, larger arena and leaves the old one to its users.
	arena []byte
}

// copyNext returns a copy of the next n unread bytes, from the arena.
func (r *streamReader) copyNext(n int) []byte {
	if cap(r.arena)-len(r.arena) < n {
		r.arena = make([]byte, 0, max(2*cap(r.arena), n, 4096))
	}
	p := r.arena[len(r.arena) : len(r.arena)+n : len(r.arena)+n]
	r.arena = r.arena[:len(r.arena)+n]
	r.copyOut(p)
	return p
}

func (r *streamReader) append(segs []shmSlice) {
	for _, s := range segs {
		r.segs = append(r.segs, segment{data: s.data, list: s.list, off: s.off})
		r.unread += len(s.data)
	}
}

func (r *streamReader) appendHeap(data []byte) {
	r.segs = append(r.segs, segment{data: data, list: heapSegment})
	r.unread += len(data)
	r.st.heldFallback.Add(int64(len(data)))
	r.st.s.fallbackHeld.Add(int64(len(data)))
}

// freeHeap accounts for released private segments among segs, and lets a
// receive loop waiting for room for fallback data (waitFallbackRoom) look
// again.
func (r *streamReader) freeHeap(segs []segment) {
	n := 0
	for _, seg := range segs {
		if seg.list == heapSegment {
			n += len(seg.data)
		}
	}
	if n == 0 {
		return
	}
	r.st.heldFallback.Add(-int64(n))
	r.st.s.fallbackHeld.Add(-int64(n))
	select {
	case r.st.s.fallbackRoom <- struct{}{}:
	default:
	}
}

// exposed reports whether data has been handed out that may still be in use.
func (r *streamReader) exposed() bool { return r.done > 0 || r.pos > 0 }

// contiguous returns the next n unread bytes without copying if they lie in
// one segment.
func (r *streamReader) contiguous(n int) ([]byte, bool) {
	d := r.segs[r.done].data[r.pos:]
	if len(d) >= n {
		return d[:n:n], true
	}
	return nil, false
}

// copyOut copies the next len(p) unread bytes into p without consuming them.
func (r *streamReader) copyOut(p []byte) {
	pos, i := r.pos, r.done
	for n := 0; n < len(p); i, pos = i+1, 0 {
		n += copy(p[n:], r.segs[i].data[pos:])
	}
}

// advance consumes n unread bytes.
func (r *streamReader) advance(n int) {
	r.unread -= n
	for n > 0 {
		avail := len(r.segs[r.done].data) - r.pos
		if n < avail {
			r.pos += n
			return
		}
		n -= avail
		r.done++
		r.pos = 0
	}
}

// release frees the segments read completely. It returns the first error from
// the buffer region, which means the peer corrupted it. It runs inside an
// access, as do releaseAll, copyOut and copyNext.
func (r *streamReader) release() error {
	r.arena = r.arena[:0]
	if r.done == 0 {
		return nil
	}
	r.freeHeap(r.segs[:r.done])
	err := r.st.s.freeSegments(r.segs[:r.done])
	n := copy(r.segs, r.segs[r.done:])
	clear(r.segs[n:])
	r.segs = r.segs[:n]
	r.done = 0
	return err
}

// releaseAll frees every segment, read or not.
func (r *streamReader) releaseAll() error {
	r.arena = r.arena[:0]
	r.freeHeap(r.segs)
	err := r.st.s.freeSegments(r.segs)
	clear(r.segs)
	r.segs, r.done, r.pos, r.unread = r.segs[:0], 0, 0, 0
	return err
}

// bufferReader is the BufferReader of a stream.
type bufferReader Stream

func (b *bufferReader) ReadBytes(n int) ([]byte, error) { return (*Stream)(b).next(n, true) }

func (b *bufferReader) Peek(n int) ([]byte, error) { return (*Stream)(b).next(n, false) }

// next returns the next n bytes, zero-copy when they lie in one segment,
// and consumes them if consume is set.
func (st *Stream) next(n int, consume bool) (p []byte, err error) {
	if n < 0 {
		return nil, errNegative
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	r := &st.reader
	if err := st.waitReadable(n); err != nil {
		return nil, err
	}
	if n == 0 {
		return []byte{}, nil
	}
	p, ok := r.contiguous(n)
	if !ok {
		if err := st.s.access(func() error { p = r.copyNext(n); return nil }); err != nil {
			return nil, err
		}
	}
	if consume {
		r.advance(n)
	}
	return p, nil
}

// Discard skips bytes without looking at them: it touches no shared memory.
func (b *bufferReader) Discard(n int) (int, error) {
	st := (*Stream)(b)
	if n < 0 {
		return 0, errNegative
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if err := st.waitReadable(n); err != nil {
		m := st.reader.unread
		st.reader.advance(m)
		return m, err
	}
	st.reader.advance(n)
	return n, nil
}

func (b *bufferReader) ReadByte() (c byte, err error) {
	st := (*Stream)(b)
	st.mu.Lock()
	defer st.mu.Unlock()
	r := &st.reader
	if err := st.waitReadable(1); err != nil {
		return 0, err
	}
	err = st.s.access(func() error {
		c = r.segs[r.done].data[r.pos]
		return nil
	})
	if err != nil {
		return 0, err
	}
	r.advance(1)
	return c, nil
}

func (b *bufferReader) Len() int {
	st := (*Stream)(b)
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.reader.unread
}

func (b *bufferReader) ReleasePreviousRead() {
	st := (*Stream)(b)
	st.mu.Lock()
	defer st.mu.Unlock()
	_ = st.s.access(st.reader.release)
}

var errNegative = errors.New("shmipc: negative count")

// streamWriter is the sending side of a stream: the message being built.
// It is used by one goroutine at a time (see BufferWriter).
type streamWriter struct {
	st   *Stream
	segs []segment
	size int
	heap bool // some segment is private memory: the message goes as fallback
}

func (w *streamWriter) last() *segment {
	if len(w.segs) == 0 {
		return nil
	}
	return &w.segs[len(w.segs)-1]
}

// grow appends a segment with room for at least min bytes when contiguous
// is set, or for as much of want as one slice gives otherwise. Like every
// streamWriter method that touches slices, it runs inside an access.
func (w *streamWriter) grow(want int, contiguous bool) error {
	st := w.st
	buf := st.s.buf
	if st.fallback.Load() || w.heap || w.neverFits(want, contiguous) {
		w.appendHeap(want)
		return nil
	}
	var wait spaceWait
	for {
		li, off, err := buf.alloc(want, !contiguous)
		if err != nil {
			st.s.closeWithError(err)
			return fmt.Errorf("%w: %w", ErrSessionClosed, err)
		}
		if li >= 0 {
			w.segs = append(w.segs, segment{data: buf.sliceData(li, off), list: int32(li), off: off})
			return nil
		}
		if st.s.conf.FallbackWhenFull || len(w.segs) > 0 {
			// A writer never waits while it holds part of its message:
			// writers holding slices while waiting for more could hold the
			// whole region between them and wait for ever.
			w.appendHeap(want)
			return nil
		}
		// Back-pressure: nothing is held; wait for the peer to free slices.
		if err := wait.pause(st.s, st); err != nil {
			if err == errSpaceTimeout {
				return &spaceTimeout{msg: fmt.Sprintf("shmipc: no shared memory for %d more bytes for %v: the peer is not releasing what it received", want, wait.waited())}
			}
			return err
		}
	}
}

// neverFits reports whether want more bytes cannot be had from shared
// memory however long the writer waits: one contiguous piece larger than any
// slice that can be handed out, or a message that would take more than half
// of what the region can hand out.
func (w *streamWriter) neverFits(want int, contiguous bool) bool {
	buf := w.st.s.buf
	return contiguous && want > int(buf.usable) || uint64(w.size+want) > buf.capacity/2
}

func (w *streamWriter) appendHeap(want int) {
	w.heap = true
	w.segs = append(w.segs, segment{data: make([]byte, max(want, minHeapSegment)), list: heapSegment})
}

// usable reports whether the writer may build a message now.
func (w *streamWriter) usable() error {
	st := w.st
	if err := st.s.Err(); err != nil {
		return err
	}
	if st.writeClosed.Load() {
		return ErrStreamClosed
	}
	return nil
}

// reserve returns n contiguous bytes at the end of the message.
func (w *streamWriter) reserve(n int) ([]byte, error) {
	if n < 0 {
		return nil, errNegative
	}
	if err := w.usable(); err != nil {
		return nil, err
	}
	l := w.last()
	if l == nil || len(l.data)-l.n < n {
		if err := w.grow(n, true); err != nil {
			return nil, err
		}
		l = w.last()
	}
	p := l.data[l.n : l.n+n : l.n+n]
	if l.list != heapSegment {
		commitPages(p)
	}
	l.n += n
	w.size += n
	return p, nil
}

// commitPages writes a zero to every page of p, a piece of a slice about to
// be handed to the application. Regions are sparse, and a page that cannot
// be committed (a full tmpfs) faults on its first write: here that happens
// inside the caller's access and becomes an error, instead of a crash in
// application code. On committed pages it costs one store per page.
func commitPages(p []byte) {
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
	written := 0
	for written < len(p) {
		l := w.last()
		if l == nil || l.n == len(l.data) {
			if err := w.grow(len(p)-written, false); err != nil {
				w.size += written
				return written, err
			}
			l = w.last()
		}
		c := copy(l.data[l.n:], p[written:])
		l.n += c
		written += c
	}
	w.size += written
	return written, nil
}

// reset forgets the message after it was sent or its slices freed.
func (w *streamWriter) reset() {
	clear(w.segs)
	w.segs = w.segs[:0]
	w.size = 0
	w.heap = false
}

// discard frees the slices of an unsent message.
func (w *streamWriter) discard() error {
	err := w.st.s.freeSegments(w.segs)
	w.reset()
	return err
}

package shmipc

import (
	"bytes"
	"errors"
	"io"
	"slices"

	"github.com/goshm/shmipc/internal/shm"
)

// BufferReader reads a stream's received bytes, zero-copy where it can.
//
// Slices returned by ReadBytes and Peek point into shared memory when the
// bytes lie in one slice of the buffer region, and into a private copy
// otherwise. Either way they stay valid until ReleasePreviousRead,
// Stream.Read or Stream.Close is called; after that the memory may be
// reused by either process. Do not write into them.
//
// Bytes returned in place are not a snapshot: the peer keeps the region
// mapped read-write and can change them after the caller checked them; where
// it is not trusted, validate and use a copy (Stream.Read copies).
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

	// ReleasePreviousRead gives every slice of shared memory read completely
	// back to the buffer region, invalidating slices earlier reads returned.
	ReleasePreviousRead()
}

// streamReader is the receiving side of a stream. All fields are guarded by
// the stream's mutex: the receive loop appends, readers consume.
//
// segs[:done] have been read completely but not released; segs[done:] hold
// unread data, of which the first pos bytes of segs[done] have been read.
type streamReader struct {
	st       *Stream
	segs     []shm.Segment
	done     int
	pos      int
	unread   int
	consumed uint64 // bytes read from the stream so far
	inPlace  bool   // a read handed out slices in place (contiguous) since the last release
	// arena holds copies of reads that span segments, valid until the next
	// release; a read that does not fit gets a new, larger arena.
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

func (r *streamReader) append(segs []shm.Segment) {
	for _, seg := range segs {
		r.unread += len(seg.Data)
	}
	r.segs = append(r.segs, segs...)
}

// holdsShared reports whether the application may hold slices of the
// buffer region handed to it in place (ReadBytes, Peek, the netpoll reader)
// and not released. Data read by copying (Read) or not read yet does not
// count: the stream's reader will copy and free it.
func (r *streamReader) holdsShared() bool {
	return r.inPlace && slices.ContainsFunc(r.segs[:min(r.done+1, len(r.segs))],
		func(seg shm.Segment) bool { return seg.List != shm.HeapSegment })
}

func (r *streamReader) appendHeap(data []byte) {
	r.segs = append(r.segs, shm.Segment{Data: data, List: shm.HeapSegment})
	r.unread += len(data)
	r.st.heldFallback.Add(int64(len(data)))
	r.st.s.fallbackHeld.Add(int64(len(data)))
}

// freeHeap accounts for released private segments among segs, and wakes a
// receive loop waiting for room for fallback data (serveStalled).
func (r *streamReader) freeHeap(segs []shm.Segment) {
	n := 0
	for _, seg := range segs {
		if seg.List == shm.HeapSegment {
			n += len(seg.Data)
		}
	}
	if n == 0 {
		return
	}
	r.st.heldFallback.Add(-int64(n))
	r.st.s.fallbackHeld.Add(-int64(n))
	signalChan(r.st.s.fallbackRoom)
}

// exposed reports whether data has been handed out that may still be in use.
func (r *streamReader) exposed() bool { return r.done > 0 || r.pos > 0 }

// contiguous returns the next n unread bytes uncopied if in one segment.
func (r *streamReader) contiguous(n int) ([]byte, bool) {
	d := r.segs[r.done].Data[r.pos:]
	if len(d) >= n {
		r.inPlace = true
		return d[:n:n], true
	}
	return nil, false
}

// copyOut copies the next len(p) unread bytes into p without consuming them.
func (r *streamReader) copyOut(p []byte) {
	pos, i := r.pos, r.done
	for n := 0; n < len(p); i, pos = i+1, 0 {
		n += copyCached(p[n:], r.segs[i].Data[pos:])
	}
}

// advance consumes n unread bytes.
func (r *streamReader) advance(n int) {
	r.unread -= n
	r.consumed += uint64(n)
	if n > 0 && r.st.reuse.Load()&replyOwed != 0 {
		r.st.reuse.And(^uint32(replyOwed)) // a read returned bytes (poolable)
	}
	for n > 0 {
		avail := len(r.segs[r.done].Data) - r.pos
		if n < avail {
			r.pos += n
			return
		}
		n -= avail
		r.done++
		r.pos = 0
	}
}

// release frees the segments read completely; an error means the peer
// corrupted the buffer region. It runs inside an access, as do releaseAll,
// copyOut and copyNext.
func (r *streamReader) release() error {
	r.arena = r.arena[:0]
	r.inPlace = false // slices handed out earlier are invalid from here
	if r.done == 0 {
		return nil
	}
	// Forgotten even when a fault unwinds from a free: freeing them again
	// could hand one slice to two writers.
	defer func() {
		r.segs, r.done = slices.Delete(r.segs, 0, r.done), 0
	}()
	r.freeHeap(r.segs[:r.done])
	return r.st.freeReceived(r.segs[:r.done])
}

// releaseAll frees and forgets every segment, read or not, as release does.
func (r *streamReader) releaseAll() error {
	r.arena = r.arena[:0]
	defer func() {
		clear(r.segs)
		r.segs, r.done, r.pos, r.unread = r.segs[:0], 0, 0, 0
		r.inPlace = false
	}()
	r.freeHeap(r.segs)
	return r.st.s.freeSegments(r.segs)
}

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
func (b *bufferReader) Discard(n int) (int, error) { return (*Stream)(b).skip(n, true) }

// skip consumes the next n bytes once they have arrived. If they do not,
// it consumes what is left if partial is set, else nothing.
func (st *Stream) skip(n int, partial bool) (int, error) {
	if n < 0 {
		return 0, errNegative
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	err := st.waitReadable(n)
	if err != nil {
		n = 0
		if partial {
			n = st.reader.unread
		}
	}
	st.reader.advance(n)
	return n, err
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
		c = r.segs[r.done].Data[r.pos]
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

func (b *bufferReader) ReleasePreviousRead() { _ = (*netpollReader)(b).Release() }

var errNegative = errors.New("shmipc: negative count")

// indexByte returns the position of the first c among the unread bytes,
// looking from unread position from on, or -1.
func (r *streamReader) indexByte(c byte, from int) int {
	base := 0
	for i, pos := r.done, r.pos; i < len(r.segs); i, pos = i+1, 0 {
		d := r.segs[i].Data[pos:]
		if skip := from - base; skip < len(d) {
			if j := bytes.IndexByte(d[max(skip, 0):], c); j >= 0 {
				return base + max(skip, 0) + j
			}
		}
		base += len(d)
	}
	return -1
}

// take consumes the next n unread bytes (1 <= n <= unread) and returns
// them, zero-copy when they lie in one segment.
func (r *streamReader) take(n int) []byte {
	p, ok := r.contiguous(n)
	if !ok {
		p = r.copyNext(n)
	}
	r.advance(n)
	return p
}

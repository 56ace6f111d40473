package shmipc

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"runtime/debug"
	"unsafe"

	"github.com/cloudwego/netpoll"
)

// This file adapts a Stream to the nocopy interfaces of CloudWeGo netpoll,
// so that RPC frameworks whose codecs are written against netpoll.Reader and
// netpoll.Writer (Kitex, Hertz and others) can use a stream as transport.
//
// Which calls are zero-copy:
//
//	Reader.Next, Peek, Until  zero-copy when the bytes lie in one slice of
//	                          shared memory (or one fallback frame); otherwise
//	                          a copy into the stream's read arena, which is
//	                          reused after Release and so allocates nothing
//	                          in steady state.
//	Reader.Skip, Len          no data is touched.
//	Reader.ReadString,        always copy (that is their contract).
//	ReadBinary, ReadByte
//	Reader.Slice              copies the bytes into a new netpoll.LinkBuffer.
//	Writer.Malloc, WriteByte  zero-copy: the bytes are in shared memory (or,
//	                          when shared memory cannot give them, as for
//	                          BufferWriter.Reserve, in private memory, and
//	                          the message goes as fallback data).
//	Writer.WriteString,       copy their argument into shared memory; the
//	WriteBinary, Append       caller may reuse it at once.
//	Writer.WriteDirect        copies p now and the bytes after the insertion
//	                          point again at Flush (see its doc comment).

var (
	_ netpoll.Reader = (*netpollReader)(nil)
	_ netpoll.Writer = (*netpollWriter)(nil)
)

// NetpollReader returns a netpoll.Reader over the bytes the stream receives.
//
// It shares the stream's receive buffer with BufferReader and Read: Release
// is BufferReader.ReleasePreviousRead, and slices returned by Next, Peek and
// Until stay valid until Release, ReleaseReadAndReuse, Read or Close. Do not
// write into them: they may be shared memory.
//
// Reads block until enough bytes have arrived, the read deadline passes
// (the error satisfies net.Error with Timeout() true and matches
// os.ErrDeadlineExceeded), the peer closes the stream (io.EOF, or
// io.ErrUnexpectedEOF when some but not enough bytes are left), the stream
// is closed (ErrStreamClosed) or the session ends (its Err).
//
// Like BufferReader, the Reader is not safe for concurrent use.
func (st *Stream) NetpollReader() netpoll.Reader { return (*netpollReader)(st) }

// NetpollWriter returns a netpoll.Writer that builds the stream's next
// message in shared memory; Flush sends it.
//
// It shares the message being built with BufferWriter and Write. WriteDirect
// leaves work for Flush that this Writer keeps: finish a message in which
// WriteDirect was used with this Writer's Flush, not Stream.Flush or
// another Writer. Simplest is to keep one Writer per stream.
//
// Like BufferWriter, the Writer is not safe for concurrent use, nor
// together with Write on the same stream.
func (st *Stream) NetpollWriter() netpoll.Writer { return &netpollWriter{st: st} }

// netpollReader is the netpoll.Reader of a stream.
type netpollReader Stream

// Next returns the next n bytes and consumes them, blocking until they have
// arrived. They are shared memory when they lie in one slice and a copy in
// the read arena otherwise; either way they are valid until Release.
func (b *netpollReader) Next(n int) ([]byte, error) { return (*Stream)(b).next(n, true) }

// Peek is Next without consuming the bytes.
func (b *netpollReader) Peek(n int) ([]byte, error) { return (*Stream)(b).next(n, false) }

// Skip consumes the next n bytes, blocking until they have arrived. On
// error nothing is consumed.
func (b *netpollReader) Skip(n int) error {
	st := (*Stream)(b)
	if n < 0 {
		return errNegative
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if err := st.waitReadable(n); err != nil {
		return err
	}
	st.reader.advance(n)
	return nil
}

// Until returns the bytes up to and including the next delim, blocking
// until delim arrives. If the stream ends or fails first, it consumes and
// returns what was left together with the error (io.EOF when the peer closed
// the stream).
func (b *netpollReader) Until(delim byte) (line []byte, err error) {
	st := (*Stream)(b)
	st.mu.Lock()
	defer st.mu.Unlock()
	r := &st.reader
	take := func(n int) error {
		return st.s.access(func() error { line = r.take(n); return nil })
	}
	scanned := 0
	for {
		if scanned > r.unread {
			scanned = 0 // someone else read meanwhile
		}
		i := -1
		if err := st.s.access(func() error { i = r.indexByte(delim, scanned); return nil }); err != nil {
			return nil, err
		}
		if i >= 0 {
			if err := take(i + 1); err != nil {
				return nil, err
			}
			return line, nil
		}
		scanned = r.unread
		if err := st.waitReadable(scanned + 1); err != nil {
			if r.unread > 0 {
				if terr := take(r.unread); terr != nil {
					return nil, terr
				}
			}
			if err == io.ErrUnexpectedEOF {
				err = io.EOF
			}
			return line, err
		}
	}
}

// ReadString returns the next n bytes as a string (a copy).
func (b *netpollReader) ReadString(n int) (string, error) {
	p, err := b.readCopy(n)
	if err != nil || n == 0 {
		return "", err
	}
	return unsafe.String(unsafe.SliceData(p), len(p)), nil
}

// ReadBinary returns a copy of the next n bytes that the caller owns.
func (b *netpollReader) ReadBinary(n int) ([]byte, error) { return b.readCopy(n) }

func (b *netpollReader) readCopy(n int) ([]byte, error) {
	st := (*Stream)(b)
	if n < 0 {
		return nil, errNegative
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if err := st.waitReadable(n); err != nil {
		return nil, err
	}
	p := make([]byte, n)
	if err := st.s.access(func() error { st.reader.copyOut(p); return nil }); err != nil {
		return nil, err
	}
	st.reader.advance(n)
	return p, nil
}

// ReadByte returns the next byte.
func (b *netpollReader) ReadByte() (byte, error) { return (*bufferReader)(b).ReadByte() }

// Slice returns a netpoll.Reader holding the next n bytes and then releases
// this Reader, as netpoll specifies. The bytes cannot stay in shared memory
// beyond the release, so they are copied into a new netpoll.LinkBuffer,
// which the caller owns.
func (b *netpollReader) Slice(n int) (_ netpoll.Reader, err error) {
	st := (*Stream)(b)
	if n < 0 {
		return nil, errNegative
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if err := st.waitReadable(n); err != nil {
		return nil, err
	}
	lb := netpoll.NewLinkBuffer(n)
	if n > 0 {
		p, err := lb.Malloc(n)
		if err != nil {
			return nil, err
		}
		if err := st.s.access(func() error { st.reader.copyOut(p); return nil }); err != nil {
			return nil, err
		}
		st.reader.advance(n)
		if err := lb.Flush(); err != nil {
			return nil, err
		}
	}
	if err := st.s.access(st.reader.release); err != nil {
		return nil, err
	}
	return lb, nil
}

// Release frees everything read so far (BufferReader.ReleasePreviousRead).
// Slices returned by earlier reads become invalid. An error means the peer
// corrupted the buffer region; the session is then closed.
func (b *netpollReader) Release() error {
	st := (*Stream)(b)
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.s.access(st.reader.release)
}

// Len is the number of received bytes not yet read. It never blocks.
func (b *netpollReader) Len() int { return (*bufferReader)(b).Len() }

// indexByte returns the position of the first c among the unread bytes,
// looking from unread position from on, or -1.
func (r *streamReader) indexByte(c byte, from int) int {
	base := 0
	for i, pos := r.done, r.pos; i < len(r.segs); i, pos = i+1, 0 {
		d := r.segs[i].data[pos:]
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

// netpollWriter is the netpoll.Writer of a stream.
type netpollWriter struct {
	st *Stream
	// moves are copies WriteDirect left for Flush, in message order: the
	// bytes the caller may still write through slices from Malloc, which
	// must follow the inserted bytes in the message.
	moves []netpollMove
	srcs  [][]byte // scratch for WriteDirect
}

// netpollMove copies src to position pos of the message at Flush.
type netpollMove struct {
	pos int
	src []byte
}

var errNetpollRange = errors.New("shmipc: count beyond the bytes allocated since the last flush")

// Malloc returns n bytes at the end of the message for the caller to fill,
// valid until Flush. They are shared memory when a slice can hold them, and
// otherwise private memory, the message then going as fallback data; it
// waits for free slices as BufferWriter.Reserve does.
func (w *netpollWriter) Malloc(n int) (_ []byte, err error) {
	st := w.st
	defer st.s.endAccess(&err, debug.SetPanicOnFault(true)) // the whole method is one access
	if n < 0 {
		return nil, errNegative
	}
	st.wmu.Lock()
	defer st.wmu.Unlock()
	if n == 0 {
		if err := st.writer.usable(); err != nil {
			return nil, err
		}
		return []byte{}, nil
	}
	return st.writer.reserve(n)
}

// WriteString appends a copy of s to the message.
func (w *netpollWriter) WriteString(s string) (_ int, err error) {
	st := w.st
	defer st.s.endAccess(&err, debug.SetPanicOnFault(true)) // the whole method is one access
	st.wmu.Lock()
	defer st.wmu.Unlock()
	return writeTo(&st.writer, s)
}

// WriteBinary appends a copy of p to the message. Unlike netpoll's own
// buffers it does not keep p, so the caller may reuse p at once.
func (w *netpollWriter) WriteBinary(p []byte) (_ int, err error) {
	st := w.st
	defer st.s.endAccess(&err, debug.SetPanicOnFault(true)) // the whole method is one access
	st.wmu.Lock()
	defer st.wmu.Unlock()
	return writeTo(&st.writer, p)
}

// WriteByte appends c to the message.
func (w *netpollWriter) WriteByte(c byte) error { return (*bufferWriter)(w.st).WriteByte(c) }

// WriteDirect inserts p before the last remainCap bytes allocated since the
// last flush, as netpoll specifies: after
//
//	buf, _ := w.Malloc(nA + nB)
//	w.WriteDirect(p, nB)
//
// the message holds buf[:nA], then p, then buf[nA:], and the caller may go
// on filling all of buf until Flush.
//
// Shared memory cannot take an inserted slice of private memory, so p is
// copied into the message at once. The last remainCap bytes are moved
// behind it at Flush, so that what the caller writes into them until then
// is sent: they cost a second copy, and until Flush the message holds
// shared memory for them twice. Flush with this Writer.
func (w *netpollWriter) WriteDirect(p []byte, remainCap int) (err error) {
	st := w.st
	defer st.s.endAccess(&err, debug.SetPanicOnFault(true)) // the whole method is one access
	st.wmu.Lock()
	defer st.wmu.Unlock()
	sw := &st.writer
	if remainCap < 0 {
		return errNegative
	}
	if remainCap > sw.size {
		return fmt.Errorf("%w: WriteDirect remainCap %d, %d bytes allocated", errNetpollRange, remainCap, sw.size)
	}
	if len(p) == 0 {
		return nil
	}
	if err := sw.usable(); err != nil {
		return err
	}
	if remainCap == 0 {
		_, err := writeTo(sw, p)
		return err
	}
	at := sw.size - remainCap
	// Where the caller sees the last remainCap bytes: the message's own
	// memory, or the sources of earlier moves that end up there.
	w.srcs = w.tailSources(at, w.srcs[:0])
	w.cutMoves(at)
	sw.truncateKeep(at)
	_, err = writeTo(sw, p)
	if err == nil {
		pos := sw.size
		err = sw.extend(remainCap)
		for _, src := range w.srcs {
			w.moves = append(w.moves, netpollMove{pos: pos, src: src})
			pos += len(src)
		}
	}
	clear(w.srcs)
	if err != nil {
		w.discardLocked()
	}
	return err
}

// tailSources appends to dst the memory the caller writes the message's
// bytes [at, size) through, in order.
func (w *netpollWriter) tailSources(at int, dst [][]byte) [][]byte {
	sw := &w.st.writer
	mi := 0
	for mi < len(w.moves) && w.moves[mi].pos+len(w.moves[mi].src) <= at {
		mi++
	}
	for cur := at; cur < sw.size; {
		if mi < len(w.moves) && w.moves[mi].pos <= cur {
			m := w.moves[mi]
			s := m.src[cur-m.pos:]
			dst = append(dst, s)
			cur += len(s)
			mi++
			continue
		}
		end := sw.size
		if mi < len(w.moves) {
			end = w.moves[mi].pos
		}
		dst = sw.appendRange(dst, cur, end)
		cur = end
	}
	return dst
}

// cutMoves drops what the moves would write at position at and beyond.
func (w *netpollWriter) cutMoves(at int) {
	k := 0
	for _, m := range w.moves {
		if m.pos >= at {
			continue
		}
		if m.pos+len(m.src) > at {
			m.src = m.src[:at-m.pos]
		}
		w.moves[k] = m
		k++
	}
	clear(w.moves[k:])
	w.moves = w.moves[:k]
}

func (w *netpollWriter) discardLocked() {
	clear(w.moves)
	w.moves = w.moves[:0]
	_ = w.st.writer.discard()
}

// MallocAck keeps the first n bytes allocated since the last flush and
// discards the rest, shrinking the message; slices of the discarded bytes
// must not be used any more.
func (w *netpollWriter) MallocAck(n int) (err error) {
	st := w.st
	defer st.s.endAccess(&err, debug.SetPanicOnFault(true)) // the whole method is one access
	st.wmu.Lock()
	defer st.wmu.Unlock()
	sw := &st.writer
	if n < 0 {
		return errNegative
	}
	if n > sw.size {
		return fmt.Errorf("%w: MallocAck(%d), %d bytes allocated", errNetpollRange, n, sw.size)
	}
	w.cutMoves(n)
	return sw.truncate(n)
}

// Append appends a copy of the unflushed bytes of other, which may be a
// *netpoll.LinkBuffer (its readable bytes too) or another stream's
// NetpollWriter. other is emptied: the LinkBuffer is read and released, the
// other stream's message discarded. Other writers are not supported.
func (w *netpollWriter) Append(other netpoll.Writer) error {
	switch o := other.(type) {
	case *netpoll.LinkBuffer:
		return w.appendLinkBuffer(o)
	case *netpollWriter:
		return w.appendWriter(o)
	case nil:
		return nil
	}
	return fmt.Errorf("%w: Append of a %T", ErrNotSupported, other)
}

func (w *netpollWriter) appendLinkBuffer(lb *netpoll.LinkBuffer) (err error) {
	if err := lb.Flush(); err != nil {
		return err
	}
	st := w.st
	defer st.s.endAccess(&err, debug.SetPanicOnFault(true)) // the whole method is one access
	st.wmu.Lock()
	defer st.wmu.Unlock()
	var vs [8][]byte
	for lb.Len() > 0 {
		n := 0
		for _, v := range lb.GetBytes(vs[:]) {
			if _, err := writeTo(&st.writer, v); err != nil {
				return err
			}
			n += len(v)
		}
		if err := lb.Skip(n); err != nil {
			return err
		}
	}
	clear(vs[:])
	return lb.Release()
}

func (w *netpollWriter) appendWriter(o *netpollWriter) (err error) {
	a, b := w.st, o.st
	if a == b {
		return fmt.Errorf("%w: Append of a stream's writer to itself", ErrNotSupported)
	}
	// A fault in the other session's region is blamed on this one's: it
	// cannot tell which region faulted.
	defer a.s.endAccess(&err, debug.SetPanicOnFault(true)) // the whole method is one access
	// Lock both streams' writers in a fixed order.
	first, second := a, b
	if uintptr(unsafe.Pointer(b)) < uintptr(unsafe.Pointer(a)) {
		first, second = b, a
	}
	first.wmu.Lock()
	defer first.wmu.Unlock()
	second.wmu.Lock()
	defer second.wmu.Unlock()
	if err := o.applyMoves(); err != nil {
		o.discardLocked()
		return err
	}
	for _, seg := range b.writer.segs {
		if _, err = writeTo(&a.writer, seg.data[:seg.n]); err != nil {
			break
		}
	}
	o.discardLocked()
	return err
}

// Flush sends the message (Stream.Flush), after moving the bytes
// WriteDirect left behind. On error the message is discarded.
func (w *netpollWriter) Flush() (err error) {
	st := w.st
	defer st.s.endAccess(&err, debug.SetPanicOnFault(true)) // the whole method is one access
	st.wmu.Lock()
	defer st.wmu.Unlock()
	if len(w.moves) > 0 {
		err := st.writer.usable()
		if err == nil {
			err = w.applyMoves()
		}
		if err != nil {
			w.discardLocked()
			return err
		}
	}
	if err := st.writer.dropEmpty(); err != nil {
		w.discardLocked()
		return err
	}
	return st.flushLocked()
}

// MallocLen is the number of bytes in the message so far.
func (w *netpollWriter) MallocLen() int { return (*bufferWriter)(w.st).Len() }

var errNetpollStaleMove = errors.New("shmipc: WriteDirect of a message discarded or flushed elsewhere")

// applyMoves performs the copies WriteDirect left and forgets them. The
// stream's wmu is held.
func (w *netpollWriter) applyMoves() error {
	sw := &w.st.writer
	defer func() {
		clear(w.moves)
		w.moves = w.moves[:0]
	}()
	for _, m := range w.moves {
		if m.pos+len(m.src) > sw.size || !sw.owns(m.src) {
			return errNetpollStaleMove
		}
	}
	for _, m := range w.moves {
		sw.copyAt(m.pos, m.src)
	}
	return nil
}

// locate returns the segment holding message position pos (< size) and
// the offset in it.
func (w *streamWriter) locate(pos int) (int, int) {
	for i := range w.segs {
		if n := w.segs[i].n; pos < n {
			return i, pos
		} else {
			pos -= n
		}
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
		d := w.segs[i].data[off:w.segs[i].n]
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
		c := copy(w.segs[i].data[off:w.segs[i].n], src)
		src = src[c:]
	}
}

// owns reports whether p lies in memory a segment of the message holds but
// does not send (beyond its used bytes), where WriteDirect leaves the bytes
// it moves.
func (w *streamWriter) owns(p []byte) bool {
	if len(p) == 0 {
		return true
	}
	lo := uintptr(unsafe.Pointer(unsafe.SliceData(p)))
	hi := lo + uintptr(len(p))
	for i := range w.segs {
		d := w.segs[i].data
		base := uintptr(unsafe.Pointer(unsafe.SliceData(d)))
		if lo >= base+uintptr(w.segs[i].n) && hi <= base+uintptr(cap(d)) {
			return true
		}
	}
	return false
}

// truncateKeep shrinks the message to n bytes without freeing or reusing
// the memory of the bytes cut: the caller may still write into it (for
// WriteDirect). Segments keep their capacity but their length is cut to
// what they send, so nothing is appended there.
func (w *streamWriter) truncateKeep(n int) {
	left := n
	for i := range w.segs {
		seg := &w.segs[i]
		seg.n = min(seg.n, left)
		left -= seg.n
		seg.data = seg.data[:seg.n]
	}
	w.size = n
}

// truncate shrinks the message to n bytes (for MallocAck): the segment
// holding byte n-1 keeps what it sends of them, and the segments after it
// are freed.
func (w *streamWriter) truncate(n int) error {
	if n == 0 {
		return w.discard()
	}
	keep, left := 0, n
	for keep < len(w.segs) && left > w.segs[keep].n {
		left -= w.segs[keep].n
		keep++
	}
	// left <= segs[keep].n: the message ends in segment keep.
	w.segs[keep].n = left
	err := w.freeFrom(keep + 1)
	w.size = n
	return err
}

// freeFrom frees segs[i:] and drops them from the message.
func (w *streamWriter) freeFrom(i int) error {
	err := w.st.s.freeSegments(w.segs[i:])
	clear(w.segs[i:])
	w.segs = w.segs[:i]
	w.heap = false
	for _, seg := range w.segs {
		if seg.list == heapSegment {
			w.heap = true
		}
	}
	return err
}

// dropEmpty frees the segments that send nothing, which WriteDirect and
// Reserve(0) leave, so that only segments with data are linked.
func (w *streamWriter) dropEmpty() error {
	k := 0
	var err error
	for i := range w.segs {
		seg := w.segs[i]
		if seg.n == 0 {
			if e := w.st.s.freeSegments(w.segs[i : i+1]); err == nil {
				err = e
			}
			continue
		}
		w.segs[k] = seg
		k++
	}
	if k == len(w.segs) {
		return err
	}
	clear(w.segs[k:])
	w.segs = w.segs[:k]
	return err
}

// extend adds n bytes to the message without writing them.
func (w *streamWriter) extend(n int) error {
	added := 0
	for added < n {
		l := w.last()
		if l == nil || l.n == len(l.data) {
			if err := w.grow(n-added, false); err != nil {
				w.size += added
				return err
			}
			l = w.last()
		}
		c := min(len(l.data)-l.n, n-added)
		l.n += c
		added += c
	}
	w.size += added
	return nil
}

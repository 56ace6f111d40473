package shmipc

import (
	"errors"
	"fmt"
	"runtime/debug"
	"unsafe"

	"github.com/cloudwego/netpoll"
)

// NetpollWriter returns a netpoll.Writer that builds the stream's next
// message in shared memory; Flush sends it.
//
// It shares the message being built with BufferWriter and Write. A message
// in which WriteDirect was used must be finished with this Writer's Flush,
// which does what WriteDirect left, not Stream.Flush or another Writer:
// keep one Writer per stream.
//
// Like BufferWriter, the Writer is not safe for concurrent use, nor
// together with Write on the same stream.
func (st *Stream) NetpollWriter() netpoll.Writer { return &netpollWriter{st: st} }

type netpollWriter struct {
	st *Stream
	// moves are copies WriteDirect left for Flush, in message order: bytes
	// the caller may still write through slices from Malloc.
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
func (w *netpollWriter) Malloc(n int) ([]byte, error) {
	if n != 0 {
		return (*bufferWriter)(w.st).Reserve(n)
	}
	if err := (*bufferWriter)(w.st).locked((*streamWriter).usable); err != nil {
		return nil, err
	}
	return []byte{}, nil // unlike Reserve(0), takes no slice
}

// WriteString appends a copy of s to the message.
func (w *netpollWriter) WriteString(s string) (int, error) {
	return (*bufferWriter)(w.st).WriteString(s)
}

// WriteBinary appends a copy of p to the message. Unlike netpoll's own
// buffers it does not keep p, so the caller may reuse p at once.
func (w *netpollWriter) WriteBinary(p []byte) (int, error) {
	return (*bufferWriter)(w.st).WriteBytes(p)
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
// p is copied at once, and the last remainCap bytes are moved behind it at
// Flush, so that what the caller writes into them until then is sent: they
// cost a second copy and, until Flush, twice their shared memory.
func (w *netpollWriter) WriteDirect(p []byte, remainCap int) error {
	return (*bufferWriter)(w.st).locked(func(sw *streamWriter) error {
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
		_, err := writeTo(sw, p)
		if err == nil {
			pos := sw.size
			_, err = sw.fill(remainCap, func([]byte, int) {}) // room for the bytes Flush moves
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
	})
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
	w.cutMoves(0)
	_ = w.st.writer.discard()
}

// MallocAck keeps the first n bytes allocated since the last flush and
// discards the rest, shrinking the message; slices of the discarded bytes
// must not be used any more.
func (w *netpollWriter) MallocAck(n int) error {
	return (*bufferWriter)(w.st).locked(func(sw *streamWriter) error {
		if n < 0 {
			return errNegative
		}
		if n > sw.size {
			return fmt.Errorf("%w: MallocAck(%d), %d bytes allocated", errNetpollRange, n, sw.size)
		}
		w.cutMoves(n)
		return sw.truncate(n)
	})
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

func (w *netpollWriter) appendLinkBuffer(lb *netpoll.LinkBuffer) error {
	if err := lb.Flush(); err != nil {
		return err
	}
	return (*bufferWriter)(w.st).locked(func(sw *streamWriter) error {
		var vs [8][]byte
		for lb.Len() > 0 {
			n := 0
			for _, v := range lb.GetBytes(vs[:]) {
				if _, err := writeTo(sw, v); err != nil {
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
	})
}

func (w *netpollWriter) appendWriter(o *netpollWriter) (err error) {
	a, b := w.st, o.st
	if a == b {
		return fmt.Errorf("%w: Append of a stream's writer to itself", ErrNotSupported)
	}
	// A fault in the other session's region is blamed on this one's.
	defer a.s.endAccess(&err, debug.SetPanicOnFault(true)) // the whole method is one access
	// Lock both streams' writers in a fixed order.
	first, second := a, b
	if uintptr(unsafe.Pointer(b)) < uintptr(unsafe.Pointer(a)) {
		first, second = b, a
	}
	first.lockWriter()
	defer first.unlockWriter()
	second.lockWriter()
	defer second.unlockWriter()
	if err := o.applyMoves(); err != nil {
		o.discardLocked()
		return err
	}
	for _, seg := range b.writer.segs {
		if _, err = writeTo(&a.writer, seg.Data[:seg.N]); err != nil {
			break
		}
	}
	o.discardLocked()
	return err
}

// Flush sends the message (Stream.Flush), after moving the bytes
// WriteDirect left behind. On error the message is discarded.
func (w *netpollWriter) Flush() error {
	return (*bufferWriter)(w.st).locked(func(sw *streamWriter) error {
		if len(w.moves) > 0 {
			err := sw.usable()
			if err == nil {
				err = w.applyMoves()
			}
			if err != nil {
				w.discardLocked()
				return err
			}
		}
		return w.st.flushLocked() // sendShm drops the empty segments WriteDirect leaves
	})
}

// MallocLen is the number of bytes in the message so far.
func (w *netpollWriter) MallocLen() int { return (*bufferWriter)(w.st).Len() }

var errNetpollStaleMove = errors.New("shmipc: WriteDirect of a message discarded or flushed elsewhere")

// applyMoves performs and forgets the copies WriteDirect left; wmu is held.
func (w *netpollWriter) applyMoves() error {
	sw := &w.st.writer
	defer w.cutMoves(0)
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

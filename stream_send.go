package shmipc

import (
	"cmp"
	"errors"
	"time"

	"github.com/goshm/shmipc/internal/shm"
)

// Write writes p as one message and flushes it. On error n counts the
// bytes of p the peer may read: a message sent in fallback frames can be
// cut short by Close, the write deadline or a failed socket write after
// some frames went out. A message that reached the IO queue counts as
// written even if the wake-up after it failed: if the peer's connection
// closed just then, Write returns len(p) and nil (the peer may have read
// it, as bytes in a socket buffer; later writes fail with an error
// wrapping ErrPeerClosed), otherwise len(p) and the error.
func (st *Stream) Write(p []byte) (int, error) {
	st.lockWriter()
	defer st.unlockWriter()
	if err := st.writeDeadlineErr(); err != nil {
		return 0, err
	}
	st.reuse.Or(replyOwed)
	before := st.writer.size // left by BufferWriter calls: sent first
	st.partSent = 0
	err := st.s.access(func() error {
		_, err := writeTo(&st.writer, p)
		if err == nil {
			err = st.flushLocked()
		}
		if err != nil {
			_ = st.writer.discard()
		}
		return err
	})
	if err != nil {
		return min(max(st.partSent-before, 0), len(p)), err
	}
	return len(p), nil
}

// Flush sends the message built with BufferWriter (and anything Write left).
// endStream has no effect on the wire; it is accepted for compatibility.
// On error the message is discarded.
func (st *Stream) Flush(endStream bool) error {
	st.lockWriter()
	defer st.unlockWriter()
	return st.s.access(st.flushLocked)
}

func (st *Stream) writeDeadlineErr() error {
	if d := st.wDeadline.Load(); d != nil && !d.IsZero() && !time.Now().Before(*d) {
		return ErrTimeout
	}
	return nil
}

// flushLocked sends the pending message, inside an access, with st.wmu held.
func (st *Stream) flushLocked() error {
	w := &st.writer
	if w.size == 0 {
		if w.closedUnsent {
			return ErrStreamClosed
		}
		if err := w.discard(); err != nil {
			return err
		}
		return w.usable() // nothing to send, but a closed stream still fails
	}
	raceReleaseIO()
	st.reuse.Or(replyOwed)
	err := w.usable()
	if err == nil {
		err = st.writeDeadlineErr()
	}
	if err != nil {
		_ = w.discard()
		return err
	}
	if w.heap || st.fallback.Load() {
		return st.sendFallback()
	}
	return st.sendShm()
}

// sendShm links the message's slices into a chain and publishes it on the
// queue, retrying while the queue is full (docs/protocol.md §7.6).
func (st *Stream) sendShm() error {
	s, w := st.s, &st.writer
	if err := w.dropEmpty(); err != nil {
		_ = w.discard()
		return err
	}
	var root uint32
	for i := len(w.segs) - 1; i >= 0; i-- {
		s.buf.LinkSlice(w.segs[i].Off, w.segs[i].N, root)
		root = w.segs[i].Off
	}
	c := s.counters.of(st.id)
	sent, err := s.putElem(shm.Elem{ID: st.id, Offset: root, Status: shm.StatusOpened}, st)
	if !sent {
		_ = w.discard()
		return err
	}
	c.messagesOut.Add(1)
	c.bytesOut.Add(uint64(w.size))
	st.partSent = w.size // on the queue: the peer may read it, whatever err says (Write)
	w.reset()
	if errors.Is(err, ErrPeerClosed) {
		// Only the wake-up found the peer's socket closed: a peer polling
		// its queue may have read the message, so it counts as sent (see
		// Write); the next write fails (sendable).
		return nil
	}
	return err
}

// sendFallback copies the message into FallbackData frames and frees its
// slices. From then on the stream always sends fallback data, so its bytes
// cannot be overtaken by shared-memory messages (docs/protocol.md §9.5).
func (st *Stream) sendFallback() error {
	s, w := st.s, &st.writer
	st.fallback.Store(true)
	limit := fallbackFrameData // whatever the peer's MaxFallbackFrameSize
	// The deadline bounds each frame's socket write, as it is then.
	deadline := func() time.Time {
		if d := st.wDeadline.Load(); d != nil {
			return *d
		}
		return time.Time{}
	}
	var frame [][]byte
	size, sent := 0, 0
	var err error
	send := func() {
		if err = s.sendFallbackFrame(st.id, frame, deadline()); err == nil {
			sent += size
		}
		frame, size = frame[:0], 0
	}
	for i := 0; i < len(w.segs) && err == nil; i++ {
		data := w.segs[i].Data[:w.segs[i].N]
		for len(data) > 0 && err == nil {
			c := min(len(data), limit-size)
			frame = append(frame, data[:c])
			size += c
			data = data[c:]
			if size == limit {
				send()
				if err == nil && st.writeClosed.Load() {
					err = st.writeClosedErr() // closed meanwhile: the rest is not sent
				}
			}
		}
	}
	if err == nil && size > 0 {
		send()
	}
	c := s.counters.of(st.id)
	c.bytesOut.Add(uint64(sent))
	c.fallbackBytesOut.Add(uint64(sent))
	if err == nil {
		c.messagesOut.Add(1)
		c.fallbackMessagesOut.Add(1)
	} else {
		st.partSent = sent
	}
	return cmp.Or(err, w.discard())
}

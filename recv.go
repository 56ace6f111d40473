package shmipc

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"syscall"

	"github.com/goshm/shmipc/internal/wire"
)

// Receiving: the receive loop, the one goroutine of a session that reads
// its socket and consumes its receive queue (consume.go), reads event
// frames and applies them; queue elements become stream data or stream
// closes. Closes are applied in the order the peer sent them relative to
// socket frames (closeAfterSocket), and fallback data held in process
// memory is bounded per stream (fallback_recv.go).

// recvLoop reads event frames until the connection fails, then tears the
// session down.
func (s *Session) recvLoop() {
	defer close(s.loopDone)
	var err error
	for err == nil {
		if s.stall != nil {
			// A stream's fallback data waits for room: the socket waits
			// with it, the queue is served meanwhile.
			err = s.access(s.serveStalled)
			continue
		}
		if h := consumeHook.Load(); h != nil {
			(*h)(s)
		}
		h, payload, rerr := s.ec.readFrame(s.conf.MaxFallbackFrameSize, s.conf.partialFrameTimeout())
		if rerr != nil {
			err = rerr
			break
		}
		err = s.access(func() error { return s.handleFrameInOrder(h, payload) })
		s.ec.shrink()
	}
	if !s.IsClosed() {
		switch {
		case errors.Is(err, io.EOF), errors.Is(err, syscall.ECONNRESET):
			// What the peer published before its end is applied first
			// (drainAtEnd): it may have been published with no wake-up
			// to come, while this loop was consuming.
			if derr := s.access(s.drainAtEnd); derr != nil {
				err = derr
				break
			}
			// Not wrapped: a session that died must not look like the clean
			// end of a stream to code that checks errors.Is(err, io.EOF).
			err = fmt.Errorf("%w (%v)", ErrPeerClosed, err)
		case errors.Is(err, wire.ErrBadMagic), errors.Is(err, wire.ErrBadVersion),
			errors.Is(err, wire.ErrBadType), errors.Is(err, wire.ErrBadLength):
			err = fmt.Errorf("%w: %w", ErrProtocol, err)
		}
	}
	s.closeWithError(err)
	_ = s.access(func() error { s.teardown(); return nil })
}

// handleFrameInOrder handles a frame, keeps count of how far into the
// socket's byte stream the session has acted, applies the closes that were
// waiting for that (closeAfterSocket), and goes back to consuming if the
// loop left off to read this frame with the working flag set.
//
// A frame that carries data counts as acted on only once its data has been
// delivered, so that a close published after it was sent is applied after
// it, even if the drain that precedes the data finds the close.
func (s *Session) handleFrameInOrder(h wire.Header, payload []byte) error {
	resume := s.cons.consuming && h.Type() != wire.TypePolling // a Polling frame consumes anyway
	size := uint64(wire.HeaderSize + len(payload))
	data := h.Type() == wire.TypeFallbackData
	if !data {
		s.handled += size
		s.closeCaughtUp()
	} else if len(payload) >= 4 {
		// Closes that wait for bytes inside this frame wait for nothing
		// of their own streams: applied now, they do not wait for a
		// frame of another stream, which can be 32 MiB long.
		s.closeDue(s.handled+size, binary.BigEndian.Uint32(payload))
	}
	if err := s.handleFrame(h, payload); err != nil {
		return err
	}
	if data {
		s.handled += size
		s.closeCaughtUp()
	}
	if resume && s.stall == nil {
		return s.consume()
	}
	return nil
}

// handleFrame acts on one running-phase frame (PROTOCOL.md §2.2).
//
// StreamClose and FallbackData frames are ordered after everything the peer
// published on the queue before sending them, even when that element's
// wake-up has not arrived (another of the peer's producers won the working
// flag and has not written its Polling frame yet): the queue is drained
// first.
func (s *Session) handleFrame(h wire.Header, payload []byte) error {
	switch h.Type() {
	case wire.TypePolling:
		s.counters.of(0).wakeupsReceived.Add(1)
		if s.stall != nil {
			return nil // serveStalled consumes
		}
		return s.consume()
	case wire.TypeStreamClose:
		if err := s.drainBefore(); err != nil {
			return err
		}
		s.peerClosed(binary.BigEndian.Uint32(payload))
		return nil
	case wire.TypeFallbackData:
		if err := s.drainBefore(); err != nil {
			return err
		}
		return s.handleFallback(payload)
	case wire.TypeHotRestart:
		if s.isClient {
			if f := s.onHotRestart.Load(); f != nil {
				(*f)(binary.BigEndian.Uint64(payload))
			}
			return nil // without a handler: keep using this session
		}
	case wire.TypeHotRestartAck:
		if !s.isClient {
			if f := s.onHotRestartAck.Load(); f != nil {
				(*f)(binary.BigEndian.Uint64(payload))
			}
			return nil
		}
	}
	return fmt.Errorf("%w: unexpected %v frame in the running phase (%s side)", ErrProtocol, h.Type(), s.role())
}

func (s *Session) role() string {
	if s.isClient {
		return "client"
	}
	return "server"
}

// handleData hands the message whose first slice is at offset to stream
// id, opening the stream if it is new (server). scratch is the caller's, to
// read the chain into; the consumer's (Session.scratch) for queue elements.
func (s *Session) handleData(id, offset uint32, scratch *[]segment) error {
	slices, err := s.buf.readChain((*scratch)[:0], offset)
	if err != nil {
		return fmt.Errorf("stream %d: %w", id, err)
	}
	*scratch = slices
	n := 0
	for _, sl := range slices {
		n += len(sl.data)
	}
	c := s.counters.of(id)
	c.messagesIn.Add(1)
	c.bytesIn.Add(uint64(n))
	st, err := s.streamFor(id)
	if err != nil {
		// Refused (a limit ends the session): the slices go back, or
		// they are lost to the other sessions on a shared region.
		if ferr := s.freeSegments(slices); ferr != nil {
			return ferr
		}
		return err
	}
	if st == nil || !st.deliver(slices, nil) {
		return s.freeSegments(slices)
	}
	return nil
}

// handleElem acts on one queue element: a message or a close.
func (s *Session) handleElem(e queueElem) error {
	if e.id == 0 {
		return fmt.Errorf("%w: IO queue element for stream id 0", ErrProtocol)
	}
	switch e.status & statusMask {
	case statusOpened:
		return s.handleData(e.id, e.offset, &s.scratch)
	case statusClosed:
		if e.offset != 0 {
			return fmt.Errorf("%w: close element for stream %d has offset %d, want 0", ErrProtocol, e.id, e.offset)
		}
		return s.closeAfterSocket(e.id)
	default:
		return fmt.Errorf("%w: IO queue element for stream %d has status %#x", ErrProtocol, e.id, e.status)
	}
}

// pendingClose is a close element whose stream may still have fallback data
// on the socket: the close applies once the receive loop has read up to at.
type pendingClose struct {
	id     uint32
	at     uint64 // a position in the byte stream received on the socket
	mode   uint8  // how at is known (closeExact, closeUpper, closeQuiet)
	rounds uint8  // quiet waits so far (closeQuiet)
}

// closeAfterSocket applies a close element in the order the peer meant.
//
// A peer sends a stream's last bytes as FallbackData on the socket, waits
// until the write has completed, then publishes the close element (both
// reference implementations do). The close can therefore be seen on the
// queue before the receive loop has read those bytes; applied at once, it
// would end the stream before its data and the data would be lost behind a
// clean EOF. Over a Unix socket every byte written before the close was
// published is, by then, in this side's socket buffer: the close is applied
// once the receive loop has consumed everything received so far plus what
// the kernel holds now. When nothing is pending on the socket, that is at
// once. Over TCP it is the count of what the peer wrote (tcp_order.go).
//
// Elements take effect in queue order: while a close waits, draining pauses
// behind it (drain), and the receive loop reads the frames it waits for.
func (s *Session) closeAfterSocket(id uint32) error {
	at, mode, err := s.closeTarget() // over TCP, not read + SIOCINQ: tcp_order.go
	if err != nil {
		return fmt.Errorf("order the close of stream %d: %w", id, err)
	}
	// A peer cannot make this list grow without end. A drain takes at most
	// a queue's worth of elements (drainBefore), and the closes of one
	// drain wait for at most the bytes on their way then.
	if limit := 2*s.conf.MaxStreams + int(s.recvQ.cap); len(s.closing) >= limit {
		return fmt.Errorf("%w: more than %d stream closes waiting for the socket (twice Config.MaxStreams and the queue's capacity)", ErrLimitExceeded, limit)
	}
	if st := s.lookup(id); st != nil {
		// The peer holds the stream no more: it stops counting against
		// Config.MaxStreams now (streamFor), though its end waits.
		s.peerClosedStream(st)
	}
	s.closing = append(s.closing, pendingClose{id: id, at: at, mode: mode})
	s.closeCaughtUp()
	return nil
}

// closeCaughtUp applies the pending closes the socket has caught up with,
// in the order they were published.
func (s *Session) closeCaughtUp() { s.closeDue(s.handled, 0) }

// closeDue applies, in the order they were published, the pending closes
// that wait for no more than the first at bytes of the socket, up to the
// first one for stream busy (0: none), whose data frame is being handled,
// and up to one that waits for the socket to be quiet first.
func (s *Session) closeDue(at uint64, busy uint32) {
	for n := 1; n > 0 && len(s.closing) > 0; {
		s.settleTCPClose() // the first close, if its position is not exact
		n = 0
		for i := range s.closing {
			c := &s.closing[i]
			if c.at > at || c.id == busy || (c.mode == closeQuiet && !s.quietAfter(c)) {
				break
			}
			s.peerClosed(c.id)
			n++
		}
		k := copy(s.closing, s.closing[n:])
		s.closing = s.closing[:k]
	}
}

// peerClosed ends a stream the peer closed. A close for a stream that is not
// open (one that never carried data, or one already closed) has nothing to
// end.
func (s *Session) peerClosed(id uint32) {
	if st := s.lookup(id); st != nil {
		st.peerClose()
	}
}

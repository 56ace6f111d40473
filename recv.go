package shmipc

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"syscall"
	"time"

	"github.com/goshm/shmipc/internal/wire"
)

// Receiving: the receive loop reads event frames from the socket and applies
// them; queue elements it (or a polling reader, poll.go) takes off the
// receive queue become stream data or stream closes. Closes are applied in
// the order the peer sent them relative to socket frames (closeAfterSocket),
// and fallback data held in process memory is bounded (waitFallbackRoom).

// recvLoop reads event frames until the connection fails, then tears the
// session down. Readers may drain the queue too (poll.go), but only the
// receive loop applies closes, and teardown seals the queue before it ends
// the streams, so nothing reaches a stream after that.
func (s *Session) recvLoop() {
	defer close(s.loopDone)
	defer s.sock.timer.Stop()
	var err error
	for err == nil {
		var h wire.Header
		var payload []byte
		if s.mayLend() {
			// A lone reader reads the socket itself (lead.go).
			if h, payload, err = s.lendSocket(); err != nil {
				break
			}
			if h == nil {
				continue
			}
		} else if h, payload, err = s.ec.readFrame(s.conf.MaxFallbackFrameSize); err != nil {
			if !isTimeout(err) || s.IsClosed() {
				break
			}
			// A reader kicked us (poll.go): drain, then read on.
			_ = s.ec.conn.SetReadDeadline(time.Time{})
			s.cons.kicked.Store(false)
			err = s.access(s.consumeNow)
			continue
		}
		err = s.access(func() error { return s.handleFrameInOrder(h, payload) })
		s.ec.shrink()
	}
	if !s.IsClosed() {
		switch {
		case errors.Is(err, io.EOF), errors.Is(err, syscall.ECONNRESET):
			// What the peer published before its end is applied first
			// (drainAtEnd). It may have been published with no wake-up
			// to come (a reader of ours was polling), or with a kick not
			// acted on: a read finds the end of the socket before it
			// looks at the deadline a kick set.
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
// waiting for that (closeAfterSocket), and goes back to consuming if a spin
// left off to let this frame in.
//
// A frame that carries data counts as acted on only once its data has been
// delivered, so that a close published after it was sent is applied after
// it, even if the drain that precedes the data finds the close.
func (s *Session) handleFrameInOrder(h wire.Header, payload []byte) error {
	resume := s.resume && h.Type() != wire.TypePolling // a Polling frame consumes anyway
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
	if resume {
		return s.consumeNow()
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
		if s.localPeer {
			localWakes.received()
		}
		return s.consumeNow()
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
	if st != nil && n >= handTurnBytes && s.localPeerSession.Load() != nil {
		st.bigIn.Store(true) // its writer yields before the next message (writerTurn)
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
	id uint32
	at uint64 // a position in the byte stream received on the socket
}

// closeAfterSocket applies a close element in the order the peer meant.
//
// A peer sends a stream's last bytes as FallbackData on the socket, waits
// until the write has completed, then publishes the close element (both
// reference implementations do). The close can therefore be seen on the
// queue before the receive loop has read those bytes; applied at once, it
// would end the stream before its data and the data would be lost behind a
// clean EOF. But every byte written before the close was published is, by
// then, in this side's socket buffer: the close is applied once the receive
// loop has consumed everything received so far plus what the kernel holds
// now. When nothing is pending on the socket, that is at once.
//
// Elements take effect in queue order: while a close waits, draining pauses
// behind it (drainHeld), and the receive loop reads the frames it waits for.
func (s *Session) closeAfterSocket(id uint32) error {
	at, err := s.ec.receivedSoFar()
	if err != nil {
		return fmt.Errorf("order the close of stream %d: %w", id, err)
	}
	if at <= s.handled && len(s.closing) == 0 {
		s.peerClosed(id)
		return nil
	}
	if len(s.closing) >= s.conf.MaxStreams { // a peer cannot make this list grow without end
		return fmt.Errorf("%w: more than %d stream closes waiting for the socket, the limit set by Config.MaxStreams", ErrLimitExceeded, s.conf.MaxStreams)
	}
	s.closing = append(s.closing, pendingClose{id: id, at: at})
	s.closesPending.Store(true)
	return nil
}

// closeCaughtUp applies the pending closes the socket has caught up with,
// in the order they were published.
func (s *Session) closeCaughtUp() { s.closeDue(s.handled, 0) }

// closeDue applies, in the order they were published, the pending closes
// that wait for no more than the first at bytes of the socket, up to the
// first one for stream busy (0: none), whose data frame is being handled.
func (s *Session) closeDue(at uint64, busy uint32) {
	n := 0
	for _, c := range s.closing {
		if c.at > at || c.id == busy {
			break
		}
		s.peerClosed(c.id)
		n++
	}
	if n > 0 {
		k := copy(s.closing, s.closing[n:])
		s.closing = s.closing[:k]
		s.closesPending.Store(k > 0)
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

// handleFallback delivers a FallbackData frame. The stream then sends its
// own data as fallback too (PROTOCOL.md §6.5).
func (s *Session) handleFallback(payload []byte) error {
	id, status, data, err := wire.DecodeFallbackHead(payload)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrProtocol, err)
	}
	if id == 0 {
		return fmt.Errorf("%w: FallbackData for stream id 0", ErrProtocol)
	}
	if status&statusMask != statusOpened {
		return fmt.Errorf("%w: FallbackData for stream %d has status %#x", ErrProtocol, id, status)
	}
	c := s.counters.of(id)
	c.messagesIn.Add(1)
	c.bytesIn.Add(uint64(len(data)))
	c.fallbackMessagesIn.Add(1)
	c.fallbackBytesIn.Add(uint64(len(data)))
	st, err := s.streamFor(id)
	if err != nil || st == nil {
		return err
	}
	st.fallback.Store(true)
	if len(data) == 0 {
		return nil
	}
	if err := s.waitFallbackRoom(st, len(data)); err != nil {
		return err
	}
	st.deliver(nil, append([]byte(nil), data...))
	return nil
}

// waitFallbackRoom holds the receive loop, and so the peer's writes to this
// session, while fallback data the application has not read would exceed
// Config.MaxFallbackBufferedPerStream or MaxFallbackBuffered with n more
// bytes. One message is always taken when nothing is held, so a bound below
// the largest frame cannot wedge a stream. Nor can a read of more than a
// bound leaves room for (BufferReader.ReadBytes of a large message): room
// comes only from an application that reads, and one whose reader waits
// for more data than it holds will not. So a frame for a stream whose
// reader waits for want bytes is taken while the stream holds less than
// its bound plus want, and past the session's bound as long as the data
// held beyond what waiting readers asked for, which the applications may
// yet free, leaves room for it (unstuckFallback). A peer thus cannot make
// the session hold more than the bound and a frame beyond what waiting
// readers asked for. If the application makes no room within
// FallbackStallTimeout, the session ends with an error naming the bound.
func (s *Session) waitFallbackRoom(st *Stream, n int) error {
	var timer *time.Timer
	perStream, perSession := int64(s.conf.MaxFallbackBufferedPerStream), int64(s.conf.MaxFallbackBuffered)
	for {
		stream := st.heldFallback.Load()
		session := s.fallbackHeld.Load()
		want := int64(0) // what the stream's reader waits for, if it lacks some
		if st.readShort.Load() > 0 {
			want = st.readWant.Load()
		}
		var bound string
		var limit, held int64
		switch {
		case stream > 0 && stream+int64(n) > perStream && (want == 0 || stream >= perStream+want):
			bound, limit, held = "Config.MaxFallbackBufferedPerStream", perStream, stream
		case session > 0 && session+int64(n) > perSession && (want == 0 || s.unstuckFallback(session, perSession, n)):
			bound, limit, held = "Config.MaxFallbackBuffered", perSession, session
		default:
			if timer != nil {
				timer.Stop()
			}
			return nil
		}
		if timer == nil {
			timer = time.NewTimer(s.conf.FallbackStallTimeout)
			defer timer.Stop()
		}
		select {
		case <-s.fallbackRoom:
		case <-s.closed:
			return s.closedErr()
		case <-timer.C:
			return fmt.Errorf("%w: %d bytes of fallback data for stream %d would exceed %s (%d bytes; %d held, unread for %v)",
				ErrLimitExceeded, n, st.id, bound, limit, held, s.conf.FallbackStallTimeout)
		}
	}
}

// unstuckFallback reports whether the fallback data the session holds
// (session bytes), less what is stuck, leaves no room for n bytes under the
// session's bound. Stuck is what waiting readers hold of what they asked
// for: up to its want, the data of a stream whose reader waits for more
// than it has will not be freed until more arrives; beyond it (data read
// and not released) it might. It looks at every stream, which only a
// receive loop held back by a bound does.
func (s *Session) unstuckFallback(session, bound int64, n int) bool {
	s.mu.Lock()
	var stuck int64
	for _, st := range s.streams {
		if st.readShort.Load() > 0 {
			stuck += min(st.heldFallback.Load(), st.readWant.Load())
		}
	}
	s.mu.Unlock()
	free := session - stuck
	return free > 0 && free+int64(n) > bound
}

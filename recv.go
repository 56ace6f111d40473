package shmipc

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"slices"
	"syscall"

	"github.com/goshm/shmipc/internal/shm"
	"github.com/goshm/shmipc/internal/wire"
)

// recvLoop reads event frames until the connection fails, then tears down.
func (s *Session) recvLoop() {
	defer close(s.loopDone)
	var err error
	for err == nil {
		if s.stall != nil { // the socket waits with the stalled frame
			err = s.access(s.serveStalled)
			continue
		}
		if h := consumeHook.Load(); h != nil {
			(*h)(s, true)
		}
		h, payload, rerr := s.ec.readFrame(s.conf.MaxFallbackFrameSize, s.conf.partialFrameTimeout())
		if rerr == errInterrupted { // a polling reader handed the token over
			err = s.access(s.takeHanded)
			continue
		}
		if rerr != nil {
			err = rerr
			break
		}
		err = s.access(func() error {
			if err := s.handleFrameInOrder(h, payload); err != nil {
				return err
			}
			return s.loopRelease()
		})
		s.ec.shrink()
	}
	if !s.IsClosed() {
		switch {
		case errors.Is(err, io.EOF), errors.Is(err, syscall.ECONNRESET):
			// What the peer published before its end may have no
			// wake-up to come: it is applied first.
			s.loopTake()
			if derr := s.access(s.drainBefore); derr != nil {
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
	s.tok.takeLoop(true) // nothing consumes from here on
	_ = s.access(func() error { s.teardown(); return nil })
}

// handleFrameInOrder handles a frame, counts how far into the socket's byte
// stream the session has acted, applies the closes that waited for that
// (closeAfterSocket), and goes back to consuming if the loop left off to
// read this frame with the working flag set. A data frame counts as acted
// on only once its data is delivered, so that a close published after it
// was sent is applied after it, even if the preceding drain finds the close.
func (s *Session) handleFrameInOrder(h wire.Header, payload []byte) error {
	size := uint64(wire.HeaderSize + len(payload))
	s.loopTake()
	resume := s.cons.consuming && h.Type() != wire.TypePolling // a Polling frame consumes anyway
	data := h.Type() == wire.TypeFallbackData
	if !data {
		s.handled += size
		s.closeCaughtUp()
	} else if len(payload) >= 4 {
		// Closes whose target lies inside this frame wait for no data of
		// their own streams: they need not wait for this frame, of up to
		// 32 MiB, to be delivered.
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

// handleFrame acts on one running-phase frame (docs/protocol.md §3.2). A
// StreamClose or FallbackData frame follows what the peer published before
// it, whose wake-up may still be on its way: the queue is drained first.
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
	case wire.TypeHotRestart, wire.TypeHotRestartAck:
		if (h.Type() == wire.TypeHotRestart) != s.isClient {
			break // a client receives HotRestart, a server HotRestartAck
		}
		hook := &s.onHotRestartAck
		if s.isClient {
			hook = &s.onHotRestart
		}
		if f := hook.Load(); f != nil {
			(*f)(binary.BigEndian.Uint64(payload))
		}
		return nil // without a handler: keep using this session
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
// id, opening the stream if it is new (server).
func (s *Session) handleData(id, offset uint32) error {
	segs, err := s.buf.ReadChain(s.scratch[:0], offset)
	if err != nil {
		return fmt.Errorf("stream %d: %w", id, err)
	}
	s.scratch = segs
	n := 0
	for _, sl := range segs {
		n += len(sl.Data)
	}
	c := s.counters.of(id)
	c.messagesIn.Add(1)
	c.bytesIn.Add(uint64(n))
	st, err := s.streamFor(id)
	if err != nil {
		// A limit ends the session: the slices go back, or they are
		// lost to the other sessions on a shared region.
		return cmp.Or(s.freeSegments(segs), err)
	}
	if st == nil || !st.deliver(segs, nil) {
		return s.freeSegments(segs)
	}
	s.cons.multi = s.cons.multi || (s.cons.last != 0 && s.cons.last != id)
	s.cons.last = id
	return nil
}

// handleElem acts on one queue element: a message or a close.
func (s *Session) handleElem(e shm.Elem) error {
	if e.ID == 0 {
		return fmt.Errorf("%w: IO queue element for stream id 0", ErrProtocol)
	}
	switch e.Status & shm.StatusMask {
	case shm.StatusOpened:
		return s.handleData(e.ID, e.Offset)
	case shm.StatusClosed:
		if e.Offset != 0 {
			return fmt.Errorf("%w: close element for stream %d has offset %d, want 0", ErrProtocol, e.ID, e.Offset)
		}
		return s.closeAfterSocket(e.ID)
	default:
		return fmt.Errorf("%w: IO queue element for stream %d has status %#x", ErrProtocol, e.ID, e.Status)
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

// closeAfterSocket applies a close element in the order the peer meant. A
// peer sends a stream's last bytes as FallbackData, waits for the write to
// complete, then publishes the close, which can thus be seen before those
// bytes are read; applied at once, it would lose them behind a clean EOF.
// Over a Unix socket they are by then in this side's socket buffer, so the
// close applies once the loop has acted on what was read so far plus what
// the kernel holds now; over TCP, see tcp_order.go. While a close waits,
// draining pauses behind it (drain): elements take effect in queue order.
func (s *Session) closeAfterSocket(id uint32) error {
	at, mode, err := s.closeTarget()
	if err != nil {
		return fmt.Errorf("order the close of stream %d: %w", id, err)
	}
	// A peer cannot make this list grow without end: a drain takes at most
	// a queue's worth of elements (drainBefore), and their closes wait for
	// at most the bytes on their way then.
	if limit := 2*s.conf.MaxStreams + int(s.recvQ.Cap()); len(s.closing) >= limit {
		return fmt.Errorf("%w: more than %d stream closes waiting for the socket (twice Config.MaxStreams and the queue's capacity)", ErrLimitExceeded, limit)
	}
	if st := s.lookup(id); st != nil {
		// It stops counting against Config.MaxStreams now (streamFor).
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
		s.closing = slices.Delete(s.closing, 0, n)
	}
}

// peerClosed ends a stream the peer closed, if it is open.
func (s *Session) peerClosed(id uint32) {
	if st := s.lookup(id); st != nil {
		st.peerClose()
	}
}

package shmipc

import (
	"fmt"
	"time"

	"github.com/goshm/shmipc/internal/shm"
	"github.com/goshm/shmipc/internal/wire"
)

// Fallback data received (docs/protocol.md §9.5) is copied into process
// memory, within the bounds Config.MaxFallbackBufferedPerStream describes,
// and a frame that would pass one waits for room (serveStalled). A frame is
// always taken while its stream (or, for the session's bound, the session)
// holds none, so a bound below the largest frame cannot wedge a stream.

// stalledFrame is a FallbackData frame waiting for room.
type stalledFrame struct {
	st    *Stream
	data  []byte // the frame's data, copied
	since time.Time
}

// How often the receive loop looks at the queue while a frame waits: the
// first pause after it found nothing, and the longest.
const (
	minStallPause = 50 * time.Microsecond
	maxStallPause = time.Millisecond
)

// handleFallback delivers a FallbackData frame, or makes it wait for room
// (s.stall). The stream then sends its own data as fallback too.
func (s *Session) handleFallback(payload []byte) error {
	id, status, data, err := wire.DecodeFallbackHead(payload)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrProtocol, err)
	}
	if id == 0 {
		return fmt.Errorf("%w: FallbackData for stream id 0", ErrProtocol)
	}
	if status&shm.StatusMask != shm.StatusOpened {
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
	if len(data) == 0 || !st.takesData() {
		return nil
	}
	data = append([]byte(nil), data...)
	if bound, _ := s.fallbackBound(st, len(data)); bound != "" {
		s.stall = &stalledFrame{st: st, data: data, since: time.Now()}
		return nil
	}
	st.deliver(nil, data)
	return nil
}

// The names of the bounds, as errors give them.
const (
	streamBound  = "Config.MaxFallbackBufferedPerStream"
	sessionBound = "Config.MaxFallbackBuffered"
)

// largestFallbackHolder returns the stream not yet failed that holds the
// most fallback data, or nil if none holds any.
func (s *Session) largestFallbackHolder() *Stream {
	var hog *Stream
	var most int64
	for _, st := range s.streamList() {
		if held := st.heldFallback.Load(); held > most && !st.failed() {
			hog, most = st, held
		}
	}
	return hog
}

// fallbackBound names the bound n more bytes of fallback data for st would
// pass, and its value; "" when they fit.
func (s *Session) fallbackBound(st *Stream, n int) (string, int64) {
	perStream, perSession := int64(s.conf.MaxFallbackBufferedPerStream), int64(s.conf.MaxFallbackBuffered)
	if held := st.heldFallback.Load(); held > 0 && held+int64(n) > perStream {
		return streamBound, perStream
	}
	if held := s.fallbackHeld.Load(); held > 0 && held+int64(n) > perSession {
		return sessionBound, perSession
	}
	return "", 0
}

// serveStalled runs the receive loop, inside an access, while a frame waits
// for room: it consumes the queue, with pauses, and delivers the frame once
// it fits, or fails its stream after FallbackStallTimeout. Elements of the
// waiting stream wait too (drain), keeping its data in order.
func (s *Session) serveStalled() error {
	f := s.stall
	if !s.cons.consuming {
		s.cons.consuming = true
		s.recvQ.SetWorking(true)
	}
	timer := time.NewTimer(minStallPause)
	defer timer.Stop()
	pause := minStallPause
	for {
		bound, limit := s.fallbackBound(f.st, len(f.data))
		if bound == "" || !f.st.takesData() {
			s.stall = nil
			f.st.deliver(nil, f.data) // dropped if the stream no longer takes data
			return s.consume()
		}
		if waited := time.Since(f.since); waited >= s.conf.FallbackStallTimeout {
			waited = waited.Round(time.Millisecond)
			if hog := s.largestFallbackHolder(); bound == sessionBound && hog != nil && hog != f.st {
				// The session's bound: the stream that holds the most
				// is the one whose application does not read.
				hog.fail(fmt.Errorf("%w: stream %d holds %d bytes of fallback data, unread for %v, while %d bytes for stream %d would exceed %s (%d bytes)",
					ErrLimitExceeded, hog.id, hog.heldFallback.Load(), waited, len(f.data), f.st.id, bound, limit))
				f.since = time.Now()
				continue
			}
			s.stall = nil
			f.st.fail(fmt.Errorf("%w: %d bytes of fallback data for stream %d would exceed %s (%d bytes; %d held, unread for %v)",
				ErrLimitExceeded, len(f.data), f.st.id, bound, limit, f.st.heldFallback.Load(), waited))
			return s.consume()
		}
		n, _, err := s.drain(drainInOrder, noDrainLimit)
		if err != nil {
			return err
		}
		if n > 0 {
			pause = minStallPause
		} else {
			pause = min(2*pause, maxStallPause)
		}
		timer.Reset(pause)
		select {
		case <-s.fallbackRoom:
		case <-timer.C:
		case <-s.closed:
			return s.closedErr()
		}
	}
}

package shmipc

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/goshm/shmipc/internal/wire"
)

// Waiting for space (back-pressure): the first pause, and the longest.
const (
	minSpacePause = 20 * time.Microsecond
	maxSpacePause = time.Millisecond
)

// Session is one connection between a client and a server process, with its
// shared regions. It carries any number of streams. Only the client opens
// streams; the server accepts them. A Session is safe for concurrent use.
type Session struct {
	conf     *Config
	isClient bool
	version  uint8
	ec       *eventConn

	buf         *bufferManager
	queueRegion *region
	sendQ       *ioQueue
	recvQ       *ioQueue

	mu       sync.Mutex
	streams  map[uint32]*Stream
	nextID   uint32
	accepted streamQueue
	onAccept func(st *Stream, limit int) error // where new streams go (streamQueue.push); set before start

	closeOnce  sync.Once
	closed     chan struct{}
	err        error // why the session ended; written before closed is closed
	localClose bool
	loopDone   chan struct{}
	onTeardown func(*Session)

	// Hot restart (PROTOCOL.md §7): called on the receive loop with the
	// epoch of a HotRestart frame (client) or HotRestartAck frame (server).
	// They must not block.
	onHotRestart    atomic.Pointer[func(epoch uint64)]
	counters        sessionCounters
	onHotRestartAck atomic.Pointer[func(epoch uint64)]

	// Receive loop only.
	cons    consumer
	scratch []shmSlice
	handled uint64         // bytes of the socket's byte stream acted on
	closing []pendingClose // close elements waiting for the socket to catch up
	resume  bool           // consume again after the next frame: the working flag is still set

	closesPending atomic.Bool // len(closing) > 0: draining pauses

	localPeer bool         // the peer is this process (both ends in one program)
	sleepers  atomic.Int32 // readers waiting without polling

	// Fallback data received and not yet released by the streams.
	fallbackHeld atomic.Int64
	fallbackRoom chan struct{} // signalled when fallback data is released
}

func newSession(conn net.Conn, conf *Config, client bool) *Session {
	s := &Session{
		conf:         conf,
		isClient:     client,
		ec:           newEventConn(conn, conf.ConnectionWriteTimeout),
		streams:      make(map[uint32]*Stream),
		nextID:       1,
		closed:       make(chan struct{}),
		loopDone:     make(chan struct{}),
		fallbackRoom: make(chan struct{}, 1),
	}
	s.cons.init(conf.ConsumerSpinTime)
	s.accepted.init()
	return s
}

// start runs the receive loop of a session whose handshake is done.
func (s *Session) start() {
	if id, err := peerOf(s.ec.conn); err == nil && int(id.pid) == pid {
		s.localPeer = true
	}
	register(s)
	s.conf.logger().Debug("shmipc: session started", "role", s.role(), "version", s.version,
		"local", s.LocalAddr(), "remote", s.RemoteAddr())
	go s.recvLoop()
}

// IsClient reports whether this is the client side of the session.
func (s *Session) IsClient() bool { return s.isClient }

// LocalAddr returns the local address of the session's connection.
func (s *Session) LocalAddr() net.Addr { return s.ec.conn.LocalAddr() }

// RemoteAddr returns the remote address of the session's connection.
func (s *Session) RemoteAddr() net.Addr { return s.ec.conn.RemoteAddr() }

// OpenStream opens a new stream. Only a client can open streams; the server
// learns of it with the first message sent on it (PROTOCOL.md §6.2). It
// fails while Config.MaxStreams streams are open.
func (s *Session) OpenStream() (*Stream, error) {
	if !s.isClient {
		return nil, fmt.Errorf("%w: a server cannot open streams", ErrNotSupported)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.Err(); err != nil {
		return nil, err
	}
	if len(s.streams) >= s.conf.MaxStreams {
		return nil, fmt.Errorf("%w: %d streams are open, the limit set by Config.MaxStreams", ErrLimitExceeded, len(s.streams))
	}
	for {
		s.nextID++
		if s.nextID == 0 {
			continue
		}
		if _, used := s.streams[s.nextID]; !used {
			break
		}
	}
	return s.addStreamLocked(s.nextID)
}

func (s *Session) addStreamLocked(id uint32) (*Stream, error) {
	if !s.buf.region.acquire() {
		return nil, ErrSessionClosed
	}
	st := newStream(s, id)
	s.streams[id] = st
	return st, nil
}

// AcceptStream waits for the next stream the client opens. Only a server
// accepts streams. It fails once the session is closed.
func (s *Session) AcceptStream() (*Stream, error) {
	if s.isClient {
		return nil, fmt.Errorf("%w: a client cannot accept streams", ErrNotSupported)
	}
	return s.accepted.pop(s.closed, s.Err)
}

// Close closes the session and all its streams without telling the peer
// about each stream (PROTOCOL.md §6.4), closes the connection, and releases
// the shared memory once no stream holds slices of it. It returns after the
// receive loop has stopped. Close is idempotent.
func (s *Session) Close() error {
	s.closeWithError(nil)
	<-s.loopDone
	return nil
}

// IsClosed reports whether the session has ended.
func (s *Session) IsClosed() bool {
	select {
	case <-s.closed:
		return true
	default:
		return false
	}
}

// Err returns why the session ended: nil while it is open, ErrSessionClosed
// after Close, and an error wrapping ErrSessionClosed and the cause (such as
// ErrProtocol or ErrPeerClosed) otherwise.
func (s *Session) Err() error {
	select {
	case <-s.closed:
		return s.err
	default:
		return nil
	}
}

// closeWithError ends the session; cause nil means a local Close. The
// receive loop notices the closed connection and tears the session down.
func (s *Session) closeWithError(cause error) {
	s.closeOnce.Do(func() {
		if cause == nil {
			s.err = ErrSessionClosed
			s.localClose = true
		} else {
			s.err = fmt.Errorf("%w: %w", ErrSessionClosed, cause)
		}
		close(s.closed)
		if s.buf != nil {
			s.buf.sessionEnding() // before the peer sees the end
		}
		s.ec.conn.Close()
	})
}

// closedErr is Err for a session known to have ended.
func (s *Session) closedErr() error {
	<-s.closed
	return s.err
}

// wait blocks until ch is signalled, the session ends or deadline passes.
func (s *Session) wait(ch <-chan struct{}, deadline time.Time) {
	if deadline.IsZero() {
		select {
		case <-ch:
		case <-s.closed:
		}
		return
	}
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case <-ch:
	case <-s.closed:
	case <-t.C:
	}
}

// recvLoop reads event frames until the connection fails, then tears the
// session down. Readers may drain the queue too (poll.go), but only the
// receive loop applies closes, and teardown seals the queue before it ends
// the streams, so nothing reaches a stream after that.
func (s *Session) recvLoop() {
	defer close(s.loopDone)
	var err error
	for err == nil {
		var h wire.Header
		var payload []byte
		if h, payload, err = s.ec.readFrame(s.conf.MaxFallbackFrameSize); err != nil {
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
		s.counters.wakeupsReceived.Add(1)
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

// handleElem acts on one queue element: a message or a close.
func (s *Session) handleElem(e queueElem) error {
	if e.id == 0 {
		return fmt.Errorf("%w: IO queue element for stream id 0", ErrProtocol)
	}
	switch e.status & statusMask {
	case statusOpened:
		slices, err := s.buf.readChain(s.scratch[:0], e.offset)
		if err != nil {
			return fmt.Errorf("stream %d: %w", e.id, err)
		}
		s.scratch = slices
		n := 0
		for _, sl := range slices {
			n += len(sl.data)
		}
		s.counters.messagesIn.Add(1)
		s.counters.bytesIn.Add(uint64(n))
		st, err := s.streamFor(e.id)
		if err != nil {
			return err
		}
		if st == nil || !st.deliver(slices, nil) {
			return s.freeSlices(slices)
		}
		return nil
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
func (s *Session) closeCaughtUp() {
	n := 0
	for _, c := range s.closing {
		if c.at > s.handled {
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
	s.counters.messagesIn.Add(1)
	s.counters.bytesIn.Add(uint64(len(data)))
	s.counters.fallbackMessagesIn.Add(1)
	s.counters.fallbackBytesIn.Add(uint64(len(data)))
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
// the largest frame cannot wedge a stream. If the application makes no room
// within FallbackStallTimeout, the session ends with an error naming the
// bound.
func (s *Session) waitFallbackRoom(st *Stream, n int) error {
	var timer *time.Timer
	for {
		stream := st.heldFallback.Load()
		session := s.fallbackHeld.Load()
		var bound string
		var limit, held int64
		switch {
		case stream > 0 && stream+int64(n) > int64(s.conf.MaxFallbackBufferedPerStream):
			bound, limit, held = "Config.MaxFallbackBufferedPerStream", int64(s.conf.MaxFallbackBufferedPerStream), stream
		case session > 0 && session+int64(n) > int64(s.conf.MaxFallbackBuffered):
			bound, limit, held = "Config.MaxFallbackBuffered", int64(s.conf.MaxFallbackBuffered), session
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

// lookup returns the open stream with id, or nil.
func (s *Session) lookup(id uint32) *Stream {
	s.mu.Lock()
	st := s.streams[id]
	s.mu.Unlock()
	return st
}

// streamFor returns the stream data for id goes to. On a server an unknown
// id opens a stream (PROTOCOL.md §6.2), unless the peer already has
// Config.MaxStreams open, which ends the session; on a client it returns
// nil.
func (s *Session) streamFor(id uint32) (*Stream, error) {
	s.mu.Lock()
	st := s.streams[id]
	if st != nil || s.isClient || s.IsClosed() {
		s.mu.Unlock()
		return st, nil
	}
	if len(s.streams) >= s.conf.MaxStreams {
		s.mu.Unlock()
		return nil, fmt.Errorf("%w: the peer opened more than %d streams, the limit set by Config.MaxStreams", ErrLimitExceeded, s.conf.MaxStreams)
	}
	st, err := s.addStreamLocked(id)
	s.mu.Unlock()
	if err != nil {
		return nil, nil
	}
	accept := s.onAccept
	if accept == nil {
		accept = s.accepted.push
	}
	if err := accept(st, s.conf.MaxPendingAccepts); err != nil {
		if errors.Is(err, errTooManyPending) {
			return nil, fmt.Errorf("%w: %w, the limit set by Config.MaxPendingAccepts", ErrLimitExceeded, err)
		}
		return nil, nil // nobody accepts streams any more; push closed it
	}
	return st, nil
}

// forgetStream removes a closed stream from the table.
func (s *Session) forgetStream(st *Stream) {
	s.mu.Lock()
	if s.streams[st.id] == st {
		delete(s.streams, st.id)
	}
	s.mu.Unlock()
}

// putElem publishes e on the send queue and wakes the peer if it is not
// already draining. While the queue is full it waits (PROTOCOL.md §5.6 lets
// a sender retry), until the stream st (if any) is closed or past its write
// deadline, or Config.WriteSpaceTimeout passes. It reports whether e was
// published. It runs inside an access.
func (s *Session) putElem(e queueElem, st *Stream) (bool, error) {
	if !s.queueRegion.acquire() {
		return false, s.closedErr()
	}
	defer s.queueRegion.release()
	var wait spaceWait
	for {
		if err := s.Err(); err != nil {
			return false, err
		}
		ok, err := s.sendQ.put(e)
		if err != nil {
			s.closeWithError(err)
			return false, s.closedErr()
		}
		if ok {
			if s.sendQ.markWorking() {
				s.counters.wakeupsSent.Add(1)
				if err := s.ec.writeEvent(s.version, wire.TypePolling); err != nil {
					s.closeWithError(fmt.Errorf("send wake-up: %w", err))
					return true, s.closedErr()
				}
			} else {
				s.counters.wakeupsSaved.Add(1)
			}
			return true, nil
		}
		if err := wait.pause(s, st); err != nil {
			if err == errSpaceTimeout {
				return false, &spaceTimeout{msg: fmt.Sprintf("shmipc: IO queue full for %v: the peer is not consuming", wait.waited()), cause: ErrQueueFull}
			}
			return false, err
		}
	}
}

var errSpaceTimeout = errors.New("no space in time")

// spaceWait paces a writer that waits for the peer to free space: pauses
// that grow from minSpacePause to maxSpacePause, until the stream's write
// deadline or Config.WriteSpaceTimeout.
type spaceWait struct {
	start time.Time
	delay time.Duration
	limit time.Time
}

// pause sleeps once. It returns errSpaceTimeout when the time is up, or the
// error that stops the writer (stream or session closed).
func (w *spaceWait) pause(s *Session, st *Stream) error {
	now := time.Now()
	if w.start.IsZero() {
		w.start, w.delay = now, minSpacePause
		w.limit = now.Add(s.conf.WriteSpaceTimeout)
		if st != nil {
			if d := st.wDeadline.Load(); d != nil && !d.IsZero() && d.Before(w.limit) {
				w.limit = *d
			}
		}
	}
	if st != nil {
		if err := st.queueFullGiveUp(); err != nil {
			return err
		}
	}
	if !now.Before(w.limit) {
		return errSpaceTimeout
	}
	t := time.NewTimer(min(w.delay, w.limit.Sub(now)))
	select {
	case <-t.C:
	case <-s.closed:
		t.Stop()
		return s.closedErr()
	}
	w.delay = min(2*w.delay, maxSpacePause)
	return nil
}

func (w *spaceWait) waited() time.Duration { return time.Since(w.start).Round(time.Millisecond) }

// sendFallbackFrame sends one FallbackData frame, bounded by the stream's
// write deadline (zero: none) too. A failed write ends the session, unless
// the deadline passed before any of the frame was written.
func (s *Session) sendFallbackFrame(id uint32, data [][]byte, deadline time.Time) error {
	if err := s.Err(); err != nil {
		return err
	}
	if err := s.ec.writeFallback(s.version, id, data, deadline); err != nil {
		if errors.Is(err, ErrTimeout) && !errors.Is(err, errFrameTorn) {
			return err // nothing of the frame was written: only this write fails
		}
		s.closeWithError(fmt.Errorf("send fallback data: %w", err))
		return s.closedErr()
	}
	return nil
}

// sendStreamClose tells the peer a stream is closed: with a close element,
// or a StreamClose frame when the queue is full or the stream sends
// fallback data (so the close cannot overtake data on the socket). It runs
// inside an access.
func (s *Session) sendStreamClose(id uint32, byFrame bool) {
	if s.IsClosed() {
		return
	}
	if !byFrame {
		if !s.queueRegion.acquire() {
			return
		}
		ok, err := s.sendQ.put(queueElem{id: id, status: statusClosed})
		if ok && s.sendQ.markWorking() {
			err = s.ec.writeEvent(s.version, wire.TypePolling)
		}
		s.queueRegion.release()
		if err != nil {
			s.closeWithError(fmt.Errorf("send close of stream %d: %w", id, err))
		}
		if ok || err != nil {
			return
		}
	}
	if err := s.ec.writeStreamClose(s.version, id); err != nil {
		s.closeWithError(fmt.Errorf("send close of stream %d: %w", id, err))
	}
}

// freeSlices returns received slices to the buffer region.
func (s *Session) freeSlices(slices []shmSlice) error {
	for _, sl := range slices {
		if err := s.buf.push(int(sl.list), sl.off); err != nil {
			s.closeWithError(err)
			return err
		}
	}
	return nil
}

// freeSegments returns the shared-memory segments among segs to the buffer
// region. An error means the peer corrupted the region; the session is
// closed. It runs inside an access.
func (s *Session) freeSegments(segs []segment) error {
	for _, seg := range segs {
		if seg.list == heapSegment {
			continue
		}
		if err := s.buf.push(int(seg.list), seg.off); err != nil {
			s.closeWithError(err)
			return err
		}
	}
	return nil
}

// teardown runs on the receive loop once it has stopped reading: it ends
// every stream and drops the session's references on its regions.
func (s *Session) teardown() {
	s.sealConsumer() // no polling reader delivers from here on
	s.mu.Lock()
	streams := make([]*Stream, 0, len(s.streams))
	for _, st := range s.streams {
		streams = append(streams, st)
	}
	s.mu.Unlock()
	for _, st := range streams {
		st.sessionEnded(s.localClose)
	}
	s.accepted.close()
	s.reclaimUnconsumed()
	s.releaseRegions()
	unregister(s)
	if log := s.conf.logger(); s.localClose {
		log.Debug("shmipc: session closed", "role", s.role(), "remote", s.RemoteAddr())
	} else {
		log.Warn("shmipc: session ended", "role", s.role(), "remote", s.RemoteAddr(), "err", s.err)
	}
	if s.onTeardown != nil {
		s.onTeardown(s)
	}
}

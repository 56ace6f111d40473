package shmipc

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"net"
	"runtime/debug"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/goshm/shmipc/internal/shm"
	"github.com/goshm/shmipc/internal/wire"
)

// Session is one connection between a client and a server process, with its
// shared regions. It carries any number of streams. Only the client opens
// streams; the server accepts them. A Session is safe for concurrent use.
type Session struct {
	// Fields are grouped by who writes them; the groups written for every
	// message have cache lines of their own, and the first group, read for
	// every message on every core, is written only as the session starts.

	conf     *Config
	isClient bool
	version  uint8
	ec       *eventConn

	buf         *shm.Buffer
	queueRegion *shm.Region
	sendQ       *shm.Queue
	recvQ       *shm.Queue

	serverPid int32         // a memfd client's server process (exchangeVersion), 0 if unknown
	closed    chan struct{} // closed when the session ends

	// index finds an open stream by id without taking mu. Slot
	// id%streamIndexSize holds the stream of that id, another one, or nil;
	// it is written only under mu, and only with a stream in streams, so a
	// stream found there is one mu would have found.
	_     cacheLinePad
	index [streamIndexSize]atomic.Pointer[Stream]

	_       cacheLinePad
	mu      sync.Mutex
	streams map[uint32]*Stream
	// peerGone counts the streams in streams that the peer has closed and
	// this side has not: they do not count against Config.MaxStreams.
	peerGone int
	nextID   uint32 // the last id OpenStream gave out
	// closedIDs holds streams this server closed before the client did: data
	// the client sent before it saw the close must not open a new stream.
	closedIDs recentIDs
	accepted  streamQueue
	onAccept  func(st *Stream, limit int) error // where new streams go (a streamQueue's push); set before start
	retiring  bool                              // end the session once its last stream is closed (Listener.Close)

	closeOnce sync.Once
	err       error // why the session ended; written before closed is closed
	// sendErr is the failure of a write that found the peer gone; sending
	// stops while the receive loop reads to the end (uds_conn.go).
	sendErr    atomic.Pointer[error]
	localClose bool
	loopDone   chan struct{}
	onTeardown func(*Session)

	// Hot restart (docs/protocol.md §10): called on the receive loop with the
	// epoch of a HotRestart frame (client) or HotRestartAck frame (server).
	// They must not block.
	onHotRestart atomic.Pointer[func(epoch uint64)]
	// onRefused, set before the receive loop starts, runs on it when the
	// server closes a stream this client opened and sent nothing on: how a
	// stopping server refuses streams (SessionManager.refused). Must not block.
	onRefused       func()
	counters        stripedCounters
	onHotRestartAck atomic.Pointer[func(epoch uint64)]

	// The receive loop's alone (recv.go), and the token holder's (consume.go).
	_       cacheLinePad
	cons    consumer
	scratch []shm.Segment
	handled uint64         // bytes of the socket's byte stream acted on
	closing []pendingClose // close elements waiting for the socket to catch up
	stall   *stalledFrame  // fallback data waiting for room (fallback_recv.go)

	// Who consumes the receive queue (recvtoken.go), how many readers are
	// parked waiting for data (Stream.countWaiting), and their signal to
	// the loop (awaitReader).
	_           cacheLinePad
	tok         recvToken
	waiting     atomic.Int32
	readerWaits chan struct{}

	// Fallback data received and not yet released by the streams.
	_            cacheLinePad
	fallbackHeld atomic.Int64
	fallbackRoom chan struct{} // signalled when fallback data is released
	_            cacheLinePad
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
		readerWaits:  make(chan struct{}, 1),
	}
	s.cons.init(conf.ConsumerSpinTime)
	s.tok.init()
	s.accepted.init()
	s.onAccept = s.accepted.push
	s.ec.onAsyncErr = func(err error) { _ = s.sendFailed("send wake-up", err) }
	return s
}

// start runs the receive loop of a session whose handshake is done.
func (s *Session) start() {
	register(s)
	s.conf.logger().Debug("shmipc: session started", "role", s.role(), "version", s.version,
		"local", s.LocalAddr(), "remote", s.RemoteAddr())
	go s.recvLoop()
}

// peerPid returns the peer's pid, 0 if unknown: for a memfd client the
// process that answered the handshake (exchangeVersion), otherwise the one
// SO_PEERCRED names (for a client, the process that listens).
func (s *Session) peerPid() int {
	if s.isClient && s.version == wire.VersionMemfd {
		return int(s.serverPid)
	}
	if id, err := peerOf(s.ec.conn); err == nil {
		return int(id.pid)
	}
	return 0
}

// LocalAddr returns the local address of the session's connection.
func (s *Session) LocalAddr() net.Addr { return s.ec.conn.LocalAddr() }

// RemoteAddr returns the remote address of the session's connection.
func (s *Session) RemoteAddr() net.Addr { return s.ec.conn.RemoteAddr() }

// OpenStream opens a new stream. Only a client can open streams; the server
// learns of it with the first message sent on it (docs/protocol.md §9.2). It
// fails while Config.MaxStreams streams are open, and with an error wrapping
// ErrStreamIDsExhausted once the session has opened 2^32-2 streams (ids 2
// to 2^32-1; a SessionManager then dials a new session).
func (s *Session) OpenStream() (*Stream, error) {
	if !s.isClient {
		return nil, fmt.Errorf("%w: a server cannot open streams", ErrNotSupported)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.sendable(); err != nil {
		return nil, err // ended, or ending: the peer has gone (uds_conn.go)
	}
	if len(s.streams) >= s.conf.MaxStreams {
		return nil, fmt.Errorf("%w: %d streams are open, the limit set by Config.MaxStreams", ErrLimitExceeded, len(s.streams))
	}
	// Ids are never reused: the server may know a closed stream's id long
	// after (a close in flight, or closedIDs), and would drop a new
	// stream's data as late.
	if s.nextID == math.MaxUint32 {
		return nil, fmt.Errorf("%w: this session gave out its last stream id, %d; open streams on a new session", ErrStreamIDsExhausted, s.nextID)
	}
	s.nextID++
	return s.addStreamLocked(s.nextID)
}

// addStreamLocked adds stream id, holding a reference on the session's
// buffer and queue regions until it lets go of them (dropRef), so that a
// message costs no reference counting on lines all streams share.
func (s *Session) addStreamLocked(id uint32) (*Stream, error) {
	if !s.buf.Region().Acquire() {
		return nil, ErrSessionClosed
	}
	if !s.queueRegion.Acquire() {
		s.buf.Region().Release()
		return nil, ErrSessionClosed
	}
	st := newStream(s, id)
	s.streams[id] = st
	s.index[id%streamIndexSize].Store(st)
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
// about each stream (docs/protocol.md §9.4), closes the connection, and releases
// the shared memory once no stream holds slices of it. Slices a stream's
// reads returned in place (ReadBytes, Peek) stay valid, and keep the memory
// mapped, until that stream's ReleasePreviousRead or Close: a server that
// ends the sessions of clients that went away still closes their streams.
// It returns after the receive loop has stopped. Close is idempotent.
func (s *Session) Close() error {
	s.closeWithError(nil)
	<-s.loopDone
	return nil
}

// IsClosed reports whether the session has ended.
func (s *Session) IsClosed() bool { return isClosedChan(s.closed) }

// isClosedChan reports whether ch is closed, without waiting.
func isClosedChan(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// Err returns why the session ended: nil while it is open, ErrSessionClosed
// after Close, and an error wrapping ErrSessionClosed and the cause (such as
// ErrProtocol or ErrPeerClosed) otherwise.
func (s *Session) Err() error {
	if s.IsClosed() {
		return s.err
	}
	return nil
}

// closeWithError ends the session; cause nil means a local Close. The
// receive loop then sees the connection closed and tears down.
func (s *Session) closeWithError(cause error) {
	s.closeOnce.Do(func() {
		if cause == nil {
			s.err = ErrSessionClosed
			s.localClose = true
		} else {
			s.err = errorf("%w: %w", ErrSessionClosed, cause)
		}
		close(s.closed)
		// Nothing under s.mu touches shared memory or ends the session, so
		// no caller holds it.
		s.mu.Lock()
		for _, st := range s.streams {
			st.notify()
		}
		s.mu.Unlock()
		if s.buf != nil {
			// Before the peer sees the end: it may count its free lists.
			s.dropAllKept()
			s.buf.SessionEnding()
		}
		s.ec.conn.Close()
	})
}

// closedErr is Err for a session known to have ended.
func (s *Session) closedErr() error {
	<-s.closed
	return s.err
}

// wait blocks until ch, a stream's readNotify, is signalled, the session
// ends or deadline passes. Without a deadline it waits on ch alone, which
// costs less than a select: the end of the session signals ch too.
func (s *Session) wait(ch <-chan struct{}, deadline time.Time) {
	if deadline.IsZero() {
		<-ch
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

// streamIndexSize is the number of slots of Session.index: a session's
// first streams, whose ids follow each other, get a slot each.
const streamIndexSize = 128

// indexed returns the stream with id from the index, or nil if its slot
// holds another one or none.
func (s *Session) indexed(id uint32) *Stream {
	if st := s.index[id%streamIndexSize].Load(); st != nil && st.id == id {
		return st
	}
	return nil
}

// lookupLocked is lookup under s.mu, indexing what it finds in a free slot.
func (s *Session) lookupLocked(id uint32) *Stream {
	st := s.streams[id]
	if slot := &s.index[id%streamIndexSize]; st != nil && slot.Load() == nil {
		slot.Store(st)
	}
	return st
}

// lookup returns the open stream with id, or nil.
func (s *Session) lookup(id uint32) *Stream {
	if st := s.indexed(id); st != nil {
		return st
	}
	s.mu.Lock()
	st := s.lookupLocked(id)
	s.mu.Unlock()
	return st
}

// streamFor returns the stream data for id goes to. On a server an unknown
// id opens a stream (docs/protocol.md §9.2), unless the peer already has
// Config.MaxStreams open, which ends the session, or the server closed a
// stream of that id recently (late data; nil); on a client it returns nil.
func (s *Session) streamFor(id uint32) (*Stream, error) {
	if st := s.indexed(id); st != nil {
		return st, nil
	}
	s.mu.Lock()
	st := s.lookupLocked(id)
	if st != nil || s.isClient || s.IsClosed() || s.closedIDs.has(id) {
		s.mu.Unlock()
		return st, nil
	}
	// Twice the client's own bound: a client's close can reach the server
	// after the client's next stream does (a close sent over the socket,
	// data through the queue), at most one per stream it had open.
	if open := len(s.streams) - s.peerGone; open/2 >= s.conf.MaxStreams {
		s.mu.Unlock()
		return nil, fmt.Errorf("%w: the peer has %d streams open, more than twice the limit set by Config.MaxStreams", ErrLimitExceeded, open+1)
	}
	st, err := s.addStreamLocked(id)
	s.mu.Unlock()
	if err != nil {
		return nil, nil
	}
	if err := s.onAccept(st, s.conf.MaxPendingAccepts); err != nil {
		if errors.Is(err, errTooManyPending) {
			return nil, fmt.Errorf("%w: %w, the limit set by Config.MaxPendingAccepts", ErrLimitExceeded, err)
		}
		return nil, nil // nobody accepts streams any more; push closed it
	}
	return st, nil
}

// peerClosedStream records that the peer closed st, which this side may
// keep open for a while (reading what it sent, or not yet accepted).
func (s *Session) peerClosedStream(st *Stream) {
	s.mu.Lock()
	if s.streams[st.id] == st && !st.peerGone {
		st.peerGone = true
		s.peerGone++
	}
	s.mu.Unlock()
}

// forgetStream removes a closed stream from the table. open says the peer
// had not closed it. A retiring session ends with its last stream.
func (s *Session) forgetStream(st *Stream, open bool) {
	s.mu.Lock()
	if s.streams[st.id] == st {
		delete(s.streams, st.id)
		if st.peerGone {
			st.peerGone = false
			s.peerGone--
		}
		s.index[st.id%streamIndexSize].CompareAndSwap(st, nil)
		if open && !s.isClient {
			s.closedIDs.add(st.id)
		}
	}
	last := s.retiring && len(s.streams) == 0
	s.mu.Unlock()
	if last {
		s.closeWithError(nil)
	}
}

// streamList returns the streams in the session's table.
func (s *Session) streamList() []*Stream {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Collect(maps.Values(s.streams))
}

// teardown runs on the receive loop once it has stopped reading.
func (s *Session) teardown() {
	defer s.finishTeardown()
	for _, st := range s.streamList() {
		st.sessionEnded(s.localClose)
	}
	s.accepted.close()
	s.reclaimUnconsumed()
}

// finishTeardown unmaps the regions, moves the counters to the ended total
// and tells the listener. Deferred, it runs even when a memory fault in a
// shared region cuts teardown short (teardown runs inside an access).
func (s *Session) finishTeardown() {
	s.releaseRegions()
	unregister(s)
	switch log := s.conf.logger(); {
	case s.localClose:
		log.Debug("shmipc: session closed", "role", s.role(), "remote", s.RemoteAddr())
	case errors.Is(s.err, ErrPeerClosed): // how a peer leaves: routine for a server
		log.Info("shmipc: session ended by the peer", "role", s.role(), "remote", s.RemoteAddr(), "err", s.err)
	default:
		log.Warn("shmipc: session ended", "role", s.role(), "remote", s.RemoteAddr(), "err", s.err)
	}
	if s.onTeardown != nil {
		s.onTeardown(s)
	}
}

// recentIDsKept is how many ids recentIDs remembers: far more than the
// streams a client can close in the time its late data takes to arrive.
const recentIDsKept = 256

// recentIDs remembers the last recentIDsKept ids added, in a ring allocated
// on first use; has scans it, which it does only for ids no stream has.
type recentIDs struct {
	ring []uint32
	next int
}

func (r *recentIDs) add(id uint32) {
	if r.ring == nil {
		r.ring = make([]uint32, recentIDsKept)
	}
	r.ring[r.next] = id
	r.next = (r.next + 1) % len(r.ring)
}

func (r *recentIDs) has(id uint32) bool {
	return slices.Contains(r.ring, id)
}

// access runs f, which touches the session's shared regions, with memory
// faults turned into the session's error (the trust boundary: shm's
// access.go). Every code path that touches a region runs inside access, or
// begins with `defer s.endAccess(&err, debug.SetPanicOnFault(true))`. The
// fault is recovered inside it, so a caller may hold locks around it; code
// inside must not be half-way through updating state outside the region
// when it touches the region. Slices handed to the application
// (ReadBytes, Peek, Reserve) are touched outside it: RequireSealedMemory.
func (s *Session) access(f func() error) (err error) {
	defer s.endAccess(&err, debug.SetPanicOnFault(true))
	return f()
}

// endAccess restores the goroutine's fault setting and, after a fault, ends
// the session with an error wrapping ErrProtocol. Any other panic goes on.
func (s *Session) endAccess(err *error, old bool) {
	debug.SetPanicOnFault(old)
	r := recover()
	if r == nil {
		return
	}
	s.closeWithError(shm.FaultError(r))
	*err = s.closedErr()
}

package shmipc

import (
	"errors"
	"net"
	"strconv"
	"sync"
	"sync/atomic"

	shm "github.com/goshm/shmipc"
)

// Session is one connection between a client and a server process. It
// carries any number of streams: the client opens them, the server accepts
// them. There is one *Session for each session of the root package while
// it is open, so the one Stream.Session returns is the one Server returned.
type Session struct {
	s       *shm.Session
	client  bool
	id      uint64
	monitor Monitor
	hr      *restartCount // nil: no hot restarts to report
	size    uint64        // the buffer region's size, reported after the end too
	closed  chan struct{}

	mu       sync.Mutex
	last     shm.Stats // counters at the previous GetMetrics
	errShown bool      // EventConnErrorCount has counted the end
}

// Server runs the server side of the handshake on conn and returns the
// session (nil conf: DefaultConfig()). On error conn is closed.
func Server(conn net.Conn, conf *Config) (*Session, error) {
	if conf == nil {
		conf = DefaultConfig()
	}
	rc, err := rootConfig(conf)
	if err != nil {
		conn.Close()
		return nil, err
	}
	rs, err := shm.Server(conn, rc)
	if err != nil {
		return nil, err
	}
	return wrapSession(rs, false, conf.Monitor, nil), nil
}

// AcceptStream waits for the next stream the client opens.
func (s *Session) AcceptStream() (*Stream, error) {
	st, err := s.s.AcceptStream()
	if err != nil {
		return nil, compatErr(err)
	}
	return newStream(st, s), nil
}

// OpenStream opens a new stream (clients only).
func (s *Session) OpenStream() (*Stream, error) {
	st, err := s.s.OpenStream()
	if err != nil {
		return nil, openErr(err)
	}
	return newStream(st, s), nil
}

// Close closes the session and its streams.
func (s *Session) Close() error { return compatErr(s.s.Close()) }

// CloseChan returns a channel closed once the session has ended.
func (s *Session) CloseChan() <-chan struct{} { return s.closed }

// Err returns why the session ended (nil while it is open).
func (s *Session) Err() error { return s.s.Err() }

// GetActiveStreamCount returns the number of open streams.
func (s *Session) GetActiveStreamCount() int { return s.s.Stats().ActiveStreams }

// ID returns a name of the session, unique in the process.
func (s *Session) ID() string {
	role := "server-"
	if s.client {
		role = "client-"
	}
	return role + strconv.FormatUint(s.id, 10)
}

// IsClient reports whether this is the client side of the session.
func (s *Session) IsClient() bool { return s.client }

// IsClosed reports whether the session has ended.
func (s *Session) IsClosed() bool { return s.s.IsClosed() }

// IsHealthy reports whether the session is up.
func (s *Session) IsHealthy() bool { return !s.s.IsClosed() }

// LocalAddr returns the local address of the session's connection.
func (s *Session) LocalAddr() net.Addr { return s.s.LocalAddr() }

// RemoteAddr returns the remote address of the session's connection.
func (s *Session) RemoteAddr() net.Addr { return s.s.RemoteAddr() }

// GetMetrics returns the session's metrics. Counters count since the
// previous GetMetrics of the session (or Monitor report); gauges are
// current.
func (s *Session) GetMetrics() (PerformanceMetrics, StabilityMetrics, ShareMemoryMetrics) {
	st := s.s.Stats()
	s.mu.Lock()
	prev := s.last
	s.last = st
	connErr := false
	if err := s.s.Err(); err != nil && !s.errShown {
		s.errShown = true
		connErr = err != shm.ErrSessionClosed && !errors.Is(err, shm.ErrPeerClosed)
	}
	s.mu.Unlock()
	var restarted, failed uint64
	if s.hr != nil {
		restarted, failed = s.hr.take()
	}
	p := PerformanceMetrics{
		ReceiveSyncEventCount: st.WakeupsReceived - prev.WakeupsReceived,
		SendSyncEventCount:    st.WakeupsSent - prev.WakeupsSent,
		OutFlowBytes:          st.BytesOut - prev.BytesOut,
		InFlowBytes:           st.BytesIn - prev.BytesIn,
		SendQueueCount:        uint64(max(st.SendQueueDepth, 0)),
		ReceiveQueueCount:     uint64(max(st.RecvQueueDepth, 0)),
	}
	q := StabilityMetrics{
		AllocShmErrorCount:     st.SpaceWaits - prev.SpaceWaits,
		FallbackWriteCount:     st.FallbackMessagesOut - prev.FallbackMessagesOut,
		FallbackReadCount:      st.FallbackMessagesIn - prev.FallbackMessagesIn,
		ActiveStreamCount:      uint64(st.ActiveStreams),
		HotRestartSuccessCount: restarted,
		HotRestartErrorCount:   failed,
	}
	if connErr {
		q.EventConnErrorCount = 1
	}
	m := ShareMemoryMetrics{
		CapacityOfShareMemoryInBytes: max(st.Buffer.Size, s.size),
		AllInUsedShareMemoryInBytes:  st.Buffer.InUse,
	}
	return p, q, m
}

// restartCount hands out the hot restarts of a listener or a manager to
// the metrics of its sessions, each once.
type restartCount struct {
	total func() (ok, failed uint64)
	mu    sync.Mutex
	taken [2]uint64
}

// take returns the restarts not yet taken.
func (c *restartCount) take() (ok, failed uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	o, f := c.total()
	ok, failed = o-c.taken[0], f-c.taken[1]
	c.taken = [2]uint64{o, f}
	return ok, failed
}

// sessions maps each open session of the root package that the package
// has handed out to its *Session; watch removes the ended ones.
var sessions struct {
	m       sync.Map // *shm.Session -> *Session
	ids     atomic.Uint64
	watched atomic.Bool // watch is running
}

// wrapSession returns the *Session of rs, making it with the given role,
// monitor and restart count if there is none yet.
func wrapSession(rs *shm.Session, client bool, mon Monitor, hr *restartCount) *Session {
	if v, ok := sessions.m.Load(rs); ok {
		return v.(*Session)
	}
	s := &Session{s: rs, client: client, monitor: mon, hr: hr, size: rs.Stats().Buffer.Size, closed: make(chan struct{})}
	if rs.IsClosed() {
		close(s.closed)
		return s
	}
	s.id = sessions.ids.Add(1)
	if v, loaded := sessions.m.LoadOrStore(rs, s); loaded {
		return v.(*Session)
	}
	if sessions.watched.CompareAndSwap(false, true) {
		go watch()
	}
	return s
}

package shmipc

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Defaults of SessionManagerConfig.
const (
	defaultSessionNum          = 1
	maxSessionNum              = 4096
	defaultMaxIdleStreams      = 1024
	defaultMinReconnectBackoff = 10 * time.Millisecond
	defaultMaxReconnectBackoff = 2 * time.Second
)

// SessionManagerConfig configures a SessionManager. Zero fields take the
// defaults given with them.
type SessionManagerConfig struct {
	// Config configures each session. nil means DefaultConfig().
	Config *Config

	// Network and Address are where the sessions are dialed, as for Dial:
	// "unix" and a socket path, or "tcp" and host:port (file mode only).
	Network string
	Address string

	// SessionNum is the number of sessions kept open to the server (default
	// 1, at most 4096). New streams are spread over them round-robin.
	SessionNum int

	// MaxIdleStreams bounds the idle streams pooled per session (default
	// 1024). A stream put back to a full pool is closed.
	MaxIdleStreams int

	// StreamMaxIdleTime closes pooled streams that have been idle for longer
	// than this. Zero keeps idle streams until their session ends or the
	// manager closes.
	StreamMaxIdleTime time.Duration

	// MinReconnectBackoff and MaxReconnectBackoff bound the delay between
	// attempts to re-dial a session that died: it starts at the minimum and
	// doubles after each attempt up to the maximum (defaults 10 ms and 2 s),
	// and is reset only by a session that lived longer than the maximum.
	MinReconnectBackoff time.Duration
	MaxReconnectBackoff time.Duration
}

// SessionManager is a client-side pool: it keeps SessionNum sessions open to
// one server and recycles the streams on them. It is safe for concurrent
// use.
//
// Use GetStream to take a stream for a request and PutBack to return it once
// the response has been read completely; the next GetStream may hand out the
// same stream again, which saves opening a stream per request. A stream
// that is not put back must be closed.
//
// When a session dies (the server closed it, restarted, or broke the
// protocol), its pooled streams are dropped and it is re-dialed in the
// background with exponential backoff; meanwhile GetStream uses the other
// sessions and fails with ErrNoHealthySession if there are none, and
// GetStreamContext waits for one. Streams already handed out on a dead
// session fail with errors wrapping ErrSessionClosed.
//
// A server stopping gracefully (Listener.Close) keeps its sessions while
// streams are open on them and closes every new stream (its user reads
// io.EOF). When the server closes a stream the manager opened before
// sending anything on it, on a session older than a second, the manager
// dials a new session, where a new server may listen by now, and retires
// the old one: its pooled streams are closed, those handed out when put
// back, and it ends with the last of them. A failed dial leaves the old
// session; the next refusal retries a second later at the earliest (the
// wait doubles, up to 16 s, while new sessions reach the same
// server process). Close also ends the retired sessions still open.
//
// Hot restart (docs/protocol.md §10): the first HotRestart frame from the
// server, unless a restart began less than a second before, makes the
// manager dial SessionNum new sessions (regions named
// <prefix>_epoch_<epoch>_<randID>_<pid>_<random>_buffer and _queue_0),
// each replacing an old session whose pooled streams are closed; streams
// already handed out keep working. Once every session is replaced the
// manager sends HotRestartAck on every old session and closes each when no
// stream is open on it (within 2 s). If the new sessions cannot all be
// dialed within 2 s, the old sessions already replaced are closed without
// an acknowledgement.
type SessionManager struct {
	conf   SessionManagerConfig
	slots  []*smSlot
	next   atomic.Uint32
	ctx    context.Context // cancelled by Close
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	closed  bool
	healthy chan struct{} // closed and replaced whenever a session comes back

	hr smHotRestart // hot restart (hotrestart_client.go)
}

// NewSessionManager dials conf.SessionNum sessions to conf.Address and
// returns the manager. If any of them cannot be dialed it closes the others
// and returns the error: a manager starts complete, and only re-dials
// sessions that die later.
func NewSessionManager(conf SessionManagerConfig) (*SessionManager, error) {
	var err error
	if conf.Config, err = verified(conf.Config); err != nil {
		return nil, err
	}
	if conf.Network == "" || conf.Address == "" {
		return nil, fmt.Errorf("%w: SessionManagerConfig needs a Network and an Address", ErrInvalidConfig)
	}
	if conf.SessionNum < 0 || conf.MaxIdleStreams < 0 || conf.StreamMaxIdleTime < 0 ||
		conf.MinReconnectBackoff < 0 || conf.MaxReconnectBackoff < 0 {
		return nil, fmt.Errorf("%w: negative SessionManagerConfig field", ErrInvalidConfig)
	}
	conf.SessionNum = cmp.Or(conf.SessionNum, defaultSessionNum)
	if conf.SessionNum > maxSessionNum {
		return nil, fmt.Errorf("%w: SessionNum %d is above %d", ErrInvalidConfig, conf.SessionNum, maxSessionNum)
	}
	conf.MaxIdleStreams = cmp.Or(conf.MaxIdleStreams, defaultMaxIdleStreams)
	conf.MinReconnectBackoff = cmp.Or(conf.MinReconnectBackoff, defaultMinReconnectBackoff)
	conf.MaxReconnectBackoff = cmp.Or(conf.MaxReconnectBackoff, max(defaultMaxReconnectBackoff, conf.MinReconnectBackoff))
	if conf.MaxReconnectBackoff < conf.MinReconnectBackoff {
		return nil, fmt.Errorf("%w: MaxReconnectBackoff %v is below MinReconnectBackoff %v",
			ErrInvalidConfig, conf.MaxReconnectBackoff, conf.MinReconnectBackoff)
	}

	m := &SessionManager{conf: conf, healthy: make(chan struct{})}
	m.ctx, m.cancel = context.WithCancel(context.Background())
	sessions := make([]*Session, 0, conf.SessionNum)
	for range conf.SessionNum {
		s, err := m.dial()
		if err != nil {
			m.cancel()
			for _, s := range sessions {
				s.Close()
			}
			return nil, err
		}
		sessions = append(sessions, s)
	}
	m.slots = make([]*smSlot, conf.SessionNum)
	for i, s := range sessions {
		sl := &smSlot{m: m, index: i, sess: s, refused: make(chan *Session, 1)}
		m.slots[i] = sl
		m.wg.Add(1)
		go sl.watch(s)
	}
	if conf.StreamMaxIdleTime > 0 {
		m.wg.Add(1)
		go m.evictLoop()
	}
	m.hr.mu.Lock()
	m.hr.ready = true // HotRestart frames are acted on from now on
	m.hr.mu.Unlock()
	return m, nil
}

// setupSession installs the manager's hooks on a session it dialed, before
// its receive loop starts.
func (m *SessionManager) setupSession(s *Session) {
	f := func(epoch uint64) { m.onHotRestart(s, epoch) }
	s.onHotRestart.Store(&f)
	s.onRefused = func() { m.refused(s) }
}

// refused tells the slot whose session s is that the server refused a
// stream on it (Session.onRefused). It runs on s's receive loop.
func (m *SessionManager) refused(s *Session) {
	if sl := m.slotOf(s); sl != nil {
		select {
		case sl.refused <- s:
		default:
		}
	}
}

// slotOf returns the slot whose session is s, or nil.
func (m *SessionManager) slotOf(s *Session) *smSlot {
	for _, sl := range m.slots {
		if sl.current() == s {
			return sl
		}
	}
	return nil
}

// dial dials one session; Close aborts it.
func (m *SessionManager) dial() (*Session, error) {
	return m.dialWith(m.ctx, m.conf.Config)
}

// dialWith dials one session with conf; the end of ctx aborts it.
func (m *SessionManager) dialWith(ctx context.Context, conf *Config) (*Session, error) {
	d := net.Dialer{Timeout: conf.ConnectionWriteTimeout}
	conn, err := d.DialContext(ctx, m.conf.Network, m.conf.Address)
	if err != nil {
		return nil, netError("dial", m.conf.Network, m.conf.Address, err)
	}
	stop := context.AfterFunc(ctx, func() { conn.Close() }) // abort the handshake
	s, err := handshake(conn, conf, true, m.setupSession)
	if !stop() && err == nil { // Close came during the handshake
		s.Close()
		return nil, ErrSessionManagerClosed
	}
	return s, err
}

// GetStream returns an idle pooled stream or, if there is none, a new stream,
// taking the sessions in turn. It does not wait: when no session is healthy
// it fails with an error wrapping ErrNoHealthySession, and after Close with
// ErrSessionManagerClosed.
//
// The caller owns the stream until it passes it to PutBack or closes it.
func (m *SessionManager) GetStream() (*Stream, error) { return m.getStream(true) }

// getStream is GetStream, opening a new stream if !pooled.
func (m *SessionManager) getStream(pooled bool) (*Stream, error) {
	if m.isClosed() {
		return nil, ErrSessionManagerClosed
	}
	n := len(m.slots)
	start := int(m.next.Add(1)-1) % n
	// An idle stream of any session first, so that the number of streams
	// stays near the number used at once; then a new stream, round-robin.
	for k := 0; pooled && k < n; k++ {
		if st := m.slots[(start+k)%n].popIdle(); st != nil {
			return st, nil
		}
	}
	var lastErr error
	for k := range n {
		st, err := m.slots[(start+k)%n].openStream()
		if st != nil {
			return st, nil
		}
		lastErr = err
	}
	if m.isClosed() {
		return nil, ErrSessionManagerClosed
	}
	if lastErr == nil {
		lastErr = errors.New("reconnecting")
	}
	if strings.Contains(lastErr.Error(), m.conf.Address) { // a dial error names it
		return nil, errorf("%w: all %d sessions are down: %w", ErrNoHealthySession, n, lastErr)
	}
	return nil, errorf("%w: all %d sessions to %s %s are down: %w",
		ErrNoHealthySession, n, m.conf.Network, m.conf.Address, lastErr)
}

// GetStreamContext is GetStream, except that while no session is healthy it
// waits for one to be re-dialed, until ctx is done. With ctx already done it
// fails with ctx.Err(), as net.Dialer.DialContext does.
func (m *SessionManager) GetStreamContext(ctx context.Context) (*Stream, error) {
	return m.getStreamContext(ctx, true)
}

// getStreamContext is GetStreamContext, opening a new stream if !pooled.
func (m *SessionManager) getStreamContext(ctx context.Context, pooled bool) (*Stream, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	for {
		m.mu.Lock()
		healthy := m.healthy
		m.mu.Unlock()
		st, err := m.getStream(pooled)
		if !errors.Is(err, ErrNoHealthySession) {
			return st, err
		}
		select {
		case <-healthy:
		case <-m.ctx.Done():
			return nil, ErrSessionManagerClosed
		case <-ctx.Done():
			return nil, fmt.Errorf("%w (%w)", err, ctx.Err())
		}
	}
}

// PutBack returns a stream obtained from GetStream for reuse. It releases
// what was read from it (ReleasePreviousRead), so slices returned by its
// reads become invalid, and clears its deadlines. The caller must not use
// st afterwards.
//
// Only a clean stream is pooled, one on which nothing more can arrive for
// the request it carried, as far as the stream can tell:
//   - no read on it has ever failed: not with a deadline (a reply may still
//     be on its way), nor with any other error, even after it returned
//     some bytes (Discard, netpoll Until);
//   - if anything was written on it (even by a write that failed), a read
//     returned bytes after the last write began;
//   - it holds no unread data and no unflushed message;
//   - it is not closed by either side, not in fallback mode, and its
//     session is healthy and still the manager's.
//
// Any other stream is closed instead, and so is one that does not fit into
// the pool; either way the caller may put back every stream it got, even
// after a failed read. What the stream cannot know is where a reply ends:
// put it back only once the response has been read completely. A stream
// put back twice is pooled once.
func (m *SessionManager) PutBack(st *Stream) {
	if st == nil {
		return
	}
	if !poolable(st) {
		st.Close()
		return
	}
	st.BufferReader().ReleasePreviousRead()
	st.SetDeadline(time.Time{})
	for _, sl := range m.slots {
		if sl.putBack(st) {
			return
		}
	}
	st.Close()
}

// poolable reports whether st is clean (see PutBack) for another request.
func poolable(st *Stream) bool {
	return !st.writeClosed.Load() && !st.fallback.Load() && st.s.sendable() == nil &&
		st.reuse.Load() == 0 &&
		st.BufferReader().Len() == 0 && st.BufferWriter().Len() == 0
}

// Close closes every session of the manager, with their streams (pooled or
// handed out), stops re-dialing, and waits for the manager's goroutines to
// end. GetStream fails afterwards; PutBack closes the streams it is given.
// Close is idempotent.
func (m *SessionManager) Close() error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil
	}
	m.closed = true
	m.mu.Unlock()
	m.cancel()
	for _, sl := range m.slots {
		sl.mu.Lock()
		s, idle := sl.sess, sl.idle
		sl.sess, sl.idle = nil, nil
		sl.mu.Unlock()
		for _, is := range idle {
			is.st.Close()
		}
		if s != nil {
			s.Close()
		}
	}
	m.wg.Wait()
	return nil
}

func (m *SessionManager) isClosed() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.closed
}

// Sessions returns the sessions currently open, for inspection (such as
// Session.IsClosed). Do not close them; Close the manager.
func (m *SessionManager) Sessions() []*Session {
	var out []*Session
	for _, sl := range m.slots {
		if s := sl.current(); s != nil {
			out = append(out, s)
		}
	}
	return out
}

// IdleStreams returns the number of streams in the pools.
func (m *SessionManager) IdleStreams() int {
	n := 0
	for _, sl := range m.slots {
		sl.mu.Lock()
		n += len(sl.idle)
		sl.mu.Unlock()
	}
	return n
}

// evictLoop closes pooled streams idle for longer than StreamMaxIdleTime.
func (m *SessionManager) evictLoop() {
	defer m.wg.Done()
	maxIdle := m.conf.StreamMaxIdleTime
	tick := time.NewTicker(max(maxIdle/2, time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case <-tick.C:
		case <-m.ctx.Done():
			return
		}
		cutoff := time.Now().Add(-maxIdle)
		for _, sl := range m.slots {
			sl.mu.Lock()
			// The pool is a stack: the oldest streams are at the bottom.
			n := 0
			for n < len(sl.idle) && sl.idle[n].since.Before(cutoff) {
				n++
			}
			stale := slices.Clone(sl.idle[:n])
			sl.idle = slices.Delete(sl.idle, 0, n)
			sl.mu.Unlock()
			for _, is := range stale {
				is.st.Close()
			}
		}
	}
}

// Connections for RPC frameworks that dial a net.Conn themselves, such as
// gRPC: a stream of a SessionManager is the connection, and a Listener is
// the net.Listener the server serves.
//
//	m, err := shmipc.NewSessionManager(shmipc.SessionManagerConfig{Network: "unix", Address: sock})
//	conn, err := grpc.NewClient("passthrough:///shmipc", grpc.WithContextDialer(m.DialContext), ...)
//
//	ln, err := shmipc.Listen("unix", sock, nil)
//	err = grpcServer.Serve(ln)

// DialContext opens a new stream on one of the manager's sessions and returns
// it as a net.Conn (a *Stream), for grpc.WithContextDialer. addr is ignored:
// the manager dials its configured address (a gRPC target such as
// "passthrough:///shmipc" is fine).
//
// The stream is always new, never one from the pool: a protocol such as
// HTTP/2 must start at its beginning, which a pooled stream has passed. The
// caller owns the stream and must Close it, not give it to PutBack.
//
// While every session is down it waits, as GetStreamContext does, for one
// to be re-dialed until ctx is done, and then fails with an error wrapping
// ErrNoHealthySession and ctx.Err(); with ctx already done, with ctx.Err().
// After Close it fails with ErrSessionManagerClosed.
func (m *SessionManager) DialContext(ctx context.Context, addr string) (net.Conn, error) {
	st, err := m.getStreamContext(ctx, false)
	if err != nil {
		return nil, err // not a net.Conn holding a nil *Stream
	}
	return st, nil
}

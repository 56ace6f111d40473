package shmipc

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	shm "github.com/goshm/shmipc"
)

// SessionManagerConfig configures a SessionManager: its sessions' Config,
// where to dial them (Network "unix" and a socket path in Address, or
// UnixPath when Address is empty; or "tcp" and host:port, for
// MemMapTypeDevShmFile), how many sessions to keep, how many idle streams
// to pool per session, and after how long idle streams are closed.
type SessionManagerConfig struct {
	*Config
	UnixPath          string
	Network           string
	Address           string
	SessionNum        int
	MaxStreamNum      int
	StreamMaxIdleTime time.Duration
}

// DefaultSessionManagerConfig returns DefaultConfig() with one session
// over a Unix socket, 4096 idle streams per session and a 30 s idle time;
// Address is left to set.
func DefaultSessionManagerConfig() *SessionManagerConfig {
	return &SessionManagerConfig{
		Config:            DefaultConfig(),
		Network:           "unix",
		SessionNum:        1,
		MaxStreamNum:      4096,
		StreamMaxIdleTime: 30 * time.Second,
	}
}

// SessionManager keeps SessionNum sessions to one server, pools their
// streams (GetStream, PutBack), re-dials sessions that die and follows the
// server through hot restarts. It is safe for concurrent use.
type SessionManager struct {
	sync.RWMutex // for programs that lock the manager; the package does not
	m            *shm.SessionManager
	monitor      Monitor
	restarts     restartCount
}

// NewSessionManager dials config.SessionNum sessions and returns the
// manager; it fails if any cannot be dialed.
func NewSessionManager(config *SessionManagerConfig) (*SessionManager, error) {
	if config == nil {
		return nil, fmt.Errorf("%w: nil SessionManagerConfig", shm.ErrInvalidConfig)
	}
	rc, err := rootConfig(config.Config)
	if err != nil {
		return nil, err
	}
	address, network := config.Address, config.Network
	if address == "" {
		address = config.UnixPath
	}
	if network == "" {
		network = "unix"
	}
	m, err := shm.NewSessionManager(shm.SessionManagerConfig{
		Config:            rc,
		Network:           network,
		Address:           address,
		SessionNum:        config.SessionNum,
		MaxIdleStreams:    config.MaxStreamNum,
		StreamMaxIdleTime: config.StreamMaxIdleTime,
	})
	if err != nil {
		return nil, err
	}
	sm := &SessionManager{m: m}
	if config.Config != nil {
		sm.monitor = config.Monitor
	}
	sm.restarts.total = func() (uint64, uint64) {
		ok, failed := m.HotRestarts()
		return uint64(ok), uint64(failed)
	}
	return sm, nil
}

// GetStream returns an idle pooled stream, or a new one. While every
// session is down it fails with ErrSessionUnhealthy, after Close with
// ErrSessionShutdown.
func (sm *SessionManager) GetStream() (*Stream, error) {
	st, err := sm.m.GetStream()
	if err != nil {
		return nil, openErr(err)
	}
	return newStream(st, wrapSession(st.Session(), true, sm.monitor, &sm.restarts)), nil
}

// PutBack returns a stream from GetStream to the pool once its response
// has been read completely; the stream must not be used afterwards. A
// stream that cannot carry another request (closed, holding unread data,
// with callbacks set, of a dead session) is closed instead.
func (sm *SessionManager) PutBack(stream *Stream) {
	if stream == nil {
		return
	}
	if stream.callbacks.Load() {
		stream.Close()
		return
	}
	sm.m.PutBack(stream.st)
}

// Close closes every session of the manager with its streams.
func (sm *SessionManager) Close() error { return compatErr(sm.m.Close()) }

var global struct {
	mu sync.Mutex // held by InitGlobalSessionManager
	sm atomic.Pointer[SessionManager]
}

// InitGlobalSessionManager makes the manager GlobalSessionManager
// returns. Once it has succeeded, later calls return that manager.
func InitGlobalSessionManager(config *SessionManagerConfig) (*SessionManager, error) {
	global.mu.Lock()
	defer global.mu.Unlock()
	if sm := global.sm.Load(); sm != nil {
		return sm, nil
	}
	sm, err := NewSessionManager(config)
	if err != nil {
		return nil, err
	}
	global.sm.Store(sm)
	return sm, nil
}

// GlobalSessionManager returns the manager InitGlobalSessionManager made,
// or nil before.
func GlobalSessionManager() *SessionManager { return global.sm.Load() }

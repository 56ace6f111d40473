package shmipc

import (
	"fmt"
	"sync"
	"time"

	shm "github.com/goshm/shmipc"
)

// SessionManagerConfig configures a SessionManager.
type SessionManagerConfig struct {
	*Config
	// UnixPath is the server's socket path when Address is empty
	// (deprecated in shmipc-go).
	UnixPath string
	// Network and Address are where the sessions are dialed: "unix" and a
	// socket path, or "tcp" and host:port (MemMapTypeDevShmFile only).
	Network string
	Address string
	// SessionNum is the number of sessions kept open.
	SessionNum int
	// MaxStreamNum bounds the idle streams pooled per session.
	MaxStreamNum int
	// StreamMaxIdleTime closes pooled streams idle for longer.
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
	// RWMutex is there for programs that lock the manager themselves; the
	// package does not use it.
	sync.RWMutex
	m        *shm.SessionManager
	monitor  Monitor
	restarts restartCount
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
	mu sync.Mutex
	sm *SessionManager
}

// InitGlobalSessionManager makes the manager GlobalSessionManager
// returns. Once it has succeeded, later calls return that manager.
func InitGlobalSessionManager(config *SessionManagerConfig) (*SessionManager, error) {
	global.mu.Lock()
	defer global.mu.Unlock()
	if global.sm != nil {
		return global.sm, nil
	}
	sm, err := NewSessionManager(config)
	if err != nil {
		return nil, err
	}
	global.sm = sm
	return sm, nil
}

// GlobalSessionManager returns the manager made by
// InitGlobalSessionManager, or nil before.
func GlobalSessionManager() *SessionManager {
	global.mu.Lock()
	defer global.mu.Unlock()
	return global.sm
}

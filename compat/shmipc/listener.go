package shmipc

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"

	shm "github.com/goshm/shmipc"
)

// ListenCallback receives the streams of a Listener that Run serves.
type ListenCallback interface {
	// OnNewStream is called, in a goroutine of its own, for each new
	// stream; it typically calls SetCallbacks.
	OnNewStream(s *Stream)
	// OnShutdown is called once, when the listener stops.
	OnShutdown(reason string)
}

// ListenerConfig configures a Listener: the sessions' Config, and where
// to listen: Network "unix" and a socket path in ListenPath (or "tcp" and
// host:port, for MemMapTypeDevShmFile clients).
type ListenerConfig struct {
	*Config
	Network    string
	ListenPath string
}

// NewDefaultListenerConfig returns a ListenerConfig with DefaultConfig().
func NewDefaultListenerConfig(listenPath string, network string) *ListenerConfig {
	return &ListenerConfig{Config: DefaultConfig(), Network: network, ListenPath: listenPath}
}

// Listener accepts sessions and delivers their streams: to a
// ListenCallback (Run), or through Accept as a net.Listener.
type Listener struct {
	ln       *shm.Listener
	cb       ListenCallback
	monitor  Monitor
	shutdown sync.Once
	// The hot restarts: the latest one is done (acknowledged by every
	// session); how many were, and how many timed out.
	restartDone    atomic.Bool
	restartsOK     atomic.Uint64
	restartsFailed atomic.Uint64
	restarts       *restartCount // a pointer: Listener stays comparable, as shmipc-go's is
}

// NewListener listens as config says; Run then serves callback. On a Unix
// socket path a socket already there is replaced atomically (as a new
// server of a hot restart needs), and connections made before still reach
// the server that had it.
func NewListener(callback ListenCallback, config *ListenerConfig) (*Listener, error) {
	if callback == nil {
		return nil, fmt.Errorf("%w: nil ListenCallback", shm.ErrInvalidConfig)
	}
	if config == nil {
		return nil, fmt.Errorf("%w: nil ListenerConfig", shm.ErrInvalidConfig)
	}
	return listen(callback, config.Config, config.Network, config.ListenPath)
}

// Listen listens on the Unix socket path shmIPCAddress with
// DefaultConfig(); Accept returns the streams clients open, as *Stream.
func Listen(shmIPCAddress string) (net.Listener, error) {
	return listen(nil, nil, "unix", shmIPCAddress)
}

// ListenWithBacklog is Listen; backlog must be positive, and is not a bound.
func ListenWithBacklog(shmIPCAddress string, backlog int) (net.Listener, error) {
	if backlog <= 0 {
		return nil, fmt.Errorf("%w: backlog %d", shm.ErrInvalidConfig, backlog)
	}
	return Listen(shmIPCAddress)
}

func listen(cb ListenCallback, conf *Config, network, path string) (*Listener, error) {
	if conf == nil {
		conf = DefaultConfig()
	}
	rc, err := rootConfig(conf)
	if err != nil {
		return nil, err
	}
	var ln *shm.Listener
	if (network == "" || strings.HasPrefix(network, "unix")) && path != "" && path[0] != '@' {
		ln, err = shm.ListenTakeover(path, rc)
	} else {
		ln, err = shm.Listen(network, path, rc)
	}
	if err != nil {
		return nil, err
	}
	if cb == nil {
		cb = noCallback{}
	}
	l := &Listener{ln: ln, cb: cb, monitor: conf.Monitor}
	l.restarts = &restartCount{total: func() (uint64, uint64) { return l.restartsOK.Load(), l.restartsFailed.Load() }}
	return l, nil
}

// accept returns the next stream.
func (l *Listener) accept() (*Stream, error) {
	st, err := l.ln.AcceptStream()
	if err != nil {
		return nil, err
	}
	return newStream(st, wrapSession(st.Session(), false, l.monitor, l.restarts)), nil
}

// Run serves the listener's callback until Close: it calls OnNewStream
// for each stream, then OnShutdown. It returns nil after Close.
func (l *Listener) Run() error {
	for {
		st, err := l.accept()
		if err != nil {
			if errors.Is(err, shm.ErrListenerClosed) {
				l.stopped("listener closed")
				return nil
			}
			l.stopped(err.Error())
			return err
		}
		go l.cb.OnNewStream(st)
	}
}

// stopped calls OnShutdown, once.
func (l *Listener) stopped(reason string) {
	l.shutdown.Do(func() { l.cb.OnShutdown(reason) })
}

// Accept waits for the next stream and returns it (a *Stream). Do not
// call it on a listener that Run serves.
func (l *Listener) Accept() (net.Conn, error) {
	st, err := l.accept()
	if err != nil {
		return nil, err
	}
	return st, nil
}

// Addr returns the listening address.
func (l *Listener) Addr() net.Addr { return l.ln.Addr() }

// Close stops accepting and calls OnShutdown. Streams already accepted
// stay open until either side closes them; each session ends with its last.
func (l *Listener) Close() error {
	err := l.ln.Close()
	l.stopped("listener closed")
	return err
}

// SetUnlinkOnClose has no effect: Close removes the socket file only while
// it is still this listener's and no hot restart has handed it on.
func (l *Listener) SetUnlinkOnClose(unlink bool) {}

// HotRestart starts a hot restart with epoch: every session's client is
// told to move to the server that now listens on the socket path (a new
// process that called NewListener on it). IsHotRestartDone reports when
// every client has acknowledged, within 2 s.
func (l *Listener) HotRestart(epoch uint64) error {
	if err := l.ln.HotRestart(epoch); err != nil {
		switch {
		case errors.Is(err, shm.ErrHotRestartRunning):
			return ErrHotRestartInProgress
		case errors.Is(err, shm.ErrHotRestartHandshaking):
			return ErrInHandshakeStage
		}
		return err
	}
	l.restartDone.Store(false)
	go func() {
		switch err := l.ln.WaitHotRestart(context.Background()); {
		case err == nil:
			l.restartsOK.Add(1)
			l.restartDone.Store(true)
		case errors.Is(err, shm.ErrHotRestartTimeout):
			l.restartsFailed.Add(1)
		}
	}()
	return nil
}

// IsHotRestartDone reports whether the latest HotRestart has finished
// with every session acknowledged. After one that timed out it stays
// false (the sessions stay up); HotRestart may be called again.
func (l *Listener) IsHotRestartDone() bool { return l.restartDone.Load() }

// noCallback is the ListenCallback of Listen's listeners, for Run.
type noCallback struct{}

func (noCallback) OnNewStream(s *Stream)    { s.Close() }
func (noCallback) OnShutdown(reason string) {}

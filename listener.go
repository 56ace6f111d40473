package shmipc

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Dial connects to a server at address ("unix" or "tcp" network) and runs
// the client handshake. Over TCP, conf.MemMapType must be
// MemMapTypeDevShmFile. A nil conf means DefaultConfig().
func Dial(network, address string, conf *Config) (*Session, error) {
	if conf == nil {
		conf = DefaultConfig()
	}
	if err := conf.Verify(); err != nil {
		return nil, err
	}
	if conf.MemMapType == MemMapTypeMemFd && !strings.HasPrefix(network, "unix") {
		return nil, fmt.Errorf("%w: memfd regions need a Unix socket, not %q; use MemMapTypeDevShmFile", ErrInvalidConfig, network)
	}
	conn, err := net.DialTimeout(network, address, conf.ConnectionWriteTimeout)
	if err != nil {
		return nil, fmt.Errorf("shmipc: dial %s %s: %w", network, address, err)
	}
	return Client(conn, conf)
}

// Listener accepts sessions on a socket and delivers the streams their
// clients open. It implements net.Listener: Accept returns each new stream
// as a net.Conn (a *Stream).
type Listener struct {
	ln   net.Listener
	conf *Config

	streams streamQueue
	closed  chan struct{}
	once    sync.Once
	done    chan struct{} // the accept loop has stopped

	mu       sync.Mutex
	sessions map[*Session]struct{}
	pending  map[net.Conn]struct{} // connections still in their handshake

	restart atomic.Pointer[srvHotRestart] // the latest hot restart, until Close
}

var _ net.Listener = (*Listener)(nil)

// Listen listens on address ("unix" or "tcp" network) for shmipc clients.
// A nil conf means DefaultConfig(); the server side uses its
// ShareMemoryPathPrefix directory as the only place file-mode regions may
// come from, and its timeouts.
//
// A Unix socket file left behind by a server that died without closing its
// listener (killed, or crashed) is taken over: when address is a socket
// that nobody listens on (connecting to it is refused), Listen removes it
// and binds anew. A socket a live server listens on is left alone, and
// Listen fails with an error wrapping syscall.EADDRINUSE; so it does for a
// file at address that is not a socket. Two servers started at the same
// moment on the same stale socket may both succeed, the later one replacing
// the earlier's socket file; start one server per address.
func Listen(network, address string, conf *Config) (*Listener, error) {
	if conf == nil {
		conf = DefaultConfig()
	}
	if err := conf.Verify(); err != nil {
		return nil, err
	}
	ln, err := net.Listen(network, address)
	if err != nil && errors.Is(err, syscall.EADDRINUSE) && isUnixPath(network, address) {
		ln, err = listenOverStale(network, address, err, conf.ConnectionWriteTimeout)
	}
	if err != nil {
		return nil, fmt.Errorf("shmipc: listen %s %s: %w", network, address, err)
	}
	if ul, ok := ln.(*net.UnixListener); ok && !strings.HasPrefix(address, "@") {
		if err := os.Chmod(address, conf.SocketFileMode); err != nil {
			ul.Close()
			return nil, fmt.Errorf("shmipc: listen %s %s: %w", network, address, err)
		}
	}
	return NewListener(ln, conf), nil
}

// isUnixPath reports whether address names a Unix socket file (not an
// abstract socket).
func isUnixPath(network, address string) bool {
	return strings.HasPrefix(network, "unix") && address != "" && address[0] != '@'
}

// listenOverStale handles a bind to the socket file address that failed
// with bindErr (EADDRINUSE). If the file is a socket whose server is gone,
// it removes it and binds again; otherwise it returns an error wrapping
// bindErr that says why the file stays.
func listenOverStale(network, address string, bindErr error, timeout time.Duration) (net.Listener, error) {
	fi, err := os.Lstat(address)
	if err != nil {
		return nil, bindErr // gone meanwhile, or unreadable: nothing to take over
	}
	if fi.Mode().Type() != os.ModeSocket {
		return nil, fmt.Errorf("%w (%s is not a socket; left alone)", bindErr, address)
	}
	c, err := net.DialTimeout(network, address, timeout)
	if err == nil {
		c.Close()
		return nil, fmt.Errorf("%w: a live server listens on %s", bindErr, address)
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		return nil, fmt.Errorf("%w (connecting to the socket to see whether it is stale: %w)", bindErr, err)
	}
	// Nobody listens. Remove the file only if it is still the one probed.
	if now, err := os.Lstat(address); err != nil || !os.SameFile(fi, now) {
		return nil, fmt.Errorf("%w (the socket file changed while it was probed)", bindErr)
	}
	if err := os.Remove(address); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("%w (removing the stale socket file: %w)", bindErr, err)
	}
	return net.Listen(network, address)
}

// NewListener serves shmipc on an existing listener, which it takes over.
func NewListener(ln net.Listener, conf *Config) *Listener {
	if conf == nil {
		conf = DefaultConfig()
	}
	l := &Listener{
		ln:       ln,
		conf:     conf,
		closed:   make(chan struct{}),
		done:     make(chan struct{}),
		sessions: make(map[*Session]struct{}),
		pending:  make(map[net.Conn]struct{}),
	}
	l.streams.init()
	go l.acceptLoop()
	return l
}

// Pauses of the accept loop after a failed Accept: the first, and the
// longest (as net/http's Server does).
const (
	minAcceptBackoff = 5 * time.Millisecond
	maxAcceptBackoff = time.Second
)

// acceptLoop accepts connections and serves each on its own goroutine. A
// failed Accept is logged and retried with growing pauses: errors such as
// EMFILE, ENFILE or ECONNABORTED pass. Only a closed listener ends the loop.
func (l *Listener) acceptLoop() {
	defer close(l.done)
	var backoff time.Duration
	for {
		conn, err := l.ln.Accept()
		if err != nil {
			if l.isClosed() {
				return
			}
			if errors.Is(err, net.ErrClosed) {
				l.conf.logger().Warn("shmipc: listening socket closed under the listener; no more sessions are accepted",
					"addr", l.ln.Addr(), "err", err)
				return
			}
			backoff = min(max(2*backoff, minAcceptBackoff), maxAcceptBackoff)
			l.conf.logger().Warn("shmipc: accept failed; retrying", "addr", l.ln.Addr(), "err", err, "retry_in", backoff)
			t := time.NewTimer(backoff)
			select {
			case <-t.C:
				continue
			case <-l.closed:
				t.Stop()
				return
			}
		}
		backoff = 0
		l.mu.Lock()
		if l.isClosed() {
			l.mu.Unlock()
			conn.Close()
			return
		}
		l.pending[conn] = struct{}{}
		l.mu.Unlock()
		go l.serve(conn)
	}
}

// serve runs the handshake of one connection and registers its session.
// A failed handshake closes the connection and nothing else.
func (l *Listener) serve(conn net.Conn) {
	s, err := handshakeServer(conn, l.conf, l.adopt)
	l.mu.Lock()
	delete(l.pending, conn)
	if err == nil {
		if l.isClosed() {
			err = ErrListenerClosed
		} else {
			l.sessions[s] = struct{}{}
		}
	}
	l.mu.Unlock()
	if err != nil {
		l.conf.logger().Warn("shmipc: handshake failed", "remote", conn.RemoteAddr(), "err", err)
		if s != nil {
			s.Close()
		}
	}
}

// adopt makes the listener the home of a session whose handshake is done
// and whose receive loop has not started: its new streams go to the
// listener's queue, and its end is noticed.
func (l *Listener) adopt(s *Session) {
	s.onAccept = l.streams.push
	s.onTeardown = l.forget
}

func (l *Listener) forget(s *Session) {
	l.mu.Lock()
	delete(l.sessions, s)
	l.mu.Unlock()
}

func (l *Listener) isClosed() bool {
	select {
	case <-l.closed:
		return true
	default:
		return false
	}
}

// Accept waits for the next stream opened by any client and returns it as a
// net.Conn (a *Stream).
func (l *Listener) Accept() (net.Conn, error) {
	st, err := l.AcceptStream()
	if err != nil {
		return nil, err
	}
	return st, nil
}

// AcceptStream waits for the next stream opened by any client.
func (l *Listener) AcceptStream() (*Stream, error) {
	return l.streams.pop(l.closed, func() error { return ErrListenerClosed })
}

// Close stops listening, closes every session and waits for the accept loop.
// A Unix socket file created by Listen is removed.
func (l *Listener) Close() error {
	var err error
	l.once.Do(func() {
		l.mu.Lock()
		close(l.closed)
		sessions := make([]*Session, 0, len(l.sessions))
		for s := range l.sessions {
			sessions = append(sessions, s)
		}
		for c := range l.pending {
			c.Close()
		}
		l.mu.Unlock()
		err = l.ln.Close()
		<-l.done
		for _, s := range sessions {
			s.Close()
		}
		l.streams.close()
	})
	return err
}

// Addr returns the listening address.
func (l *Listener) Addr() net.Addr { return l.ln.Addr() }

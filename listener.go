package shmipc

import (
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"slices"
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
	conf, err := verified(conf)
	if err != nil {
		return nil, err
	}
	if conf.MemMapType == MemMapTypeMemFd && !strings.HasPrefix(network, "unix") {
		return nil, fmt.Errorf("%w: memfd regions need a Unix socket, not %q; use MemMapTypeDevShmFile", ErrInvalidConfig, network)
	}
	conn, err := net.DialTimeout(network, address, conf.ConnectionWriteTimeout)
	if err != nil {
		return nil, netError("dial", network, address, err)
	}
	return Client(conn, conf)
}

// Listener accepts sessions on a socket and delivers the streams their
// clients open. It implements net.Listener: Accept returns each new stream
// as a net.Conn (a *Stream). Close and CloseAll say how it stops.
type Listener struct {
	ln       net.Listener
	conf     *Config
	closeErr error // of closing ln; written once, in Close

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
// listener is taken over: when address is a socket that nobody listens on
// (connecting to it is refused), Listen removes it and binds anew. If a
// live server listens there, or the file is not a socket, Listen fails
// with an error wrapping syscall.EADDRINUSE. Two servers started at once
// on the same stale socket may both succeed, the later one replacing the
// earlier's socket file: start one server per address.
func Listen(network, address string, conf *Config) (*Listener, error) {
	conf, err := verified(conf)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen(network, address)
	if errors.Is(err, syscall.EADDRINUSE) && strings.HasPrefix(network, "unix") && address != "" && address[0] != '@' {
		// A socket file (not an abstract socket) in use: stale, maybe.
		ln, err = listenOverStale(network, address, err, conf.ConnectionWriteTimeout)
	}
	if err != nil {
		return nil, netError("listen", network, address, err)
	}
	if ul, ok := ln.(*net.UnixListener); ok && !strings.HasPrefix(address, "@") {
		// Removed on Close only while it is this listener's: a new server
		// may have taken the path over (ListenTakeover).
		if ln, err = ownSocketFile(ul, address, conf.SocketFileMode); err != nil {
			ul.Close()
			return nil, netError("listen", network, address, err)
		}
	}
	return NewListener(ln, conf), nil
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
		return nil, fmt.Errorf("%w (not a socket; left alone)", bindErr) // bindErr names the address
	}
	c, err := net.DialTimeout(network, address, timeout)
	if err == nil {
		c.Close()
		return nil, fmt.Errorf("%w: a live server listens there", bindErr)
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

// Pauses of the accept loop after a failed Accept (as net/http's Server).
const (
	minAcceptBackoff = 5 * time.Millisecond
	maxAcceptBackoff = time.Second
)

// acceptLoop accepts connections and serves each on its own goroutine. A
// failed Accept (EMFILE, ECONNABORTED, ...) is logged and retried with
// growing pauses; only a closed listener ends the loop.
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
		if n := len(l.sessions) + len(l.pending); n >= l.conf.maxSessions() {
			l.mu.Unlock()
			l.conf.logger().Warn("shmipc: connection refused: the listener serves Config.MaxSessions sessions",
				"remote", conn.RemoteAddr(), "sessions", n)
			conn.Close()
			continue
		}
		l.pending[conn] = struct{}{}
		l.mu.Unlock()
		go l.serve(conn)
	}
}

// serve runs the handshake of one connection and registers its session.
// A failed handshake closes the connection and nothing else.
func (l *Listener) serve(conn net.Conn) {
	s, err := handshake(conn, l.conf, false, func(s *Session) { l.adopt(s, conn) })
	l.mu.Lock()
	delete(l.pending, conn)
	closed := l.isClosed()
	l.mu.Unlock()
	if err != nil {
		l.conf.logger().Warn("shmipc: handshake failed", "remote", conn.RemoteAddr(), "err", err)
	} else if closed {
		// Its streams may have been accepted before Close: it ends with
		// its last stream, as Close has it.
		s.retire()
	}
}

// adopt makes the listener the home of a session whose handshake is done and
// whose receive loop has not started: its new streams go to the listener's
// queue, and its end is noticed. It is registered before it can deliver a
// stream, so that every session whose streams were accepted is known
// (CloseAll, hot restart), and conn stops counting as a handshake then.
func (l *Listener) adopt(s *Session, conn net.Conn) {
	s.onAccept = l.streams.push
	s.onTeardown = l.forget
	l.mu.Lock()
	delete(l.pending, conn)
	l.sessions[s] = struct{}{}
	hr := l.restart.Load() // under mu: HotRestart took its sessions or set hr
	joins := false
	if hr != nil {
		_, joins = hr.handshaking[conn]
	}
	l.mu.Unlock()
	// A hot restart begun during the handshake takes the session in, or its
	// client would stay on this server.
	if joins && hr.hook(s) {
		hr.tell(s)
	}
}

func (l *Listener) forget(s *Session) {
	l.mu.Lock()
	delete(l.sessions, s)
	l.mu.Unlock()
}

func (l *Listener) isClosed() bool { return isClosedChan(l.closed) }

// Accept waits for the next stream opened by any client, as a net.Conn.
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

// Close stops accepting, as a net.Listener's Close does: the established
// connections, here the streams already accepted, live on.
//
//   - The listening socket is closed; a Unix socket file created by Listen
//     is removed, unless a new server took the path over (ListenTakeover)
//     or a hot restart handed it on. Connections in their handshake are
//     dropped.
//   - Accept and AcceptStream fail with ErrListenerClosed. Streams not yet
//     accepted are closed, and so is every stream a client opens after
//     Close: the client reads io.EOF on it.
//   - Streams already accepted keep working until one side closes them.
//     Each session ends once its last stream is closed (at once if it has
//     none).
//
// So a server that stops gracefully closes the listener and lets its
// handlers finish; its sessions end by themselves. A SessionManager client
// moves to a new session on the first stream it finds refused; a client
// that holds streams open for good keeps its session, and the server's
// handlers, alive: bound the wait and call CloseAll, which ends them at
// once. Close returns once the accept loop has stopped and the sessions
// with no stream left have ended; it may be called more than once, and
// returns the error of closing the listening socket.
func (l *Listener) Close() error {
	l.stopAccepting()
	for _, s := range l.liveSessions() {
		if s.retire() || s.IsClosed() {
			<-s.loopDone // ended or ending: let it finish, as CloseAll does
		}
	}
	return l.closeErr
}

// CloseAll closes the listener as Close does and also closes every session
// it accepted, at once, without waiting for their streams: reads and writes
// on those streams then fail with an error wrapping ErrSessionClosed (here)
// or ErrPeerClosed (in the client). It returns once the sessions' receive
// loops have stopped, and may follow Close to end the sessions it left open.
func (l *Listener) CloseAll() error {
	l.stopAccepting()
	for _, s := range l.liveSessions() {
		s.Close()
	}
	return l.closeErr
}

// stopAccepting closes the listening socket, drops connections in their
// handshake, waits for the accept loop and closes the accept queue, once.
func (l *Listener) stopAccepting() {
	l.once.Do(func() {
		l.mu.Lock()
		close(l.closed)
		for c := range l.pending {
			c.Close()
		}
		l.mu.Unlock()
		l.closeErr = l.ln.Close()
		<-l.done
		l.streams.close()
	})
}

// liveSessions returns the sessions of the listener that have not ended.
func (l *Listener) liveSessions() []*Session {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Collect(maps.Keys(l.sessions))
}

// retire makes the session end once it has no open stream, now if it has
// none; it reports whether it closed it now. The closed listener's queue
// closes new streams as they arrive, so the count only goes down.
func (s *Session) retire() bool {
	s.mu.Lock()
	s.retiring = true
	idle := len(s.streams) == 0
	s.mu.Unlock()
	if idle {
		s.closeWithError(nil)
	}
	return idle
}

// Addr returns the listening address.
func (l *Listener) Addr() net.Addr { return l.ln.Addr() }

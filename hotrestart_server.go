package shmipc

// Hot restart (docs/protocol.md §10): a new server process takes over the socket
// path of a running one, the old server tells its clients with a HotRestart
// frame, and session managers move to the new server and acknowledge.
//
// Server side, in the order an application runs it:
//
//	// new server process
//	ln2, err := shmipc.ListenTakeover(sockPath, conf) // now answers on sockPath
//	// ... tell the old server (out of band: admin socket, signal, ...) ...
//
//	// old server process
//	if err := ln1.HotRestart(epoch); err != nil { ... retry later ... }
//	err := ln1.WaitHotRestart(ctx) // nil once every session acknowledged
//	ln1.Close()                    // leaves sockPath to the new server
//
// Close lets the requests in progress finish (CloseAll does not).
//
// Client side (hotrestart_client.go): a SessionManager reacts to HotRestart
// on its own. A plain Session (Dial, Client) ignores it and ends when the
// old server closes it.

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/goshm/shmipc/internal/wire"
	"golang.org/x/sys/unix"
)

// hotRestartTimeout bounds a hot restart on both sides (docs/protocol.md §10):
// the old server's wait for the acknowledgements, and a client's for its
// old sessions to become idle.
const hotRestartTimeout = 2 * time.Second

// hotRestartPoll is how often the server checks for the acknowledgements.
const hotRestartPoll = 100 * time.Millisecond

// srvHotRestart is one hot restart of a listener.
type srvHotRestart struct {
	epoch uint64
	start time.Time

	mu      sync.Mutex
	waiting map[*Session]struct{}      // sessions that have not acknowledged
	hooked  map[*Session]*func(uint64) // every session's hook
	over    bool                       // finish ran: no session joins any more
	// handshaking are the connections in their handshake when the restart
	// began, whose sessions join it. Written before it is published.
	handshaking map[net.Conn]struct{}

	done chan struct{}
	err  error // written before done is closed
}

func (hr *srvHotRestart) finished() bool { return isClosedChan(hr.done) }

// HotRestart starts a hot restart with the given epoch: it sends a
// HotRestart frame to every session of the listener (docs/protocol.md §10)
// and counts the HotRestartAck frames that come back with the same epoch.
// It returns once the frames are sent; WaitHotRestart waits for the
// acknowledgements (at most 2 s from now).
//
// It fails with ErrHotRestartRunning while a previous restart is still
// running, and with ErrListenerClosed after Close. Sessions still in their
// handshake are told as they start, and waited for; sessions that end
// during the restart are not waited for, and connections accepted after
// the call are not part of it.
//
// Call it once the new server answers on the socket path (ListenTakeover).
// From then on Close does not remove the listener's Unix socket file.
func (l *Listener) HotRestart(epoch uint64) error {
	l.mu.Lock()
	if l.isClosed() {
		l.mu.Unlock()
		return ErrListenerClosed
	}
	if prev := l.restart.Load(); prev != nil && !prev.finished() {
		l.mu.Unlock()
		return fmt.Errorf("%w (epoch %d)", ErrHotRestartRunning, prev.epoch)
	}
	hr := &srvHotRestart{
		epoch:   epoch,
		start:   time.Now(),
		waiting: make(map[*Session]struct{}, len(l.sessions)),
		hooked:  make(map[*Session]*func(uint64), len(l.sessions)),
		done:    make(chan struct{}),

		handshaking: maps.Clone(l.pending),
	}
	sessions := slices.Collect(maps.Keys(l.sessions))
	if l.restart.Swap(hr) == nil {
		go func() { // forget the restart once the listener is closed
			<-l.done
			l.restart.Store(nil)
		}()
	}
	l.mu.Unlock()

	// The socket path now belongs to the new server.
	switch ln := l.ln.(type) {
	case *pathListener:
		ln.keep.Store(true)
	case *net.UnixListener:
		ln.SetUnlinkOnClose(false)
	}

	// Hooks first, so that no acknowledgement can be missed.
	for _, s := range sessions {
		hr.hook(s)
	}
	for _, s := range sessions {
		hr.tell(s)
	}
	go hr.monitor(l)
	return nil
}

// hook makes the restart wait for s's acknowledgement, unless s has ended
// or the restart is over.
func (hr *srvHotRestart) hook(s *Session) bool {
	hr.mu.Lock()
	defer hr.mu.Unlock()
	if s.IsClosed() || hr.over {
		return false
	}
	f := func(epoch uint64) { // a HotRestartAck frame received on s
		if epoch == hr.epoch {
			hr.mu.Lock()
			delete(hr.waiting, s)
			hr.mu.Unlock()
		}
	}
	s.onHotRestartAck.Store(&f)
	hr.waiting[s] = struct{}{}
	hr.hooked[s] = &f
	return true
}

// tell sends s the restart's HotRestart frame.
func (hr *srvHotRestart) tell(s *Session) {
	if s.IsClosed() {
		return
	}
	frame := wire.AppendHotRestart(nil, s.version, wire.TypeHotRestart, hr.epoch)
	if err := s.ec.write(frame); err != nil {
		_ = s.sendFailed("send HotRestart", err)
	}
}

// monitor checks every hotRestartPoll whether every session acknowledged,
// until hotRestartTimeout has passed.
func (hr *srvHotRestart) monitor(l *Listener) {
	deadline := hr.start.Add(hotRestartTimeout)
	tick := time.NewTicker(hotRestartPoll)
	defer tick.Stop()
	for {
		select {
		case <-tick.C:
		case <-l.closed:
			hr.finish(ErrListenerClosed)
			return
		}
		hr.mu.Lock()
		for s := range hr.waiting {
			if s.IsClosed() {
				delete(hr.waiting, s)
			}
		}
		left, total := len(hr.waiting), len(hr.hooked)
		hr.mu.Unlock()
		if left == 0 {
			hr.finish(nil)
			return
		}
		if !time.Now().Before(deadline) {
			hr.finish(fmt.Errorf("%w: %d of %d sessions did not acknowledge epoch %d within %v",
				ErrHotRestartTimeout, left, total, hr.epoch, hotRestartTimeout))
			return
		}
	}
}

// finish ends the restart: the hooks are removed and waiters released.
func (hr *srvHotRestart) finish(err error) {
	hr.mu.Lock()
	hr.over = true
	for s, f := range hr.hooked {
		s.onHotRestartAck.CompareAndSwap(f, nil)
	}
	hr.mu.Unlock()
	hr.err = err
	close(hr.done)
}

// WaitHotRestart waits for the hot restart started by HotRestart to finish.
// It returns nil once every session acknowledged, an error wrapping
// ErrHotRestartTimeout if some did not within 2 s (the restart is then over
// and the sessions stay up), ErrListenerClosed if the listener was closed
// first, or ctx's error.
func (l *Listener) WaitHotRestart(ctx context.Context) error {
	hr := l.restart.Load()
	if hr == nil {
		return ErrNoHotRestart
	}
	select {
	case <-hr.done:
		return hr.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// ListenTakeover listens on the Unix socket path address like Listen("unix",
// address, conf), except that a socket already bound there (the old server
// of a hot restart) is replaced atomically: the new socket is bound under a
// temporary name in the same directory and renamed over address, so a client
// finds the old or the new server, never none, and no listener fd travels
// between the processes. Connections made before still reach the old server.
// Abstract addresses ("@...") cannot be taken over. Close removes the socket
// file only if it is still this listener's.
func ListenTakeover(address string, conf *Config) (*Listener, error) {
	conf, err := verified(conf)
	if err != nil {
		return nil, err
	}
	if address == "" || address[0] == '@' {
		return nil, fmt.Errorf("%w: ListenTakeover needs a socket file path, not %q", ErrInvalidConfig, address)
	}
	fail := func(err error) (*Listener, error) {
		return nil, fmt.Errorf("shmipc: listen (takeover) unix %s: %w", address, err)
	}
	tmp := filepath.Join(filepath.Dir(address), fmt.Sprintf(".shmipc-tk-%016x", rand.Uint64()))
	ul, err := listenUnixAt(tmp)
	if err != nil {
		return fail(err)
	}
	pl, err := ownSocketFile(ul, tmp, conf.SocketFileMode)
	if err == nil {
		err = os.Rename(tmp, address)
	}
	if err != nil {
		ul.Close()
		os.Remove(tmp)
		return fail(err)
	}
	pl.path = address
	return NewListener(pl, conf), nil
}

// listenUnixAt listens on a new Unix socket file at path, which the caller
// removes. A path too long for a socket address (108 bytes with its NUL) is
// bound through /proc/self/fd and a descriptor of its directory.
func listenUnixAt(path string) (*net.UnixListener, error) {
	name := path
	if len(path) >= len(syscall.RawSockaddrUnix{}.Path) {
		dir, err := os.OpenFile(filepath.Dir(path), os.O_RDONLY|unix.O_DIRECTORY|unix.O_PATH, 0)
		if err != nil {
			return nil, err
		}
		defer dir.Close()
		name = fmt.Sprintf("/proc/self/fd/%d/%s", dir.Fd(), filepath.Base(path))
	}
	ul, err := net.ListenUnix("unix", &net.UnixAddr{Name: name, Net: "unix"})
	if err != nil {
		return nil, err
	}
	ul.SetUnlinkOnClose(false)
	return ul, nil
}

// pathListener is a Unix listener on a socket file that it removes on
// Close only while the file is still its own socket: a server that has
// taken the path over since (ListenTakeover) keeps its socket, and so does
// one that HotRestart handed the path to (keep).
type pathListener struct {
	*net.UnixListener
	path     string // as given; Addr reports it
	dev, ino uint64
	keep     atomic.Bool
}

// ownSocketFile sets the mode of the socket file at path, on which ul
// listens, and wraps ul in a pathListener.
func ownSocketFile(ul *net.UnixListener, path string, mode os.FileMode) (*pathListener, error) {
	if err := os.Chmod(path, mode); err != nil {
		return nil, err
	}
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return nil, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	ul.SetUnlinkOnClose(false)
	return &pathListener{UnixListener: ul, path: path, dev: uint64(st.Dev), ino: uint64(st.Ino)}, nil
}

func (p *pathListener) Addr() net.Addr { return &net.UnixAddr{Name: p.path, Net: "unix"} }

func (p *pathListener) Close() error {
	var st syscall.Stat_t
	if !p.keep.Load() && syscall.Stat(p.path, &st) == nil && uint64(st.Dev) == p.dev && uint64(st.Ino) == p.ino {
		os.Remove(p.path)
	}
	return p.UnixListener.Close()
}

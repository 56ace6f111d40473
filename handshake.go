package shmipc

import (
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"runtime/debug"
	"time"

	"github.com/goshm/shmipc/internal/shm"
	"github.com/goshm/shmipc/internal/wire"
)

// Client runs the client side of the handshake on conn (a *net.UnixConn, or
// a *net.TCPConn in file mode): it creates the session's regions, hands them
// to the server, and returns the running session. A nil conf means
// DefaultConfig(). On error conn is closed and everything created released.
func Client(conn net.Conn, conf *Config) (*Session, error) {
	return handshake(conn, conf, true, nil)
}

// Server runs the server side of the handshake on conn: it maps the regions
// the client created and returns the running session. Streams the client
// opens arrive through AcceptStream. A client whose user id is not in
// conf.AllowedPeerUIDs (when that is set) is refused. On error conn is closed.
func Server(conn net.Conn, conf *Config) (*Session, error) {
	return handshake(conn, conf, false, nil)
}

// handshake runs the client or server handshake on conn; setup, if not nil,
// configures the session before its receive loop starts.
func handshake(conn net.Conn, conf *Config, client bool, setup func(*Session)) (*Session, error) {
	conf, err := verified(conf)
	if err != nil {
		conn.Close()
		return nil, err
	}
	if !client {
		if err := checkPeer(conn, conf.AllowedPeerUIDs); err != nil {
			conn.Close()
			return nil, fmt.Errorf("%w (server): %w", ErrHandshake, err)
		}
	}
	s := newSession(conn, conf, client)
	if err := conn.SetDeadline(time.Now().Add(conf.InitializeTimeout)); err != nil {
		conn.Close()
		return nil, fmt.Errorf("%w: %w", ErrHandshake, err)
	}
	err = s.runHandshake(client)
	if err == nil {
		err = s.ec.clearDeadlines()
	}
	if err != nil {
		conn.Close()
		s.releaseRegions()
		if isTimeout(err) {
			err = fmt.Errorf("%w after %v: %w", ErrTimeout, conf.InitializeTimeout, err)
		}
		return nil, fmt.Errorf("%w (%s): %w", ErrHandshake, s.role(), err)
	}
	if setup != nil {
		setup(s)
	}
	s.start()
	return s, nil
}

// runHandshake runs one side of the handshake. A peer can shrink a region
// while the server maps and reads it: faults become errors.
func (s *Session) runHandshake(client bool) (err error) {
	old := debug.SetPanicOnFault(true)
	defer func() {
		debug.SetPanicOnFault(old)
		if r := recover(); r != nil {
			err = fmt.Errorf("during the handshake: %w", shm.FaultError(r))
		}
	}()
	if client {
		return s.clientHandshake()
	}
	return s.serverHandshake()
}

// isTimeout reports whether err, or an error it wraps, is a timeout. It
// walks the chain as errors.As does, by hand: errors.As would allocate.
func isTimeout(err error) bool {
	if t, ok := err.(interface{ Timeout() bool }); ok && t.Timeout() {
		return true
	}
	switch u := err.(type) {
	case interface{ Unwrap() error }:
		return isTimeout(u.Unwrap())
	case interface{ Unwrap() []error }:
		for _, e := range u.Unwrap() {
			if isTimeout(e) {
				return true
			}
		}
	}
	return false
}

// clientHandshake creates the regions and runs docs/protocol.md §4.1 (file mode,
// version 2) or §4.2 (memfd, version 3).
func (s *Session) clientHandshake() error {
	conf := s.conf
	memfd := conf.MemMapType == MemMapTypeMemFd
	if memfd && s.ec.unix == nil {
		return fmt.Errorf("memfd regions need a Unix socket, not %T; use MemMapTypeDevShmFile over TCP", s.ec.conn)
	}
	if memfd {
		if err := s.exchangeVersion(); err != nil {
			return err
		}
	}
	queuePath, err := s.clientBuffer()
	if err != nil {
		return err
	}
	bufPath, bufFd := s.buf.Region().Path(), s.buf.Region().Fd()
	queueRegion, queueFd, err := shm.CreateRegion(memfd, queuePath, shm.QueueRegionSize(conf.QueueCap), uint32(conf.ShareMemoryFileMode))
	if err != nil {
		return err
	}
	defer shm.CloseFds(queueFd)
	s.queueRegion = queueRegion
	shm.InitQueues(queueRegion.Mem(), conf.QueueCap)
	if s.sendQ, s.recvQ, err = shm.MapQueues(queueRegion.Mem()); err != nil {
		return err
	}

	typ := wire.TypeShareMemoryByMemfd
	if !memfd {
		s.version, typ = wire.VersionFilePath, wire.TypeShareMemoryByFilePath
	}
	frame, err := wire.AppendPaths(nil, s.version, typ, queuePath, bufPath)
	if err == nil {
		err = s.ec.write(frame)
	}
	if err != nil || !memfd {
		return err // file mode is not acknowledged
	}
	// The regions go to whoever sends the acknowledgement: it must be the
	// process that answered the version exchange, for which the buffer
	// region was chosen.
	if s.serverPid != 0 {
		sender, err := s.ec.peekSender()
		if err != nil {
			return fmt.Errorf("waiting for %v: %w", wire.TypeAckReadyRecvFD, err)
		}
		if sender != s.serverPid {
			return fmt.Errorf("%v sent by process %d, the version exchange by process %d", wire.TypeAckReadyRecvFD, sender, s.serverPid)
		}
	}
	if err := s.ec.passCred(false); err != nil && s.serverPid != 0 {
		return err
	}
	if _, err := s.expect(wire.TypeAckReadyRecvFD); err != nil {
		return err
	}
	if err := s.ec.sendFds(bufFd, queueFd); err != nil {
		return fmt.Errorf("send region fds: %w", err)
	}
	_, err = s.expect(wire.TypeAckShareMemory)
	return err
}

// exchangeVersion sends the client's ExchangeProtoVersion frame, reads the
// server's and learns which process answered (s.serverPid, from the
// sender's credentials: peercred_linux.go).
func (s *Session) exchangeVersion() error {
	// Without credentials the server process stays unknown, and the
	// session gets a region of its own.
	creds := s.ec.passCred(true) == nil
	if err := s.ec.writeEvent(wire.MaxVersion, wire.TypeExchangeProtoVersion); err != nil {
		return err
	}
	if creds {
		sender, err := s.ec.peekSender()
		if err != nil {
			return fmt.Errorf("waiting for %v: %w", wire.TypeExchangeProtoVersion, err)
		}
		s.serverPid = sender
	}
	h, err := s.expect(wire.TypeExchangeProtoVersion)
	if err != nil {
		return err
	}
	if v := min(wire.MaxVersion, h.Version()); v != wire.VersionMemfd {
		return fmt.Errorf("server speaks protocol version %d; memfd regions need version %d", h.Version(), wire.VersionMemfd)
	}
	s.version = wire.VersionMemfd
	return nil
}

// clientBuffer gives a client session its buffer region, s.buf, and names
// its queue region, queuePath: a region shared with the process's other
// sessions to the same server (region_pool.go), or a new one of its own.
func (s *Session) clientBuffer() (queuePath string, err error) {
	conf := s.conf
	if key, ok := poolKeyFor(conf, s.serverPid); ok {
		if s.buf, queuePath, err = sharedBuffer(conf, key); err != nil {
			return "", err
		}
		s.buf.AddSession(1)
		return queuePath, nil
	}
	prefix := newRegionPrefix(conf)
	if conf.MemMapType == MemMapTypeDevShmFile {
		need := uint64(conf.ShareMemoryBufferCap) + uint64(shm.QueueRegionSize(conf.QueueCap))
		if err := shm.CheckFreeSpace(filepath.Dir(prefix), need); err != nil {
			return "", err
		}
	}
	if s.buf, err = createBuffer(conf, prefix+"_buffer"); err != nil {
		return "", err
	}
	s.buf.AddSession(1)
	return prefix + "_queue_0", nil
}

// expect reads the next handshake frame, which must be an 8-byte t frame.
func (s *Session) expect(t wire.Type) (wire.Header, error) {
	h, err := s.ec.readHeader()
	if err != nil {
		return nil, fmt.Errorf("waiting for %v: %w", t, err)
	}
	if h.Type() != t {
		return nil, fmt.Errorf("got %v, want %v", h.Type(), t)
	}
	if _, err := frameLength(h, 0); err != nil {
		return nil, err
	}
	return h, nil
}

// serverHandshake answers the client's handshake and maps its regions. The
// version byte of the first header decides the version (docs/protocol.md §2.2).
func (s *Session) serverHandshake() error {
	h, err := s.ec.readHeader()
	if err != nil {
		return err
	}
	switch h.Version() {
	case wire.VersionFilePath:
		if h.Type() != wire.TypeShareMemoryByFilePath {
			return fmt.Errorf("version 2 handshake starts with %v, want %v", h.Type(), wire.TypeShareMemoryByFilePath)
		}
		s.version = wire.VersionFilePath
		return s.mapFromPaths(h)
	case wire.VersionMemfd:
		if h.Type() != wire.TypeExchangeProtoVersion {
			return fmt.Errorf("version 3 handshake starts with %v, want %v", h.Type(), wire.TypeExchangeProtoVersion)
		}
		if _, err := frameLength(h, 0); err != nil {
			return err
		}
		s.version = wire.VersionMemfd
		if err := s.ec.writeEvent(wire.MaxVersion, wire.TypeExchangeProtoVersion); err != nil {
			return err
		}
		h, err := s.ec.readHeader()
		if err != nil {
			return err
		}
		switch h.Type() {
		case wire.TypeShareMemoryByMemfd:
			err = s.mapFromFds(h)
		case wire.TypeShareMemoryByFilePath:
			err = s.mapFromPaths(h)
		default:
			return fmt.Errorf("got %v after the version exchange, want %v or %v", h.Type(), wire.TypeShareMemoryByMemfd, wire.TypeShareMemoryByFilePath)
		}
		if err != nil {
			return err
		}
		return s.ec.writeEvent(s.version, wire.TypeAckShareMemory)
	default:
		return fmt.Errorf("%w %d in the first header (type %v)", wire.ErrBadVersion, h.Version(), h.Type())
	}
}

// readPaths reads the payload of a path message.
func (s *Session) readPaths(h wire.Header) (queuePath, bufPath string, err error) {
	n, err := frameLength(h, 0)
	if err != nil {
		return "", "", err
	}
	payload, err := s.ec.readExact(n - wire.HeaderSize)
	if err != nil {
		return "", "", err
	}
	return wire.DecodePaths(payload)
}

// mapFromPaths opens and maps the region files a client named. The client
// may name only files it owns (shm.OpenRegionFile), so the server must learn
// the client's user id; if it cannot, file mode is refused.
func (s *Session) mapFromPaths(h wire.Header) error {
	queuePath, bufPath, err := s.readPaths(h)
	if err != nil {
		return err
	}
	if s.conf.RequireSealedMemory {
		return errors.New("file-mode regions cannot be sealed and RequireSealedMemory is set")
	}
	peer, err := peerOf(s.ec.conn)
	if err != nil {
		return fmt.Errorf("file-mode regions need the client's user id: %w", err)
	}
	dir := filepath.Dir(s.conf.ShareMemoryPathPrefix)
	bufFd, err := shm.OpenRegionFile(bufPath, dir, peer.uid)
	if err != nil {
		return err
	}
	defer shm.CloseFds(bufFd)
	queueFd, err := shm.OpenRegionFile(queuePath, dir, peer.uid)
	if err != nil {
		return err
	}
	defer shm.CloseFds(queueFd)
	return s.mapRegions(queuePath, bufPath, queueFd, bufFd, peer, true)
}

// mapFromFds receives the memfds after AckReadyRecvFD and maps them.
func (s *Session) mapFromFds(h wire.Header) error {
	queuePath, bufPath, err := s.readPaths(h)
	if err != nil {
		return err
	}
	if err := s.ec.writeEvent(s.version, wire.TypeAckReadyRecvFD); err != nil {
		return err
	}
	fds, err := s.ec.recvFds(2)
	if err != nil {
		return fmt.Errorf("receive region fds: %w", err)
	}
	defer shm.CloseFds(fds...)
	peer, err := peerOf(s.ec.conn)
	if err != nil {
		return fmt.Errorf("memfd regions: %w", err)
	}
	if s.conf.RequireSealedMemory {
		for i, fd := range fds {
			if err := shm.CheckSealed(fd); err != nil {
				return fmt.Errorf("region fd %d of 2: %w", i+1, err)
			}
		}
	}
	return s.mapRegions(queuePath, bufPath, fds[1], fds[0], peer, false)
}

// Size bounds for regions a client hands to a server.
const (
	minPeerBufferSize = shm.BufferHeaderSize + shm.ListHeaderSize + shm.SliceHeaderSize + 4
	maxPeerBufferSize = 1<<32 - 1
)

// mapRegions maps the client's regions. In file mode the server removes
// the files when done with them, as the other implementations do.
func (s *Session) mapRegions(queuePath, bufPath string, queueFd, bufFd int, peer peerID, files bool) error {
	var err error
	if s.buf, err = mapServerBuffer(bufPath, bufFd, files, peer); err != nil {
		return err
	}
	s.buf.AddSession(1)
	q, err := shm.MapRegion(queueFd, queuePath, int64(shm.QueueRegionSize(16)), int64(shm.QueueRegionSize(shm.MaxQueueCap)))
	if err != nil {
		return err
	}
	if files {
		q.RemoveOnRelease()
	}
	s.queueRegion = q
	if s.recvQ, s.sendQ, err = shm.MapQueues(q.Mem()); err != nil {
		return fmt.Errorf("queue region %s: %w", queuePath, err)
	}
	return nil
}

// releaseRegions drops the session's references on its regions.
func (s *Session) releaseRegions() {
	if s.buf != nil {
		s.buf.AddSession(-1)
		s.buf.Region().Release()
	}
	if s.queueRegion != nil {
		s.queueRegion.Release()
	}
}

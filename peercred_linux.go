package shmipc

import (
	"bufio"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// peerID is who is at the other end of a session's socket, as the kernel
// reports it: it decides which region files a client may name and which
// cached mappings it may share.
type peerID struct {
	uid uint32
	// pid is 0 when unknown (over TCP, or in a pid namespace this process
	// cannot see); such a peer never shares a cached mapping.
	pid int32
}

func (p peerID) String() string {
	if p.pid == 0 {
		return fmt.Sprintf("uid %d", p.uid)
	}
	return fmt.Sprintf("uid %d (pid %d)", p.uid, p.pid)
}

// errNoPeerID is wrapped by the error for a connection whose peer's user id
// cannot be established; file-mode regions are then refused.
var errNoPeerID = errors.New("cannot establish the peer's user id")

// peerCredentialer is implemented by connections that know their peer
// without asking the kernel (test connections that are not sockets).
type peerCredentialer interface {
	peerCredentials() (peerID, error)
}

// peerOf returns the identity of conn's peer: SO_PEERCRED over a Unix
// socket (the credentials of the process that connected), the owner of the
// peer's socket in /proc/net/tcp{,6} over TCP loopback (no pid).
func peerOf(conn net.Conn) (peerID, error) {
	switch c := conn.(type) {
	case *net.UnixConn:
		return unixPeer(c)
	case *net.TCPConn:
		local, lok := c.LocalAddr().(*net.TCPAddr)
		remote, rok := c.RemoteAddr().(*net.TCPAddr)
		if !lok || !rok {
			return peerID{}, fmt.Errorf("%w: TCP connection without TCP addresses", errNoPeerID)
		}
		return tcpPeer(local, remote)
	case peerCredentialer:
		return c.peerCredentials()
	}
	return peerID{}, fmt.Errorf("%w: a %T carries no peer credentials", errNoPeerID, conn)
}

// unixPeer reads SO_PEERCRED of a Unix socket.
func unixPeer(c *net.UnixConn) (peerID, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return peerID{}, fmt.Errorf("%w: %w", errNoPeerID, err)
	}
	var cred *unix.Ucred
	var credErr error
	if err := raw.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return peerID{}, fmt.Errorf("%w: %w", errNoPeerID, err)
	}
	if credErr != nil {
		return peerID{}, fmt.Errorf("%w: SO_PEERCRED: %w", errNoPeerID, credErr)
	}
	return peerID{uid: cred.Uid, pid: cred.Pid}, nil
}

// procNetTCP are the kernel's tables of this network namespace's TCP
// sockets. A peer on an IPv4-mapped IPv6 socket is in the second.
var procNetTCP = []string{"/proc/net/tcp", "/proc/net/tcp6"}

// tcpStateTimeWait and tcpStateNewSynRecv are the states (the st column)
// of table rows that stand for no full socket; their uid column reads 0.
const (
	tcpStateTimeWait   = 0x06
	tcpStateNewSynRecv = 0x0C
)

// tcpPeer finds the owner of the peer's end of a TCP connection: the uid
// column of the row of /proc/net/tcp{,6} whose local address is remote and
// whose remote address is local. Only a peer in this network namespace (as
// loopback implies) has such a row.
func tcpPeer(local, remote *net.TCPAddr) (peerID, error) {
	for _, table := range procNetTCP {
		uid, found, err := scanTCPTable(table, remote, local)
		if err != nil {
			return peerID{}, fmt.Errorf("%w: %w", errNoPeerID, err)
		}
		if found {
			return peerID{uid: uid}, nil
		}
	}
	return peerID{}, fmt.Errorf("%w: no socket %v connected to %v in %s (is the peer on this host, in this network namespace?)",
		errNoPeerID, remote, local, strings.Join(procNetTCP, " or "))
}

// scanTCPTable looks in one table for the socket at addr connected to
// peer. A missing table (no IPv6) is not an error.
func scanTCPTable(table string, addr, peer *net.TCPAddr) (uid uint32, found bool, err error) {
	f, err := os.Open(table)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// sl local_address rem_address st tx:rx tr:when retrnsmt uid ...
		fields := strings.Fields(sc.Text())
		if len(fields) < 8 || fields[0] == "sl" {
			continue
		}
		st, err := strconv.ParseUint(fields[3], 16, 8)
		if err != nil || st == tcpStateTimeWait || st == tcpStateNewSynRecv {
			continue
		}
		if !procAddrIs(fields[1], addr) || !procAddrIs(fields[2], peer) {
			continue
		}
		u, err := strconv.ParseUint(fields[7], 10, 32)
		if err != nil {
			return 0, false, fmt.Errorf("%s: uid column %q: %w", table, fields[7], err)
		}
		return uint32(u), true, nil
	}
	if err := sc.Err(); err != nil {
		return 0, false, fmt.Errorf("read %s: %w", table, err)
	}
	return 0, false, nil
}

// procAddrIs reports whether s, an address column of /proc/net/tcp{,6}
// ("0100007F:1F90"), is a. The kernel prints the address as 32-bit words in
// the machine's byte order, 8 hex digits each, then the port. IPv4 and
// IPv4-mapped IPv6 addresses compare equal.
func procAddrIs(s string, a *net.TCPAddr) bool {
	hexIP, hexPort, ok := strings.Cut(s, ":")
	if !ok {
		return false
	}
	port, err := strconv.ParseUint(hexPort, 16, 16)
	if err != nil || int(port) != a.Port {
		return false
	}
	words, err := hex.DecodeString(hexIP)
	if err != nil || (len(words) != net.IPv4len && len(words) != net.IPv6len) {
		return false
	}
	ip := make(net.IP, len(words))
	for i := 0; i < len(words); i += 4 {
		binary.NativeEndian.PutUint32(ip[i:], binary.BigEndian.Uint32(words[i:]))
	}
	return ip.Equal(a.IP)
}

// Which process answers a client: SO_PEERCRED names the process that
// called listen(2), not the one that serves the connection (socket
// activation, servers that fork workers). A client that shares a buffer
// region among its sessions to one server process (region_pool.go) needs
// the latter. With SO_PASSCRED on, the kernel attaches to every message the
// credentials of its sender, which it cannot forge; the client peeks at
// them on the server's handshake replies (clientHandshake).

// passCred turns SO_PASSCRED on or off on c's socket.
func (c *eventConn) passCred(on bool) error {
	if c.unix == nil || c.raw == nil {
		return errors.New("sender credentials need a Unix socket")
	}
	v := 0
	if on {
		v = 1
	}
	var err error
	if cerr := c.raw.Control(func(fd uintptr) {
		err = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PASSCRED, v)
	}); cerr != nil {
		return cerr
	}
	if err != nil {
		return os.NewSyscallError("setsockopt SO_PASSCRED", err)
	}
	return nil
}

// peekSender waits, with the connection's read deadline, until the socket
// holds data, and returns the pid of the sender of its first byte without
// consuming anything: 0 when no credentials were attached (SO_PASSCRED was
// off) or the sender's pid namespace is not visible. At the end of the
// stream it returns io.EOF.
func (c *eventConn) peekSender() (int32, error) {
	if c.raw == nil {
		return 0, errors.New("sender credentials need a Unix socket")
	}
	var (
		b       [1]byte
		oob     = make([]byte, unix.CmsgSpace(unix.SizeofUcred))
		n, oobn int
		recvErr error
	)
	err := c.raw.Read(func(fd uintptr) bool {
		for {
			// The control buffer has room for credentials only: were the
			// peer to attach descriptors, the kernel would not install them.
			n, oobn, _, _, recvErr = unix.Recvmsg(int(fd), b[:], oob, unix.MSG_PEEK)
			switch recvErr {
			case unix.EINTR:
				continue
			case unix.EAGAIN:
				return false
			}
			return true
		}
	})
	if err != nil {
		return 0, err
	}
	if recvErr != nil {
		return 0, os.NewSyscallError("recvmsg", recvErr)
	}
	if n == 0 {
		return 0, io.EOF
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil {
		return 0, nil
	}
	for i := range msgs {
		if cred, err := unix.ParseUnixCredentials(&msgs[i]); err == nil {
			return cred.Pid, nil
		}
	}
	return 0, nil
}

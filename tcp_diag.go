package shmipc

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// What the kernel knows of the peer's end of a TCP loopback connection,
// asked through sock_diag (NETLINK_SOCK_DIAG, one inet_diag_req_v2 naming
// the connection's exact addresses). Used to order stream closes over TCP
// (tcp_order.go). Everything here comes from the kernel, not the peer.

// tcpWritten is one answer about the peer's socket.
type tcpWritten struct {
	acked  uint64 // tcpi_bytes_acked: bytes this side has acknowledged
	wqueue uint32 // idiag_wqueue: write_seq - snd_una, written but not acknowledged
	state  uint8  // the TCP state of the peer's socket
}

// total is every byte the peer's application has written on the socket.
func (w tcpWritten) total() uint64 { return w.acked + uint64(w.wqueue) }

// Layout of the messages (linux/netlink.h, linux/inet_diag.h).
const (
	diagReqSize   = 56 // struct inet_diag_req_v2
	diagMsgSize   = 72 // struct inet_diag_msg
	diagInfoAttr  = 2  // INET_DIAG_INFO: struct tcp_info
	diagNoCookie  = ^uint32(0)
	diagReplySize = 4096
)

// The TCP states of a socket whose application may still have written bytes
// this side has not read: ESTABLISHED, FIN_WAIT1, FIN_WAIT2, CLOSE_WAIT,
// LAST_ACK and CLOSING (the numbers of include/net/tcp_states.h).
const tcpLiveStates = 1<<1 | 1<<4 | 1<<5 | 1<<8 | 1<<9 | 1<<11

// diagSock is the process's sock_diag socket, opened on first use and kept;
// the lock keeps one request and its answer together.
var diagSock struct {
	sync.Mutex
	fd  int
	seq uint32
	buf []byte
}

// queryPeerSocket asks the kernel about the socket at remote connected to
// local: the peer's end of this side's connection local→remote.
func queryPeerSocket(local, remote *net.TCPAddr) (tcpWritten, error) {
	var err error
	for _, family := range []uint8{unix.AF_INET, unix.AF_INET6} {
		src, dst, ok := diagAddrs(family, remote.IP, local.IP)
		if !ok {
			continue
		}
		var w tcpWritten
		w, err = diagQuery(family, src, dst, uint16(remote.Port), uint16(local.Port), remote.IP, local.IP)
		if err == nil || !errors.Is(err, unix.ENOENT) {
			return w, err
		}
	}
	return tcpWritten{}, fmt.Errorf("sock_diag: no socket %v connected to %v in this network namespace: %w", remote, local, err)
}

// diagAddrs gives the addresses of a request for family: IPv4 in the
// first four bytes; a socket of the other family may hold the same
// connection as IPv4-mapped IPv6.
func diagAddrs(family uint8, src, dst net.IP) (s, d [16]byte, ok bool) {
	form := net.IP.To16
	if family == unix.AF_INET {
		form = net.IP.To4
	}
	sf, df := form(src), form(dst)
	if sf == nil || df == nil {
		return s, d, false
	}
	copy(s[:], sf)
	copy(d[:], df)
	return s, d, true
}

// diagQuery sends one request for the socket (src, sport) connected to
// (dst, dport) and reads its answer.
func diagQuery(family uint8, src, dst [16]byte, sport, dport uint16, srcIP, dstIP net.IP) (tcpWritten, error) {
	diagSock.Lock()
	defer diagSock.Unlock()
	if diagSock.buf == nil {
		fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
		if err != nil {
			return tcpWritten{}, fmt.Errorf("sock_diag: socket: %w", err)
		}
		// The kernel answers at once; the bound only keeps a receive loop
		// from waiting for ever on a socket that went wrong.
		tv := unix.NsecToTimeval(int64(time.Second))
		if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
			unix.Close(fd)
			return tcpWritten{}, fmt.Errorf("sock_diag: SO_RCVTIMEO: %w", err)
		}
		diagSock.fd, diagSock.buf = fd, make([]byte, diagReplySize)
	}
	diagSock.seq++
	seq := diagSock.seq
	req := make([]byte, unix.NLMSG_HDRLEN+diagReqSize)
	ne := binary.NativeEndian
	ne.PutUint32(req[0:], uint32(len(req)))
	ne.PutUint16(req[4:], unix.SOCK_DIAG_BY_FAMILY)
	ne.PutUint16(req[6:], unix.NLM_F_REQUEST)
	ne.PutUint32(req[8:], seq)
	r := req[unix.NLMSG_HDRLEN:]
	r[0], r[1], r[2] = family, unix.IPPROTO_TCP, 1<<(diagInfoAttr-1)
	ne.PutUint32(r[4:], tcpLiveStates)
	id := r[8:]
	binary.BigEndian.PutUint16(id[0:], sport)
	binary.BigEndian.PutUint16(id[2:], dport)
	copy(id[4:20], src[:])
	copy(id[20:36], dst[:])
	ne.PutUint32(id[40:], diagNoCookie)
	ne.PutUint32(id[44:], diagNoCookie)
	if err := unix.Sendto(diagSock.fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return tcpWritten{}, fmt.Errorf("sock_diag: send: %w", err)
	}
	for {
		n, _, err := unix.Recvfrom(diagSock.fd, diagSock.buf, 0)
		if err != nil {
			return tcpWritten{}, fmt.Errorf("sock_diag: receive: %w", err)
		}
		w, done, err := parseDiagReply(diagSock.buf[:n], seq, id[:4], srcIP, dstIP)
		if done || err != nil {
			return w, err
		}
	}
}

// parseDiagReply reads the messages of one datagram. done is false when none
// of them answers request seq (a late answer to an earlier one).
func parseDiagReply(b []byte, seq uint32, ports []byte, src, dst net.IP) (w tcpWritten, done bool, err error) {
	ne := binary.NativeEndian
	for len(b) >= unix.NLMSG_HDRLEN {
		l := int(ne.Uint32(b))
		if l < unix.NLMSG_HDRLEN || l > len(b) {
			return w, true, fmt.Errorf("sock_diag: message of %d bytes in %d", l, len(b))
		}
		m, typ, mseq := b[unix.NLMSG_HDRLEN:l], ne.Uint16(b[4:]), ne.Uint32(b[8:])
		b = b[min(len(b), (l+3)&^3):]
		if mseq != seq {
			continue
		}
		switch typ {
		case unix.NLMSG_ERROR:
			if len(m) < 4 {
				return w, true, errors.New("sock_diag: short error message")
			}
			if e := int32(ne.Uint32(m)); e != 0 {
				return w, true, fmt.Errorf("sock_diag: %w", unix.Errno(-e))
			}
			continue
		case unix.SOCK_DIAG_BY_FAMILY:
			w, err = parseDiagMsg(m, ports, src, dst)
			return w, true, err
		}
	}
	return w, false, nil
}

// parseDiagMsg reads an inet_diag_msg and its INET_DIAG_INFO attribute. The
// kernel may answer about another socket than the one named (a listener on
// the port): the answer must name the same ports and addresses, an IPv4
// address being the same as its IPv4-mapped IPv6 form.
func parseDiagMsg(m, ports []byte, src, dst net.IP) (tcpWritten, error) {
	ne := binary.NativeEndian
	if len(m) < diagMsgSize {
		return tcpWritten{}, fmt.Errorf("sock_diag: answer of %d bytes", len(m))
	}
	alen := net.IPv6len
	if m[0] == unix.AF_INET {
		alen = net.IPv4len
	}
	if string(m[4:8]) != string(ports) || !net.IP(m[8:8+alen]).Equal(src) || !net.IP(m[24:24+alen]).Equal(dst) {
		return tcpWritten{}, errors.New("sock_diag: the answer is about another socket")
	}
	w := tcpWritten{state: m[1], wqueue: ne.Uint32(m[60:])}
	if tcpLiveStates&(1<<w.state) == 0 {
		return tcpWritten{}, fmt.Errorf("sock_diag: the peer's socket is in TCP state %d", w.state)
	}
	const ackedEnd = int(unsafe.Offsetof(unix.TCPInfo{}.Bytes_acked)) + 8
	for a := m[diagMsgSize:]; len(a) >= 4; {
		l, typ := int(ne.Uint16(a)), ne.Uint16(a[2:])
		if l < 4 || l > len(a) {
			break
		}
		if typ == diagInfoAttr {
			if l-4 < ackedEnd {
				return tcpWritten{}, fmt.Errorf("sock_diag: tcp_info of %d bytes has no tcpi_bytes_acked (Linux 4.1 or later)", l-4)
			}
			w.acked = ne.Uint64(a[4+ackedEnd-8:])
			return w, nil
		}
		a = a[min(len(a), (l+3)&^3):]
	}
	return tcpWritten{}, errors.New("sock_diag: answer without tcp_info")
}

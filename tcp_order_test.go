package shmipc

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/shm"
	"golang.org/x/sys/unix"
)

// Close ordering over TCP loopback (tcp_order.go), against a peer that
// behaves as the reference implementations do: a stream's last bytes go as
// a FallbackData frame, and its close element is published on the queue as
// soon as that write has returned.

const (
	toStreams  = 100
	toHead     = 100      // bytes of each stream sent through shared memory
	toFallback = 32 << 10 // then as one FallbackData frame
	toRcvBuf   = 4 << 10  // this side's SO_RCVBUF: smaller than the frame
)

// toPayload is what stream id carries in all.
func toPayload(id uint32) []byte {
	b := make([]byte, toHead+toFallback)
	for i := range b {
		b[i] = byte(int(id)*7 + i*13)
	}
	return b
}

// toListen listens on TCP loopback; accepted connections get a receive
// buffer of rcvbuf bytes when rcvbuf > 0.
func toListen(t *testing.T, addr string, rcvbuf int) net.Listener {
	t.Helper()
	lc := net.ListenConfig{Control: toSetRcvBuf(rcvbuf)}
	ln, err := lc.Listen(context.Background(), "tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln
}

func toSetRcvBuf(n int) func(string, string, syscall.RawConn) error {
	return func(_, _ string, c syscall.RawConn) error {
		if n <= 0 {
			return nil
		}
		var serr error
		if err := c.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, n) }); err != nil {
			return err
		}
		return serr
	}
}

// toPair connects over TCP loopback; the end this side's session uses
// (accepted when victimAccepts) has the small receive buffer.
func toPair(t *testing.T, victimAccepts bool) (victim, peer net.Conn) {
	t.Helper()
	return toPairOn(t, "127.0.0.1:0", victimAccepts)
}

// toPairOn is toPair with the listener on addr; the dialer connects to
// 127.0.0.1 at its port.
func toPairOn(t *testing.T, addr string, victimAccepts bool) (victim, peer net.Conn) {
	t.Helper()
	ln := toListen(t, addr, map[bool]int{true: toRcvBuf}[victimAccepts])
	ch := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		ch <- c
	}()
	d := net.Dialer{Control: toSetRcvBuf(map[bool]int{false: toRcvBuf}[victimAccepts])}
	dialed, err := d.Dial("tcp", net.JoinHostPort("127.0.0.1", fmt.Sprint(ln.Addr().(*net.TCPAddr).Port)))
	if err != nil {
		t.Fatal(err)
	}
	accepted := <-ch
	if accepted == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { dialed.Close(); accepted.Close() })
	if victimAccepts {
		return accepted, dialed
	}
	return dialed, accepted
}

// tcpRawPeer is the raw peer's sending half over TCP (rawPeer holds a Unix
// connection): its buffer manager and the queue it produces into.
type tcpRawPeer struct {
	conn net.Conn
	bm   *shm.Buffer
	send rawQueue
}

// sendStream sends stream id as the references do: the head through shared
// memory, the rest as a FallbackData frame, then the close element.
func (p *tcpRawPeer) sendStream(id uint32) error {
	data := toPayload(id)
	var li int
	var off uint32
	var err error
	for deadline := time.Now().Add(peerTimeout); ; time.Sleep(time.Millisecond) {
		if li, off, err = p.bm.Alloc(toHead, false, false); err != nil || (li >= 0 && off != 0) || time.Now().After(deadline) {
			break
		}
	}
	if err != nil || li < 0 || off == 0 {
		return fmt.Errorf("stream %d: no slice: list %d, %v", id, li, err)
	}
	copy(p.bm.SliceData(li, off), data[:toHead])
	p.bm.LinkSlice(off, toHead, 0)
	if err := p.publish(id, off, shm.StatusOpened); err != nil {
		return err
	}
	p.conn.SetWriteDeadline(time.Now().Add(peerTimeout))
	if _, err := p.conn.Write(rawFallbackFrame(2, 0, id, 0, string(data[toHead:]))); err != nil {
		return fmt.Errorf("stream %d: fallback frame: %w", id, err)
	}
	return p.publish(id, 0, shm.StatusClosed) // the write has returned
}

func (p *tcpRawPeer) publish(id, off, status uint32) error {
	for deadline := time.Now().Add(peerTimeout); p.send.tail()-p.send.head() >= int64(p.send.cap); time.Sleep(100 * time.Microsecond) {
		if time.Now().After(deadline) {
			return fmt.Errorf("stream %d: the queue stayed full", id)
		}
	}
	p.send.put(id, off, status)
	if p.send.casFlag() {
		p.conn.SetWriteDeadline(time.Now().Add(peerTimeout))
		if _, err := p.conn.Write(rawFrame(8, rawMagic, 2, 1)); err != nil {
			return fmt.Errorf("polling frame: %w", err)
		}
	}
	return nil
}

// toCheck reads st to its end and checks it carried stream id's payload.
func toCheck(st *Stream, id uint32) error {
	st.SetReadDeadline(time.Now().Add(3 * peerTimeout))
	got, err := io.ReadAll(st)
	if err != nil {
		return fmt.Errorf("stream %d: %v after %d bytes", id, err, len(got))
	}
	if want := toPayload(id); !bytes.Equal(got, want) {
		return fmt.Errorf("stream %d: %d bytes before io.EOF, want %d", id, len(got), len(want))
	}
	return nil
}

func toConfig(t *testing.T) *Config {
	conf := peerConfig(t, MemMapTypeDevShmFile, 0)
	conf.ShareMemoryBufferCap = 4 << 20
	if toLogger != nil {
		conf.Logger = toLogger
	}
	return conf
}

// toRunServer: this side serves n streams; the raw peer is a client over
// TCP.
func toRunServer(t *testing.T, n int) []error {
	victimConn, peerConn := toPair(t, true)
	conf := toConfig(t)
	r := createRawRegions(t, conf, MemMapTypeDevShmFile, rawLayout{})
	if _, err := peerConn.Write(rawPathFrame(2, 0, r.queuePath, r.bufPath)); err != nil {
		t.Fatal(err)
	}
	s, err := Server(victimConn, conf)
	if err != nil {
		t.Fatalf("Server: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	bm, err := shm.NewBuffer(r.buf, true)
	if err != nil {
		t.Fatal(err)
	}
	p := &tcpRawPeer{conn: peerConn, bm: bm, send: rawQueue{mem: r.queue.Mem()[:len(r.queue.Mem())/2], cap: conf.QueueCap}}
	peerErr := make(chan error, 1)
	go func() {
		for id := uint32(1); id <= uint32(n); id++ {
			if err := p.sendStream(id); err != nil {
				peerErr <- err
				return
			}
		}
		peerErr <- nil
	}()
	var mu sync.Mutex
	var errs []error
	var wg sync.WaitGroup
	for range n {
		st, err := s.AcceptStream()
		if err != nil {
			t.Fatalf("AcceptStream: %v", err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := toCheck(st, st.id); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if err := <-peerErr; err != nil {
		t.Fatal(err)
	}
	return errs
}

// toRunClient: this side is the client; the raw peer serves over TCP.
func toRunClient(t *testing.T) []error {
	victimConn, peerConn := toPair(t, false)
	conf := toConfig(t)
	done := make(chan struct{})
	var s *Session
	var cerr error
	go func() { s, cerr = Client(victimConn, conf); close(done) }()
	peerConn.SetDeadline(time.Now().Add(peerTimeout))
	h, err := readN(peerConn, 8)
	if err != nil || h[6] != 2 || h[7] != 0 {
		t.Fatalf("first header % x: %v", h, err)
	}
	rest, err := readN(peerConn, int(binary.BigEndian.Uint32(h))-8)
	if err != nil {
		t.Fatal(err)
	}
	peerConn.SetDeadline(time.Time{})
	qp, bp, err := decodeRawPaths(rest)
	if err != nil {
		t.Fatal(err)
	}
	var maps [2][]byte
	for i, path := range []string{bp, qp} {
		fd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		maps[i], err = rawMmap(fd)
		unix.Close(fd)
		if err != nil {
			t.Fatal(err)
		}
		m := maps[i]
		t.Cleanup(func() { unix.Munmap(m) })
	}
	<-done
	if cerr != nil {
		t.Fatalf("Client: %v", cerr)
	}
	t.Cleanup(func() { s.Close() })
	bm, err := shm.NewBuffer(shm.RegionOf(maps[0]), false)
	if err != nil {
		t.Fatal(err)
	}
	half := len(maps[1]) / 2
	p := &tcpRawPeer{conn: peerConn, bm: bm, send: rawQueue{mem: maps[1][half:], cap: uint32((half - queueHeaderSize) / queueElemSize)}}
	streams := make([]*Stream, toStreams)
	for i := range streams {
		if streams[i], err = s.OpenStream(); err != nil {
			t.Fatal(err)
		}
	}
	peerErr := make(chan error, 1)
	go func() {
		for _, st := range streams {
			if err := p.sendStream(st.id); err != nil {
				peerErr <- err
				return
			}
		}
		peerErr <- nil
	}()
	errs := make([]error, toStreams)
	var wg sync.WaitGroup
	for i, st := range streams {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = toCheck(st, st.id) }()
	}
	wg.Wait()
	if err := <-peerErr; err != nil {
		t.Fatal(err)
	}
	var bad []error
	for _, err := range errs {
		if err != nil {
			bad = append(bad, err)
		}
	}
	return bad
}

func toReport(t *testing.T, errs []error, n int) {
	t.Helper()
	if len(errs) > 0 {
		t.Errorf("%d of %d streams short or failed; first: %v", len(errs), n, errs[0])
	}
}

// TestTCPCloseAfterFallbackServer: every stream's bytes arrive before its
// io.EOF when this side serves over TCP loopback.
func TestTCPCloseAfterFallbackServer(t *testing.T) { toReport(t, toRunServer(t, toStreams), toStreams) }

// TestTCPCloseAfterFallbackClient is the same with this side as client.
func TestTCPCloseAfterFallbackClient(t *testing.T) { toReport(t, toRunClient(t), toStreams) }

// TestTCPCloseQuietRule: without sock_diag the quiet rule keeps the order
// too, and the session says so on its logger.
func TestTCPCloseQuietRule(t *testing.T) {
	tcpDiagOff.Store(true)
	t.Cleanup(func() { tcpDiagOff.Store(false) })
	var logBuf syncBuffer
	prev := toLogger
	toLogger = slog.New(slog.NewTextHandler(&logBuf, nil))
	t.Cleanup(func() { toLogger = prev })
	// Each close waits for the socket to be quiet for tcpQuiet (20 ms),
	// one after the other: with -short, 10 streams instead of 100.
	n := shortOr(toStreams, 10)
	toReport(t, toRunServer(t, n), n)
	if got := logBuf.String(); !strings.Contains(got, "cannot see the peer's TCP socket") {
		t.Errorf("no warning logged; log:\n%s", got)
	}
}

// toLogger, when set, is the logger of the sessions toConfig configures.
var toLogger *slog.Logger

// syncBuffer is a bytes.Buffer the session's goroutines may log into.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// TestTCPPeerWrittenQuery checks the sock_diag query against a plain TCP
// loopback pair: after k bytes written and read, and then n more written and
// not read, the reading end sees k+n written on the peer's socket, plus one
// for the SYN when the writer is the end that connected; this side's own
// count (tcpConsumed) is k; and the close target (tcpTarget) is n less
// tcpCountSlack. The second n is larger than both socket buffers can hold
// in flight, so part of it is in the writer's send queue (idiag_wqueue).
func TestTCPPeerWrittenQuery(t *testing.T) {
	for _, tc := range []struct {
		listen      string
		writerDials bool
	}{{"127.0.0.1:0", true}, {"127.0.0.1:0", false}, {":0", true}, {":0", false}} {
		writerDials := tc.writerDials
		t.Run(fmt.Sprintf("listen=%s/writerDials=%v", tc.listen, writerDials), func(t *testing.T) {
			// The reader has the small buffer. A listener on ":0" is
			// dual-stack: the accepted end is IPv6 with IPv4-mapped addresses.
			reader, writer := toPairOn(t, tc.listen, writerDials)
			const k = 1000
			if _, err := writer.Write(make([]byte, k)); err != nil {
				t.Fatal(err)
			}
			if _, err := readN(reader, k); err != nil {
				t.Fatal(err)
			}
			// The write stops when the buffers are full: once it waits for
			// room, its deadline is moved to now.
			type result struct {
				n   int
				err error
			}
			wrote := make(chan result, 1)
			go func() {
				n, err := writer.Write(make([]byte, 8<<20))
				wrote <- result{n, err}
			}()
			waitBlocked(t, "(*pollDesc).waitWrite", 1)
			writer.SetWriteDeadline(time.Now())
			r := <-wrote
			n, err := r.n, r.err
			if n == 0 || !isTimeout(err) {
				t.Fatalf("write: %d bytes, %v; want a partial write and a timeout", n, err)
			}
			syn := map[bool]uint64{true: 1}[writerDials]
			local, remote := reader.LocalAddr().(*net.TCPAddr), reader.RemoteAddr().(*net.TCPAddr)
			deadline := time.Now().Add(peerTimeout)
			var w tcpWritten
			for {
				if w, err = queryPeerSocket(local, remote); err != nil {
					t.Fatal(err)
				}
				if w.total() == k+uint64(n)+syn || time.Now().After(deadline) {
					break
				}
				time.Sleep(time.Millisecond) // an answer raced an acknowledgement
			}
			if w.total() != k+uint64(n)+syn {
				t.Fatalf("peer socket: acked %d + wqueue %d = %d, want %d written (+%d SYN)", w.acked, w.wqueue, w.total(), k+n, syn)
			}
			if w.wqueue == 0 {
				t.Errorf("nothing in the writer's send queue (acked %d): the test did not fill it", w.acked)
			}
			t.Logf("%d+%d written: acked %d, wqueue %d", k, n, w.acked, w.wqueue)
			ec := newEventConn(reader, time.Second)
			if got, err := ec.tcpConsumed(); err != nil || got != k {
				t.Fatalf("tcpConsumed = %d, %v; want %d", got, err, k)
			}
			ec.tcp = &tcpOrder{local: local, remote: remote}
			at, _, err := ec.tcpTarget(^uint64(0))
			if want := uint64(n) + syn - tcpCountSlack; err != nil || at != want {
				t.Fatalf("tcpTarget = %d, %v; want %d", at, err, want)
			}
			// Addresses of no connection name no socket; when the port is a
			// listener's, the kernel answers about the listener, which is
			// refused.
			other := &net.TCPAddr{IP: remote.IP, Port: local.Port}
			if w, err := queryPeerSocket(local, other); err == nil {
				t.Errorf("query for a connection that does not exist: %+v, no error", w)
			} else {
				t.Logf("query for a connection that does not exist: %v", err)
			}
		})
	}
}

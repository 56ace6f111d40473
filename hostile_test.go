package shmipc

// Hostile peers. A raw peer completes a correct handshake with a real
// shmipc Server (hostile client) or a real shmipc Client (hostile server),
// keeps its own mapping of the shared regions, and then corrupts them or
// sends bad frames. The victim must not panic or hang, must close the
// session with an error that wraps ErrProtocol (ErrHandshake for damage seen
// in the handshake) and names the problem, and another session in the same
// process must keep working. Cases where the protocol makes the damage
// harmless (PROTOCOL.md §6.2, §6.3; fields the library reads once) assert
// that the session survives instead.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// hpTimeout bounds every wait of these tests.
const hpTimeout = 5 * time.Second

// hpReaderSpin is the ConsumerSpinTime of victims whose corruption must be
// found by a reader polling the queue rather than by a wake-up frame.
const hpReaderSpin = 300 * time.Millisecond

const hpMagic = 0x7758

var hpSeq atomic.Uint32

// hpModes: version 2 over /dev/shm files and version 3 over memfds.
var hpModes = []MemMapType{MemMapTypeDevShmFile, MemMapTypeMemFd}

// hpPrefix returns /dev/shm/shmipc_hp_<pid>_<rand> and removes whatever is
// left under it when the test ends.
func hpPrefix(t *testing.T) string {
	t.Helper()
	p := fmt.Sprintf("/dev/shm/shmipc_hp_%d_%08x", os.Getpid(), rand.Uint32())
	t.Cleanup(func() {
		m, _ := filepath.Glob(p + "_*")
		for _, f := range m {
			os.Remove(f)
		}
	})
	return p
}

// hpConfig is a small configuration: a 1 MiB buffer region of the
// reference slice sizes (63, 9 and 1 slices), 64-element queues.
func hpConfig(t *testing.T, mode MemMapType, spin time.Duration) *Config {
	t.Helper()
	c := DefaultConfig()
	c.MemMapType = mode
	c.ShareMemoryBufferCap = 1 << 20
	c.BufferSliceSizes = ReferenceSliceSizes()
	c.QueueCap = 64
	c.InitializeTimeout = hpTimeout
	c.MaxFallbackFrameSize = minFallbackFrame
	c.ConsumerSpinTime = spin
	c.ShareMemoryPathPrefix = hpPrefix(t)
	return c
}

// ---- frames, written by hand (PROTOCOL.md §2) ----

func hpFrame(length uint32, magic uint16, version, typ byte, payload ...byte) []byte {
	b := binary.BigEndian.AppendUint32(nil, length)
	b = binary.BigEndian.AppendUint16(b, magic)
	b = append(b, version, typ)
	return append(b, payload...)
}

func hpPaths(version, typ byte, queuePath, bufPath string) []byte {
	b := hpFrame(uint32(12+len(queuePath)+len(bufPath)), hpMagic, version, typ)
	b = binary.BigEndian.AppendUint16(b, uint16(len(queuePath)))
	b = append(b, queuePath...)
	b = binary.BigEndian.AppendUint16(b, uint16(len(bufPath)))
	return append(b, bufPath...)
}

func hpFallback(version byte, length uint32, id, status uint32, data string) []byte {
	p := binary.BigEndian.AppendUint32(nil, id)
	p = binary.BigEndian.AppendUint32(p, status)
	p = append(p, data...)
	if length == 0 {
		length = uint32(8 + len(p))
	}
	return hpFrame(length, hpMagic, version, 3, p...)
}

func hpDecodePaths(p []byte) (queuePath, bufPath string, err error) {
	if len(p) < 2 {
		return "", "", fmt.Errorf("path payload of %d bytes", len(p))
	}
	q := int(binary.BigEndian.Uint16(p))
	if len(p) < 4+q {
		return "", "", fmt.Errorf("path payload of %d bytes, queue path %d", len(p), q)
	}
	b := int(binary.BigEndian.Uint16(p[2+q:]))
	if len(p) != 4+q+b {
		return "", "", fmt.Errorf("path payload of %d bytes, paths %d+%d", len(p), q, b)
	}
	return string(p[2 : 2+q]), string(p[4+q:]), nil
}

func hpReadN(c net.Conn, n int) ([]byte, error) {
	b := make([]byte, n)
	_, err := io.ReadFull(c, b)
	return b, err
}

// ---- raw access to one queue half (PROTOCOL.md §5) ----

type hpQueue struct {
	mem []byte
	cap uint32 // the capacity the region's size gives, whatever the header says
}

func (q hpQueue) i64(off int) *int64   { return (*int64)(unsafe.Pointer(&q.mem[off])) }
func (q hpQueue) u32(off int) *uint32  { return (*uint32)(unsafe.Pointer(&q.mem[off])) }
func (q hpQueue) head() int64          { return atomic.LoadInt64(q.i64(queueHeadOff)) }
func (q hpQueue) tail() int64          { return atomic.LoadInt64(q.i64(queueTailOff)) }
func (q hpQueue) setHead(v int64)      { atomic.StoreInt64(q.i64(queueHeadOff), v) }
func (q hpQueue) setTail(v int64)      { atomic.StoreInt64(q.i64(queueTailOff), v) }
func (q hpQueue) flag() uint32         { return atomic.LoadUint32(q.u32(queueFlagOff)) }
func (q hpQueue) casFlag() bool        { return atomic.CompareAndSwapUint32(q.u32(queueFlagOff), 0, 1) }
func (q hpQueue) setCapField(v uint32) { atomic.StoreUint32(q.u32(queueCapOff), v) }

func (q hpQueue) slot(c int64) []byte {
	off := queueHeaderSize + int(uint64(c)%uint64(q.cap))*queueElemSize
	return q.mem[off : off+queueElemSize]
}

// put writes an element at the tail and publishes it, as a producer does.
func (q hpQueue) put(id, offset, status uint32) {
	t := q.tail()
	s := q.slot(t)
	binary.LittleEndian.PutUint32(s[0:], id)
	binary.LittleEndian.PutUint32(s[4:], offset)
	binary.LittleEndian.PutUint32(s[8:], status)
	q.setTail(t + 1)
}

func (q hpQueue) pop() (queueElem, bool) {
	h, t := q.head(), q.tail()
	if h >= t {
		return queueElem{}, false
	}
	s := q.slot(h)
	e := queueElem{
		id:     binary.LittleEndian.Uint32(s[0:]),
		offset: binary.LittleEndian.Uint32(s[4:]),
		status: binary.LittleEndian.Uint32(s[8:]),
	}
	q.setHead(h + 1)
	return e, true
}

// ---- the raw peer ----

// hpPeer is the hostile side of a session, after a correct handshake: its
// connection, its own mapping of the buffer region and its queue halves.
type hpPeer struct {
	t       *testing.T
	conn    *net.UnixConn
	version byte
	buf     []byte
	bm      *bufferManager // our own view of the buffer region, to build valid messages
	send    hpQueue        // the queue we produce into: the victim's receive queue
	recv    hpQueue        // the queue the victim produces into
}

func (p *hpPeer) write(b []byte) {
	p.conn.SetWriteDeadline(time.Now().Add(hpTimeout))
	if _, err := p.conn.Write(b); err != nil {
		p.t.Logf("raw peer write of %d bytes: %v", len(b), err)
	}
}

// poll sends a Polling frame.
func (p *hpPeer) poll() { p.write(hpFrame(8, hpMagic, p.version, 1)) }

func (p *hpPeer) u32(off uint32) uint32 {
	return atomic.LoadUint32((*uint32)(unsafe.Pointer(&p.buf[off])))
}

func (p *hpPeer) setU32(off, v uint32) {
	atomic.StoreUint32((*uint32)(unsafe.Pointer(&p.buf[off])), v)
}

// msg builds a valid one-slice message holding data and returns the
// absolute offset of its slice header.
func (p *hpPeer) msg(data string) uint32 {
	p.t.Helper()
	li, off, err := p.bm.alloc(len(data), false)
	if err != nil || li < 0 {
		p.t.Fatalf("raw peer cannot allocate a slice: list %d, %v", li, err)
	}
	copy(p.bm.sliceData(li, off), data)
	p.bm.linkSlice(off, len(data), 0)
	return off
}

// link makes the slice at a continue with the slice at b.
func (p *hpPeer) link(a, b uint32) {
	p.setU32(a+sliceNextOff, b)
	p.buf[a+sliceFlagsOff] = flagInUse | flagHasNext
}

func (p *hpPeer) list(i int) sliceList { return p.bm.lists[i] }

// readMsg reads the message at root and frees its slices.
func (p *hpPeer) readMsg(root uint32) (string, error) {
	slices, err := p.bm.readChain(nil, root)
	if err != nil {
		return "", err
	}
	var b []byte
	for _, s := range slices {
		b = append(b, s.data...)
	}
	for _, s := range slices {
		if err := p.bm.push(int(s.list), s.off); err != nil {
			return "", err
		}
	}
	return string(b), nil
}

// waitElem waits for the victim to publish an element.
func (p *hpPeer) waitElem() (queueElem, error) {
	deadline := time.Now().Add(hpTimeout)
	for {
		if e, ok := p.recv.pop(); ok {
			return e, nil
		}
		if time.Now().After(deadline) {
			return queueElem{}, fmt.Errorf("no element from the victim within %v", hpTimeout)
		}
		time.Sleep(200 * time.Microsecond)
	}
}

// readFrame returns the next frame from the victim that is not Polling.
func (p *hpPeer) readFrame() ([]byte, error) {
	p.conn.SetReadDeadline(time.Now().Add(hpTimeout))
	defer p.conn.SetReadDeadline(time.Time{})
	for {
		h, err := hpReadN(p.conn, 8)
		if err != nil {
			return nil, err
		}
		n := binary.BigEndian.Uint32(h)
		if n < 8 || n > 1<<20 {
			return nil, fmt.Errorf("frame header % x", h)
		}
		rest, err := hpReadN(p.conn, int(n)-8)
		if err != nil {
			return nil, err
		}
		if h[7] != 1 {
			return append(h, rest...), nil
		}
	}
}

// ---- hostile client: regions and handshake ----

type hpRegions struct {
	queuePath, bufPath string
	bufFd, queueFd     int
	buf, queue         *region
}

// hpLayout describes the regions a hostile client creates. Zero values give
// the valid regions of the configuration.
type hpLayout struct {
	bufSize   int
	queueSize int
	initBuf   func(buf []byte)    // nil: the valid layout of the configuration
	mutate    func(buf, q []byte) // damage applied before the handshake
}

func hpCreate(t *testing.T, conf *Config, mode MemMapType, lay hpLayout) *hpRegions {
	t.Helper()
	base := fmt.Sprintf("%s_%d", conf.ShareMemoryPathPrefix, hpSeq.Add(1))
	r := &hpRegions{queuePath: base + "_queue_0", bufPath: base + "_buffer", bufFd: -1, queueFd: -1}
	bufSize, qSize := lay.bufSize, lay.queueSize
	if bufSize == 0 {
		bufSize = int(conf.ShareMemoryBufferCap)
	}
	if qSize == 0 {
		qSize = queueRegionSize(conf.QueueCap)
	}
	var err error
	if r.buf, r.bufFd, err = createRegion(mode, r.bufPath, bufSize); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closeFds(r.bufFd); r.buf.release() })
	if r.queue, r.queueFd, err = createRegion(mode, r.queuePath, qSize); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closeFds(r.queueFd); r.queue.release() })
	if lay.initBuf != nil {
		lay.initBuf(r.buf.mem)
	} else {
		plans, err := planLists(conf.ShareMemoryBufferCap, conf.BufferSliceSizes)
		if err != nil {
			t.Fatal(err)
		}
		initBufferRegion(r.buf.mem, plans)
	}
	if half := qSize / 2; half >= queueHeaderSize {
		initQueueRegion(r.queue.mem, uint32((half-queueHeaderSize)/queueElemSize))
	}
	if lay.mutate != nil {
		lay.mutate(r.buf.mem, r.queue.mem)
	}
	return r
}

// handshake runs the client side: version 2 with file paths, or version 3
// with memfds (PROTOCOL.md §1.4, §1.5). It returns the version in use.
func (r *hpRegions) handshake(c *net.UnixConn, mode MemMapType) (byte, error) {
	c.SetDeadline(time.Now().Add(hpTimeout))
	defer c.SetDeadline(time.Time{})
	if mode == MemMapTypeDevShmFile {
		_, err := c.Write(hpPaths(2, 0, r.queuePath, r.bufPath))
		return 2, err
	}
	expect := func(typ byte) error {
		h, err := hpReadN(c, 8)
		if err != nil {
			return err
		}
		if want := hpFrame(8, hpMagic, 3, typ); !bytes.Equal(h, want) {
			return fmt.Errorf("got % x, want % x", h, want)
		}
		return nil
	}
	if _, err := c.Write(hpFrame(8, hpMagic, 3, 4)); err != nil {
		return 3, err
	}
	if err := expect(4); err != nil {
		return 3, err
	}
	if _, err := c.Write(hpPaths(3, 5, r.queuePath, r.bufPath)); err != nil {
		return 3, err
	}
	if err := expect(7); err != nil {
		return 3, err
	}
	if _, _, err := c.WriteMsgUnix([]byte{0}, unix.UnixRights(r.bufFd, r.queueFd), nil); err != nil {
		return 3, err
	}
	return 3, expect(6)
}

// ---- the real server side: a Listener with an echo handler and a good
// client session ----

type hpServerEnv struct {
	conf *Config
	ln   *Listener
	addr string
	good *Session
}

func hpStartServer(t *testing.T, spin time.Duration) *hpServerEnv {
	t.Helper()
	conf := hpConfig(t, MemMapTypeMemFd, spin)
	ln, err := Listen("unix", filepath.Join(t.TempDir(), "hp.sock"), conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			st, err := ln.AcceptStream()
			if err != nil {
				return
			}
			go func() {
				defer st.Close()
				io.Copy(st, st)
			}()
		}
	}()
	env := &hpServerEnv{conf: conf, ln: ln, addr: ln.Addr().String()}
	good, err := Dial("unix", env.addr, hpConfig(t, MemMapTypeMemFd, 0))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { good.Close() })
	env.good = good
	if err := hpEcho(good, "warm-up"); err != nil {
		t.Fatalf("good session: %v", err)
	}
	return env
}

// hpEcho does one echo round trip on a client session.
func hpEcho(s *Session, msg string) error {
	st, err := s.OpenStream()
	if err != nil {
		return fmt.Errorf("OpenStream: %w", err)
	}
	defer st.Close()
	st.SetDeadline(time.Now().Add(hpTimeout))
	if _, err := st.Write([]byte(msg)); err != nil {
		return fmt.Errorf("Write: %w", err)
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(st, got); err != nil {
		return fmt.Errorf("reading the echo: %w", err)
	}
	if string(got) != msg {
		return fmt.Errorf("echo %q, want %q", got, msg)
	}
	return nil
}

// checkGood runs an echo on the well-behaved session after a case.
func (e *hpServerEnv) checkGood(t *testing.T) {
	t.Helper()
	if err := hpEcho(e.good, "still fine after "+t.Name()); err != nil {
		t.Errorf("the other session stopped working: %v", err)
	}
}

func (e *hpServerEnv) sessionSet() map[*Session]bool {
	e.ln.mu.Lock()
	defer e.ln.mu.Unlock()
	m := make(map[*Session]bool, len(e.ln.sessions))
	for s := range e.ln.sessions {
		m[s] = true
	}
	return m
}

// waitSession returns the session the listener registered after before.
func (e *hpServerEnv) waitSession(t *testing.T, before map[*Session]bool) *Session {
	t.Helper()
	deadline := time.Now().Add(hpTimeout)
	for {
		for s := range e.sessionSet() {
			if !before[s] {
				return s
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the listener registered no session for the raw client within %v", hpTimeout)
		}
		time.Sleep(time.Millisecond)
	}
}

// hpConnectClient makes a hostile client with valid regions, hands them to
// the listener and returns it with the server session it got.
func hpConnectClient(t *testing.T, env *hpServerEnv, mode MemMapType) (*hpPeer, *Session) {
	t.Helper()
	p, _, victim := hpConnectClientRegions(t, env, mode)
	return p, victim
}

// hpConnectClientRegions is hpConnectClient that also returns the regions.
func hpConnectClientRegions(t *testing.T, env *hpServerEnv, mode MemMapType) (*hpPeer, *hpRegions, *Session) {
	t.Helper()
	conf := hpConfig(t, mode, 0)
	r := hpCreate(t, conf, mode, hpLayout{})
	before := env.sessionSet()
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: env.addr, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	v, err := r.handshake(c, mode)
	if err != nil {
		t.Fatalf("raw client handshake: %v", err)
	}
	victim := env.waitSession(t, before)
	return hpPeerOf(t, c, v, r, conf), r, victim
}

// hpPeerOf is the raw client of regions r after its handshake on c.
func hpPeerOf(t *testing.T, c *net.UnixConn, version byte, r *hpRegions, conf *Config) *hpPeer {
	t.Helper()
	bm, err := newBufferManager(r.buf, true)
	if err != nil {
		t.Fatal(err)
	}
	half := len(r.queue.mem) / 2
	return &hpPeer{
		t: t, conn: c, version: version, buf: r.buf.mem, bm: bm,
		send: hpQueue{mem: r.queue.mem[:half], cap: conf.QueueCap},
		recv: hpQueue{mem: r.queue.mem[half:], cap: conf.QueueCap},
	}
}

// ---- hostile server ----

type hpResult struct {
	s   *Session
	err error
}

func hpGo(f func() (*Session, error)) <-chan hpResult {
	ch := make(chan hpResult, 1)
	go func() {
		s, err := f()
		ch <- hpResult{s, err}
	}()
	return ch
}

func hpAwait(t *testing.T, ch <-chan hpResult) hpResult {
	t.Helper()
	select {
	case r := <-ch:
		if r.s != nil {
			t.Cleanup(func() { hpCloseBounded(t, r.s) })
		}
		return r
	case <-time.After(hpTimeout):
		t.Fatalf("handshake still running after %v", hpTimeout)
		return hpResult{}
	}
}

func hpMmap(fd int) ([]byte, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, err
	}
	return unix.Mmap(fd, 0, int(st.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
}

// hpServeHandshake plays a correct server handshake and maps the client's
// regions itself.
func hpServeHandshake(c *net.UnixConn, mode MemMapType) (buf, q []byte, version byte, err error) {
	c.SetDeadline(time.Now().Add(hpTimeout))
	defer c.SetDeadline(time.Time{})
	readPaths := func(h []byte) (string, string, error) {
		p, err := hpReadN(c, int(binary.BigEndian.Uint32(h))-8)
		if err != nil {
			return "", "", err
		}
		return hpDecodePaths(p)
	}
	h, err := hpReadN(c, 8)
	if err != nil {
		return nil, nil, 0, err
	}
	if mode == MemMapTypeDevShmFile {
		if h[6] != 2 || h[7] != 0 {
			return nil, nil, 0, fmt.Errorf("first header % x", h)
		}
		qp, bp, err := readPaths(h)
		if err != nil {
			return nil, nil, 0, err
		}
		var fds [2]int
		for i, path := range []string{bp, qp} {
			if fds[i], err = unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0); err != nil {
				return nil, nil, 0, err
			}
			defer unix.Close(fds[i])
		}
		if buf, err = hpMmap(fds[0]); err != nil {
			return nil, nil, 0, err
		}
		q, err = hpMmap(fds[1])
		return buf, q, 2, err
	}
	if !bytes.Equal(h, hpFrame(8, hpMagic, 3, 4)) {
		return nil, nil, 0, fmt.Errorf("first header % x", h)
	}
	if _, err := c.Write(hpFrame(8, hpMagic, 3, 4)); err != nil {
		return nil, nil, 0, err
	}
	if h, err = hpReadN(c, 8); err != nil || h[7] != 5 {
		return nil, nil, 0, fmt.Errorf("path header % x: %v", h, err)
	}
	if _, _, err := readPaths(h); err != nil {
		return nil, nil, 0, err
	}
	if _, err := c.Write(hpFrame(8, hpMagic, 3, 7)); err != nil {
		return nil, nil, 0, err
	}
	fds, err := hpRecvFds(c)
	if err != nil {
		return nil, nil, 0, err
	}
	defer closeFds(fds...)
	if len(fds) != 2 {
		return nil, nil, 0, fmt.Errorf("%d fds", len(fds))
	}
	if buf, err = hpMmap(fds[0]); err != nil {
		return nil, nil, 0, err
	}
	if q, err = hpMmap(fds[1]); err != nil {
		return buf, nil, 0, err
	}
	_, err = c.Write(hpFrame(8, hpMagic, 3, 6))
	return buf, q, 3, err
}

func hpRecvFds(c *net.UnixConn) ([]int, error) {
	oob := make([]byte, unix.CmsgSpace(4*4))
	_, oobn, _, _, err := c.ReadMsgUnix(make([]byte, 1), oob)
	if err != nil {
		return nil, err
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil {
		return nil, err
	}
	var fds []int
	for i := range msgs {
		f, err := unix.ParseUnixRights(&msgs[i])
		if err != nil {
			return nil, err
		}
		fds = append(fds, f...)
	}
	return fds, nil
}

// hpAcceptVictim starts a real client (Dial) against a raw server, which
// completes a correct handshake. It returns the raw server's peer and the
// client session.
func hpAcceptVictim(t *testing.T, mode MemMapType, spin time.Duration) (*hpPeer, *Session) {
	t.Helper()
	conf := hpConfig(t, mode, spin)
	sock := filepath.Join(t.TempDir(), "raw.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ch := hpGo(func() (*Session, error) { return Dial("unix", sock, conf) })
	ln.SetDeadline(time.Now().Add(hpTimeout))
	c, err := ln.AcceptUnix()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	buf, q, v, err := hpServeHandshake(c, mode)
	for _, m := range [][]byte{buf, q} {
		if m != nil {
			t.Cleanup(func() { unix.Munmap(m) })
		}
	}
	if err != nil {
		t.Fatalf("raw server handshake: %v", err)
	}
	res := hpAwait(t, ch)
	if res.err != nil {
		t.Fatalf("Dial: %v", res.err)
	}
	bm, err := newBufferManager(&region{mem: buf}, false)
	if err != nil {
		t.Fatal(err)
	}
	half := len(q) / 2
	qcap := uint32((half - queueHeaderSize) / queueElemSize)
	p := &hpPeer{
		t: t, conn: c, version: v, buf: buf, bm: bm,
		send: hpQueue{mem: q[half:], cap: qcap},
		recv: hpQueue{mem: q[:half], cap: qcap},
	}
	return p, res.s
}

// hpReader reads a victim client's stream until it fails.
type hpReader struct {
	data chan string
	err  chan error
}

func hpStartReader(st *Stream) *hpReader {
	r := &hpReader{data: make(chan string, 64), err: make(chan error, 1)}
	go func() {
		buf := make([]byte, 4096)
		for {
			n, err := st.Read(buf)
			if n > 0 {
				select {
				case r.data <- string(buf[:n]):
				default:
				}
			}
			if err != nil {
				r.err <- err
				return
			}
		}
	}()
	return r
}

// ---- cases ----

// hpCtx is what a case works with.
type hpCtx struct {
	t      *testing.T
	p      *hpPeer
	victim *Session
	id     uint32    // a stream open on both sides
	reader bool      // wake the victim as a well-behaved producer would
	armed  bool      // set up done: the damage follows
	st     *Stream   // hostile-server cases: the victim client's stream
	rd     *hpReader // and its reader
}

func (c *hpCtx) isServerVictim() bool { return c.st == nil }

// wake makes the victim look at its receive queue. In polling mode a
// Polling frame is always sent. In reader mode the peer behaves like a
// correct producer: it sends Polling only if it sets the working flag, so
// while a reader of the victim polls the queue the corruption must be found
// by that reader.
func (c *hpCtx) wake() {
	if !c.reader {
		c.p.poll()
		return
	}
	if c.p.send.casFlag() {
		if c.armed {
			c.t.Log("reader mode: the working flag was clear, sent a Polling frame")
		}
		c.p.poll()
	}
}

func (c *hpCtx) publish(id, off, status uint32) {
	c.p.send.put(id, off, status)
	c.wake()
}

// waitPolling waits until a consumer of the victim has set the working flag.
func (c *hpCtx) waitPolling() {
	deadline := time.Now().Add(2 * time.Second)
	for c.p.send.flag() == 0 {
		if time.Now().After(deadline) {
			c.t.Log("reader mode: no consumer polls the victim's queue")
			return
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// roundTrip sends data on the open stream and checks the victim got it: the
// server echoes it back; the client's reader receives it.
func (c *hpCtx) roundTrip(data string, status uint32) error {
	c.publish(c.id, c.p.msg(data), status)
	return c.expectData(c.id, data)
}

func (c *hpCtx) expectData(id uint32, data string) error {
	if c.isServerVictim() {
		e, err := c.p.waitElem()
		if err != nil {
			return err
		}
		if e.id != id || e.status != statusOpened {
			return fmt.Errorf("echo element %+v, want stream %d data", e, id)
		}
		got, err := c.p.readMsg(e.offset)
		if err != nil {
			return fmt.Errorf("echo message: %w", err)
		}
		if got != data {
			return fmt.Errorf("echo %q, want %q", got, data)
		}
		return nil
	}
	select {
	case got := <-c.rd.data:
		if got != data {
			return fmt.Errorf("victim read %q, want %q", got, data)
		}
		return nil
	case err := <-c.rd.err:
		c.rd.err <- err
		return fmt.Errorf("victim read failed: %w", err)
	case <-time.After(hpTimeout):
		return fmt.Errorf("victim did not receive %q within %v", data, hpTimeout)
	}
}

// provokeSend makes the victim allocate and publish a message; corrupt runs
// just before the victim allocates.
func (c *hpCtx) provokeSend(corrupt func()) {
	if c.isServerVictim() {
		off := c.p.msg("boom") // allocated before the damage; the echo allocates after
		corrupt()
		c.publish(c.id, off, statusOpened)
		return
	}
	corrupt()
	if _, err := c.st.Write([]byte("boom")); err == nil {
		c.t.Log("victim Write succeeded")
	}
}

// hpCase is one corruption: do damages and wakes the victim. Either the
// session must close with an error wrapping is (ErrProtocol when nil) and
// containing every want string, or survive checks the documented behaviour
// of a session that stays up.
type hpCase struct {
	name    string
	do      func(c *hpCtx)
	want    []string
	is      error
	survive func(c *hpCtx) error
}

func hpRoot(off func(c *hpCtx) uint32) func(c *hpCtx) {
	return func(c *hpCtx) { c.publish(c.id, off(c), statusOpened) }
}

// hpSlice builds a valid message, lets damage change its slice header and
// publishes it.
func hpSlice(damage func(c *hpCtx, a uint32)) func(c *hpCtx) {
	return func(c *hpCtx) {
		a := c.p.msg("payload")
		damage(c, a)
		c.publish(c.id, a, statusOpened)
	}
}

func hpSurviveRoundTrip(c *hpCtx) error { return c.roundTrip("after the damage", 0) }

// hpMemoryCases are the shared-memory corruptions both victims face.
func hpMemoryCases() []hpCase {
	const huge = 0xFFFFFF00
	return []hpCase{
		{name: "root offset past the region end", want: []string{"offset"},
			do: hpRoot(func(c *hpCtx) uint32 { return uint32(len(c.p.buf)) + 4096 })},
		{name: "root offset 0xFFFFFFF0", want: []string{"offset"},
			do: hpRoot(func(c *hpCtx) uint32 { return 0xFFFFFFF0 })},
		{name: "root offset in the last 8 bytes of the region", want: []string{"offset"},
			do: hpRoot(func(c *hpCtx) uint32 { return uint32(len(c.p.buf)) - 8 })},
		{name: "root offset in the unused tail", want: []string{"offset"},
			do: hpRoot(func(c *hpCtx) uint32 { l := c.p.list(len(c.p.bm.lists) - 1); return l.end() })},
		{name: "root offset misaligned by 4", want: []string{"offset"},
			do: hpRoot(func(c *hpCtx) uint32 { return c.p.msg("x") + 4 })},
		{name: "root offset one byte into a slice", want: []string{"offset"},
			do: hpRoot(func(c *hpCtx) uint32 { return c.p.msg("x") + 1 })},
		{name: "root offset on a list header", want: []string{"offset"},
			do: hpRoot(func(c *hpCtx) uint32 { return c.p.list(1).header })},
		{name: "root offset on the manager header", want: []string{"offset"},
			do: hpRoot(func(c *hpCtx) uint32 { return 4 })},
		{name: "root offset 0", want: []string{"offset", "0"},
			do: hpRoot(func(c *hpCtx) uint32 { return 0 })},
		{name: "chain next past the region", want: []string{"offset"},
			do: hpSlice(func(c *hpCtx, a uint32) { c.p.link(a, huge) })},
		{name: "chain next misaligned", want: []string{"offset"},
			do: hpSlice(func(c *hpCtx, a uint32) { c.p.link(a, c.p.msg("b")+8) })},
		{name: "chain next on a list header", want: []string{"offset"},
			do: hpSlice(func(c *hpCtx, a uint32) { c.p.link(a, c.p.list(2).header) })},
		{name: "chain cycle A-B-A", want: []string{"cycle"},
			do: hpSlice(func(c *hpCtx, a uint32) {
				b := c.p.msg("second")
				c.p.link(a, b)
				c.p.link(b, a)
			})},
		{name: "chain self-loop", want: []string{"cycle"},
			do: hpSlice(func(c *hpCtx, a uint32) { c.p.link(a, a) })},
		{name: "slice cap matching no list", want: []string{"cap", "1234"},
			do: hpSlice(func(c *hpCtx, a uint32) { c.p.setU32(a+sliceCapOff, 1234) })},
		{name: "slice cap of another list", want: []string{"cap"},
			do: hpSlice(func(c *hpCtx, a uint32) { c.p.setU32(a+sliceCapOff, c.p.list(1).sliceCap) })},
		{name: "slice size beyond cap", want: []string{"size", "cap"},
			do: hpSlice(func(c *hpCtx, a uint32) { c.p.setU32(a+sliceSizeOff, c.p.list(0).sliceCap+1) })},
		{name: "slice size 0xFFFFFFFF", want: []string{"size", "cap"},
			do: hpSlice(func(c *hpCtx, a uint32) { c.p.setU32(a+sliceSizeOff, 0xFFFFFFFF) })},
		{name: "slice start+size beyond cap", want: []string{"start", "cap"},
			do: hpSlice(func(c *hpCtx, a uint32) {
				c.p.setU32(a+sliceStartOff, c.p.list(0).sliceCap-2)
				c.p.setU32(a+sliceSizeOff, 5)
			})},
		{name: "slice start+size overflowing 32 bits", want: []string{"start", "cap"},
			do: hpSlice(func(c *hpCtx, a uint32) {
				c.p.setU32(a+sliceStartOff, 0xFFFFFFFF)
				c.p.setU32(a+sliceSizeOff, 2)
			})},
		{name: "second slice of a chain with size beyond cap", want: []string{"size", "cap"},
			do: hpSlice(func(c *hpCtx, a uint32) {
				b := c.p.msg("second")
				c.p.link(a, b)
				c.p.setU32(b+sliceSizeOff, 1<<20)
			})},
		{name: "element for stream id 0", want: []string{"stream id 0"},
			do: func(c *hpCtx) { c.publish(0, c.p.msg("zero"), statusOpened) }},
		{name: "status 2 (HalfClosed on the wire)", want: []string{"status", "0x2"},
			do: func(c *hpCtx) { c.publish(c.id, c.p.msg("x"), 2) }},
		{name: "status 0x1FF", want: []string{"status", "0x1ff"},
			do: func(c *hpCtx) { c.publish(c.id, c.p.msg("x"), 0x1FF) }},
		{name: "status 0xFFFFFF07", want: []string{"status"},
			do: func(c *hpCtx) { c.publish(c.id, c.p.msg("x"), 0xFFFFFF07) }},
		{name: "close element with an offset", want: []string{"close", "offset"},
			do: func(c *hpCtx) { c.publish(c.id, c.p.msg("x"), statusClosed) }},
		{name: "receive queue tail 2^32 ahead of head", want: []string{"head", "tail", "apart"},
			do: func(c *hpCtx) { c.p.send.setTail(c.p.send.head() + 1<<32); c.wake() }},
		{name: "receive queue tail just past capacity", want: []string{"apart"},
			do: func(c *hpCtx) { c.p.send.setTail(c.p.send.head() + int64(c.p.send.cap) + 1); c.wake() }},
		{name: "receive queue tail behind head", want: []string{"head", "tail", "apart"},
			do: func(c *hpCtx) { c.p.send.setTail(c.p.send.head() - 1); c.wake() }},
		{name: "receive queue tail negative", want: []string{"apart"},
			do: func(c *hpCtx) { c.p.send.setTail(-1 << 62); c.wake() }},
		{name: "send queue head ahead of tail", want: []string{"IO queue", "head"},
			do: func(c *hpCtx) { c.provokeSend(func() { c.p.recv.setHead(c.p.recv.tail() + 5) }) }},
		{name: "send queue head 2^32 behind tail", want: []string{"IO queue", "apart"},
			do: func(c *hpCtx) { c.provokeSend(func() { c.p.recv.setHead(c.p.recv.tail() - 1<<32) }) }},
		{name: "free list head outside the list", want: []string{"head", "not a slice"},
			do: func(c *hpCtx) {
				c.provokeSend(func() { c.p.setU32(c.p.list(0).header+listHeadOff, huge) })
			}},
		{name: "free list head misaligned", want: []string{"head", "not a slice"},
			do: func(c *hpCtx) {
				c.provokeSend(func() {
					h := c.p.list(0).header + listHeadOff
					c.p.setU32(h, c.p.u32(h)+4)
				})
			}},
		{name: "free slice next outside the list", want: []string{"links", "not a slice"},
			do: func(c *hpCtx) {
				c.provokeSend(func() {
					l := c.p.list(0)
					head := c.p.u32(l.header + listHeadOff)
					c.p.setU32(l.area+head+sliceNextOff, huge)
				})
			}},
		{name: "free slice next misaligned", want: []string{"links", "not a slice"},
			do: func(c *hpCtx) {
				c.provokeSend(func() {
					l := c.p.list(0)
					head := c.p.u32(l.header + listHeadOff)
					c.p.setU32(l.area+head+sliceNextOff, l.stride+12)
				})
			}},
		{name: "free list tail outside the list (victim frees into it)", want: []string{"tail", "not a slice"},
			do: func(c *hpCtx) {
				off := c.p.msg("freed by the victim")
				c.p.setU32(c.p.list(0).header+listTailOff, huge)
				c.publish(c.id, off, statusOpened)
			}},
		// The library reads these fields once, at mapping time; rewriting
		// them later must change nothing.
		{name: "queue cap fields rewritten to 0", survive: hpSurviveRoundTrip,
			do: func(c *hpCtx) { c.p.send.setCapField(0); c.p.recv.setCapField(0) }},
		{name: "queue cap fields rewritten to 0xFFFFFFFF", survive: hpSurviveRoundTrip,
			do: func(c *hpCtx) { c.p.send.setCapField(0xFFFFFFFF); c.p.recv.setCapField(0xFFFFFFFF) }},
		{name: "list count and slice size fields rewritten", survive: hpSurviveRoundTrip,
			do: func(c *hpCtx) {
				for i := range c.p.bm.lists {
					h := c.p.list(i).header
					c.p.setU32(h+listCountOff, 0xFFFFFFFF)
					c.p.setU32(h+listCapOff, 3)
				}
				c.p.setU32(0, 0xFFFF)
				c.p.setU32(4, 0xFFFFFFFF)
			}},
		// The consumer keeps its own head: a rewritten shared head is
		// overwritten by the next pop.
		{name: "receive queue head rewritten past tail", survive: hpSurviveRoundTrip,
			do: func(c *hpCtx) { c.p.send.setHead(c.p.send.tail() + 100) }},
		// Receivers mask the status with 0xFF (PROTOCOL.md §6.3).
		{name: "status 0x100 is data", survive: func(c *hpCtx) error { return c.roundTrip("upper bits", 0x100) },
			do: func(c *hpCtx) {}},
	}
}

// hpExpectClosed waits for the victim to close and checks its error.
func hpExpectClosed(t *testing.T, s *Session, is error, want []string) {
	t.Helper()
	deadline := time.Now().Add(hpTimeout)
	for !s.IsClosed() {
		if time.Now().After(deadline) {
			t.Fatalf("the victim session is still open %v after the corruption", hpTimeout)
		}
		time.Sleep(time.Millisecond)
	}
	err := s.Err()
	t.Logf("victim: %v", err)
	if is == nil {
		is = ErrProtocol
	}
	if !errors.Is(err, ErrSessionClosed) || !errors.Is(err, is) {
		t.Errorf("session error %v: want ErrSessionClosed wrapping %v", err, is)
	}
	msg := strings.ToLower(fmt.Sprint(err))
	for _, w := range want {
		if !strings.Contains(msg, strings.ToLower(w)) {
			t.Errorf("session error %q does not mention %q", err, w)
		}
	}
}

// hpCloseBounded closes s and fails if that hangs.
func hpCloseBounded(t *testing.T, s *Session) {
	done := make(chan struct{})
	go func() {
		s.Close()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(hpTimeout):
		t.Errorf("Session.Close still running after %v", hpTimeout)
	}
}

// hpFinish checks the outcome of a case.
func hpFinish(c *hpCtx, tc hpCase) {
	t := c.t
	t.Helper()
	if tc.survive != nil {
		if err := tc.survive(c); err != nil {
			t.Errorf("after the damage: %v", err)
		}
		if c.victim.IsClosed() {
			t.Errorf("the victim session closed: %v", c.victim.Err())
		}
	} else {
		hpExpectClosed(t, c.victim, tc.is, tc.want)
		hpCheckReleased(c)
		if c.rd != nil {
			select {
			case err := <-c.rd.err:
				if err == nil {
					t.Error("the reader of the closed session returned no error")
				}
			case <-time.After(hpTimeout):
				t.Errorf("a reader of the closed session still blocks after %v", hpTimeout)
			}
		}
	}
	hpCloseBounded(t, c.victim)
	hpCheckReleased(c)
}

// hpCheckReleased checks that a closed victim lets go of its queue region
// soon: nothing may still be polling the queue. A goroutine stuck polling a
// corrupt queue is reported, then freed by making the queue look empty
// again, so that it does not spin for the rest of the run.
func hpCheckReleased(c *hpCtx) {
	t := c.t
	t.Helper()
	if !c.victim.IsClosed() {
		return
	}
	released := func(d time.Duration) bool {
		deadline := time.Now().Add(d)
		for c.victim.queueRegion.refs.Load() > 0 {
			if time.Now().After(deadline) {
				return false
			}
			time.Sleep(time.Millisecond)
		}
		return true
	}
	if released(1500 * time.Millisecond) {
		return
	}
	t.Errorf("BUG: the victim session is closed (%v) but 1.5s later its queue region is still referenced (%d): a reader is stuck in pollFor, looping between stopPolling and drainNow on the corrupt queue", c.victim.Err(), c.victim.queueRegion.refs.Load())
	c.p.send.setTail(c.victim.recvQ.chead.Load())
	if !released(hpTimeout) {
		t.Errorf("the queue region is still referenced after the queue was repaired")
	}
}

func hpModeName(mode MemMapType) string {
	if mode == MemMapTypeMemFd {
		return "v3 memfd"
	}
	return "v2 file"
}

func hpWakeName(reader bool) string {
	if reader {
		return "reader polls"
	}
	return "Polling frame"
}

// ---- hostile client against a real server ----

// hpServerCase sets up a server victim with stream 2 open on both sides.
func hpServerCase(t *testing.T, env *hpServerEnv, mode MemMapType, reader bool) *hpCtx {
	t.Helper()
	p, victim := hpConnectClient(t, env, mode)
	c := &hpCtx{t: t, p: p, victim: victim, id: 2, reader: reader}
	if err := c.roundTrip("hello", 0); err != nil {
		t.Fatalf("valid echo before the damage: %v", err)
	}
	if reader {
		c.waitPolling()
	}
	c.armed = true
	return c
}

func TestHostileClientMemory(t *testing.T) {
	cases := hpMemoryCases()
	cases = append(cases,
		hpCase{name: "data for an unknown stream opens it", do: func(c *hpCtx) {
			c.publish(77, c.p.msg("implicit open"), statusOpened)
		}, survive: func(c *hpCtx) error { return c.expectData(77, "implicit open") }},
		hpCase{name: "close element for an unknown stream is ignored", do: func(c *hpCtx) {
			c.publish(78, 0, statusClosed)
		}, survive: hpSurviveRoundTrip},
	)
	for _, reader := range []bool{false, true} {
		spin := defaultConsumerSpinTime
		if reader {
			spin = hpReaderSpin
		}
		env := hpStartServer(t, spin)
		for _, mode := range hpModes {
			if reader && mode != MemMapTypeMemFd {
				continue // the wake-up path does not depend on the mode
			}
			for _, tc := range cases {
				t.Run(hpModeName(mode)+"/"+hpWakeName(reader)+"/"+tc.name, func(t *testing.T) {
					c := hpServerCase(t, env, mode, reader)
					tc.do(c)
					hpFinish(c, tc)
					env.checkGood(t)
				})
			}
		}
	}
}

func TestHostileClientFrames(t *testing.T) {
	f := func(length uint32, typ byte, payload ...byte) func(c *hpCtx) {
		return func(c *hpCtx) { c.p.write(hpFrame(length, hpMagic, c.p.version, typ, payload...)) }
	}
	poll := func(c *hpCtx) []byte { return hpFrame(8, hpMagic, c.p.version, 1) }
	cases := []hpCase{
		{name: "Polling of length 9", do: f(9, 1, 0), want: []string{"Polling", "9"}},
		{name: "StreamClose of length 13", do: f(13, 2, 0, 0, 0, 2, 0), want: []string{"StreamClose", "13"}},
		{name: "StreamClose of length 8", do: f(8, 2), want: []string{"StreamClose", "8"}},
		{name: "HotRestart of length 15", do: f(15, 8, 0, 0, 0, 0, 0, 0, 1), want: []string{"HotRestart", "15"}},
		{name: "HotRestartAck of length 15", do: f(15, 9, 0, 0, 0, 0, 0, 0, 1), want: []string{"HotRestartAck", "15"}},
		{name: "HotRestart to a server", do: f(16, 8, 0, 0, 0, 0, 0, 0, 0, 1), want: []string{"HotRestart"}},
		{name: "unknown type 10", do: f(8, 10), want: []string{"type", "10"}},
		{name: "unknown type 255", do: f(8, 255), want: []string{"type", "255"}},
		{name: "ShareMemoryByMemfd in the running phase", do: func(c *hpCtx) {
			c.p.write(hpPaths(c.p.version, 5, "/dev/shm/a", "/dev/shm/b"))
		}, want: []string{"ShareMemoryByMemfd"}},
		{name: "AckReadyRecvFD in the running phase", do: f(8, 7), want: []string{"AckReadyRecvFD"}},
		{name: "bad magic mid-stream", do: func(c *hpCtx) {
			b := append(poll(c), hpFrame(12, hpMagic, c.p.version, 2, 0, 0, 0, 99)...)
			c.p.write(append(b, hpFrame(8, 0x7759, c.p.version, 1)...))
		}, want: []string{"magic"}},
		{name: "version 0 mid-stream", do: func(c *hpCtx) {
			c.p.write(append(poll(c), hpFrame(8, hpMagic, 0, 1)...))
		}, want: []string{"version"}},
		{name: "frame split across writes then bad magic", do: func(c *hpCtx) {
			b := append(poll(c), 0, 0, 0, 8, 0x58)
			c.p.write(b[:5])
			time.Sleep(5 * time.Millisecond)
			c.p.write(b[5:])
			time.Sleep(5 * time.Millisecond)
			c.p.write([]byte{0x77, c.p.version, 1})
		}, want: []string{"magic"}},
		{name: "truncated frame then EOF", do: func(c *hpCtx) {
			c.p.write(hpFrame(12, hpMagic, c.p.version, 2, 0, 0))
			c.p.conn.CloseWrite()
		}, is: io.ErrUnexpectedEOF, want: []string{"inside"}},
		{name: "truncated header then EOF", do: func(c *hpCtx) {
			c.p.write(hpFrame(8, hpMagic, c.p.version, 1)[:5])
			c.p.conn.CloseWrite()
		}, is: io.ErrUnexpectedEOF, want: []string{"inside"}},
		{name: "FallbackData larger than MaxFallbackFrameSize", do: func(c *hpCtx) {
			c.p.write(hpFallback(c.p.version, minFallbackFrame+1, 2, 0, "x"))
		}, want: []string{"FallbackData", fmt.Sprint(minFallbackFrame + 1)}},
		{name: "FallbackData of length 0xFFFFFFFF", do: func(c *hpCtx) {
			c.p.write(hpFallback(c.p.version, 0xFFFFFFFF, 2, 0, "x"))
		}, want: []string{"FallbackData", "4294967295"}},
		{name: "FallbackData shorter than its id and status", do: f(12, 3, 0, 0, 0, 2), want: []string{"FallbackData", "12"}},
		{name: "FallbackData for stream id 0", do: func(c *hpCtx) {
			c.p.write(hpFallback(c.p.version, 0, 0, 0, "x"))
		}, want: []string{"stream id 0"}},
		{name: "FallbackData with status 1", do: func(c *hpCtx) {
			c.p.write(hpFallback(c.p.version, 0, 2, 1, "x"))
		}, want: []string{"status"}},
		{name: "FallbackData with status 0x2FF", do: func(c *hpCtx) {
			c.p.write(hpFallback(c.p.version, 0, 2, 0x2FF, "x"))
		}, want: []string{"status"}},
		// Legal frames: the documented behaviour.
		{name: "FallbackData for an unknown stream opens it", do: func(c *hpCtx) {
			c.p.write(hpFallback(c.p.version, 0, 55, 0, "fallback open"))
		}, survive: func(c *hpCtx) error {
			fr, err := c.p.readFrame()
			if err != nil {
				return err
			}
			if fr[7] != 3 || binary.BigEndian.Uint32(fr[8:]) != 55 || string(fr[16:]) != "fallback open" {
				return fmt.Errorf("reply % x, want FallbackData for stream 55", fr)
			}
			return nil
		}},
		{name: "StreamClose for an unknown stream is ignored", do: f(12, 2, 0, 0, 1, 0), survive: hpSurviveRoundTrip},
		{name: "HotRestartAck to a server is ignored", do: f(16, 9, 0, 0, 0, 0, 0, 0, 0, 7), survive: hpSurviveRoundTrip},
		{name: "Polling with an empty queue", do: f(8, 1), survive: hpSurviveRoundTrip},
	}
	env := hpStartServer(t, defaultConsumerSpinTime)
	for _, mode := range hpModes {
		for _, tc := range cases {
			t.Run(hpModeName(mode)+"/"+tc.name, func(t *testing.T) {
				c := hpServerCase(t, env, mode, false)
				tc.do(c)
				hpFinish(c, tc)
				env.checkGood(t)
			})
		}
	}
}

// hpPlans returns an initBuf that lays out the given lists.
func hpPlans(plans ...listPlan) func(buf []byte) {
	return func(buf []byte) { initBufferRegion(buf, plans) }
}

// hpListHeader returns the offset of list i's header in a region laid out
// from the reference sizes at 1 MiB.
func hpListHeader(i int) uint32 {
	plans, _ := planLists(1<<20, ReferenceSliceSizes())
	off := uint32(managerHeaderSize)
	for _, p := range plans[:i] {
		off += listHeaderSize + p.count*(p.sliceCap+sliceHeaderSize)
	}
	return off
}

// TestHostileClientHandshake: regions that cannot be right make Server fail
// with ErrHandshake; the listener's good session is untouched.
func TestHostileClientHandshake(t *testing.T) {
	le := binary.LittleEndian
	qsize := queueRegionSize(64)
	cases := []struct {
		name string
		lay  hpLayout
		want []string
	}{
		{"queue cap field not matching its size", hpLayout{mutate: func(_, q []byte) { le.PutUint32(q, 32) }}, []string{"capacity 32"}},
		{"second queue cap field not matching", hpLayout{mutate: func(_, q []byte) { le.PutUint32(q[len(q)/2:], 128) }}, []string{"server-to-client", "capacity"}},
		{"queue region of odd size", hpLayout{queueSize: qsize + 1}, []string{"queue region"}},
		{"queue region not two whole queues", hpLayout{queueSize: qsize + 2}, []string{"queue region"}},
		{"queue cap not a multiple of 16", hpLayout{queueSize: queueRegionSize(24)}, []string{"multiple of 16"}},
		{"queue region of 16 bytes", hpLayout{queueSize: 16}, []string{"size 16"}},
		{"queue head and tail 2^32 apart", hpLayout{mutate: func(_, q []byte) { le.PutUint64(q[queueTailOff:], 1<<32) }}, []string{"apart"}},
		{"queue tail behind head", hpLayout{mutate: func(_, q []byte) { le.PutUint64(q[queueHeadOff:], 10); le.PutUint64(q[queueTailOff:], 5) }}, []string{"apart"}},
		{"buffer with zero lists", hpLayout{mutate: func(b, _ []byte) { le.PutUint16(b, 0) }}, []string{"no lists"}},
		{"buffer used field beyond the region", hpLayout{mutate: func(b, _ []byte) { le.PutUint32(b[4:], 1<<20) }}, []string{"claims"}},
		{"buffer used field 0xFFFFFFFF", hpLayout{mutate: func(b, _ []byte) { le.PutUint32(b[4:], 0xFFFFFFFF) }}, []string{"claims"}},
		{"buffer list overrunning the region", hpLayout{mutate: func(b, _ []byte) {
			h := hpListHeader(2)
			le.PutUint32(b[h+listCountOff:], 100)
		}}, []string{"past"}},
		{"buffer list count 0xFFFFFFFF", hpLayout{mutate: func(b, _ []byte) {
			h := hpListHeader(0)
			le.PutUint32(b[h+listCountOff:], 0xFFFFFFFF)
			le.PutUint32(b[h+listCapOff:], 0xFFFFFFFC)
		}}, []string{"past"}},
		{"more lists than the used bytes hold", hpLayout{mutate: func(b, _ []byte) { le.PutUint16(b, 200) }}, []string{"outside"}},
		{"list with no slices", hpLayout{mutate: func(b, _ []byte) { le.PutUint32(b[hpListHeader(1)+listCountOff:], 0) }}, []string{"no slices"}},
		{"duplicate slice sizes", hpLayout{initBuf: hpPlans(listPlan{4096, 100}, listPlan{4096, 100})}, []string{"two lists", "4096"}},
		{"slice size not a multiple of 4", hpLayout{initBuf: hpPlans(listPlan{4098, 100})}, []string{"multiple of 4"}},
		{"slice size 0", hpLayout{initBuf: hpPlans(listPlan{0, 100})}, []string{"multiple of 4"}},
		{"buffer region of 16 bytes", hpLayout{bufSize: 16, initBuf: func([]byte) {}}, []string{"size 16"}},
	}
	env := hpStartServer(t, defaultConsumerSpinTime)
	for _, mode := range hpModes {
		for _, tc := range cases {
			t.Run(hpModeName(mode)+"/"+tc.name, func(t *testing.T) {
				r := hpCreate(t, hpConfig(t, mode, 0), mode, tc.lay)
				cli, srv := hpUnixPair(t)
				ch := hpGo(func() (*Session, error) { return Server(srv, env.conf) })
				if _, err := r.handshake(cli, mode); err != nil {
					t.Logf("raw client handshake: %v", err)
				}
				res := hpAwait(t, ch)
				if res.err == nil {
					t.Fatalf("Server accepted the regions")
				}
				t.Logf("victim: %v", res.err)
				if !errors.Is(res.err, ErrHandshake) {
					t.Errorf("Server error %v: want ErrHandshake", res.err)
				}
				msg := strings.ToLower(res.err.Error())
				for _, w := range tc.want {
					if !strings.Contains(msg, strings.ToLower(w)) {
						t.Errorf("Server error %q does not mention %q", res.err, w)
					}
				}
				cli.SetReadDeadline(time.Now().Add(hpTimeout))
				if _, err := io.Copy(io.Discard, cli); err != nil {
					t.Errorf("connection not closed after the failed handshake: %v", err)
				}
				env.checkGood(t)
			})
		}
	}
}

func hpUnixPair(t *testing.T) (dialed, accepted *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conn := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "hp-socketpair")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c.(*net.UnixConn)
	}
	return conn(fds[0]), conn(fds[1])
}

// ---- hostile server against a real client ----

// hpClientCase sets up a client victim with one stream open on both sides
// and a reader blocked on it.
func hpClientCase(t *testing.T, mode MemMapType, reader bool) *hpCtx {
	t.Helper()
	spin := defaultConsumerSpinTime
	if reader {
		spin = hpReaderSpin
	}
	p, victim := hpAcceptVictim(t, mode, spin)
	st, err := victim.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	st.SetDeadline(time.Now().Add(3 * hpTimeout))
	if _, err := st.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	e, err := p.waitElem()
	if err != nil {
		t.Fatal(err)
	}
	if got, err := p.readMsg(e.offset); err != nil || got != "ping" || e.id != st.ID() {
		t.Fatalf("raw server got %+v %q %v, want stream %d \"ping\"", e, got, err, st.ID())
	}
	c := &hpCtx{t: t, p: p, victim: victim, id: st.ID(), reader: reader, st: st}
	c.publish(c.id, p.msg("pong"), statusOpened)
	got := make([]byte, 4)
	if _, err := io.ReadFull(st, got); err != nil || string(got) != "pong" {
		t.Fatalf("victim read %q, %v; want \"pong\"", got, err)
	}
	c.rd = hpStartReader(st)
	if reader {
		c.waitPolling()
	}
	c.armed = true
	return c
}

func TestHostileServerMemory(t *testing.T) {
	cases := hpMemoryCases()
	cases = append(cases,
		hpCase{name: "data for an unknown stream is dropped", do: func(c *hpCtx) {
			c.publish(99, c.p.msg("stray"), statusOpened)
		}, survive: hpSurviveRoundTrip},
		hpCase{name: "close element for an unknown stream is ignored", do: func(c *hpCtx) {
			c.publish(98, 0, statusClosed)
		}, survive: hpSurviveRoundTrip},
	)
	env := hpStartServer(t, defaultConsumerSpinTime)
	for _, reader := range []bool{false, true} {
		for _, mode := range hpModes {
			if reader && mode != MemMapTypeMemFd {
				continue // the wake-up path does not depend on the mode
			}
			for _, tc := range cases {
				t.Run(hpModeName(mode)+"/"+hpWakeName(reader)+"/"+tc.name, func(t *testing.T) {
					c := hpClientCase(t, mode, reader)
					tc.do(c)
					hpFinish(c, tc)
					env.checkGood(t)
				})
			}
		}
	}
}

// TestHostileServerStrayData: data for a stream the client never opened is
// freed and dropped (PROTOCOL.md §6.2).
func TestHostileServerStrayData(t *testing.T) {
	env := hpStartServer(t, defaultConsumerSpinTime)
	for _, mode := range hpModes {
		t.Run(hpModeName(mode), func(t *testing.T) {
			c := hpClientCase(t, mode, false)
			before := c.p.bm.freeCounts()[0]
			c.publish(99, c.p.msg("stray"), statusOpened)
			deadline := time.Now().Add(hpTimeout)
			for c.p.bm.freeCounts()[0] != before {
				if time.Now().After(deadline) {
					t.Fatalf("free count of list 0 is %d, want %d back: the stray slice was not freed", c.p.bm.freeCounts()[0], before)
				}
				time.Sleep(time.Millisecond)
			}
			c.p.write(hpFallback(c.p.version, 0, 97, 0, "stray fallback"))
			if err := hpSurviveRoundTrip(c); err != nil {
				t.Error(err)
			}
			if c.victim.IsClosed() {
				t.Errorf("victim closed: %v", c.victim.Err())
			}
			hpCloseBounded(t, c.victim)
			env.checkGood(t)
		})
	}
}

func TestHostileServerFrames(t *testing.T) {
	f := func(length uint32, typ byte, payload ...byte) func(c *hpCtx) {
		return func(c *hpCtx) { c.p.write(hpFrame(length, hpMagic, c.p.version, typ, payload...)) }
	}
	cases := []hpCase{
		{name: "Polling of length 9", do: f(9, 1, 0), want: []string{"Polling", "9"}},
		{name: "StreamClose of length 13", do: f(13, 2, 0, 0, 0, 2, 0), want: []string{"StreamClose", "13"}},
		{name: "HotRestart of length 15", do: f(15, 8, 0, 0, 0, 0, 0, 0, 1), want: []string{"HotRestart", "15"}},
		{name: "HotRestartAck to a client", do: f(16, 9, 0, 0, 0, 0, 0, 0, 0, 1), want: []string{"HotRestartAck"}},
		{name: "unknown type 10", do: f(8, 10), want: []string{"type", "10"}},
		{name: "AckShareMemory in the running phase", do: f(8, 6), want: []string{"AckShareMemory"}},
		{name: "bad magic mid-stream", do: func(c *hpCtx) {
			c.p.write(append(hpFrame(8, hpMagic, c.p.version, 1), hpFrame(8, 0x5877, c.p.version, 1)...))
		}, want: []string{"magic"}},
		{name: "version 0 mid-stream", do: func(c *hpCtx) {
			c.p.write(append(hpFrame(8, hpMagic, c.p.version, 1), hpFrame(8, hpMagic, 0, 1)...))
		}, want: []string{"version"}},
		{name: "truncated frame then EOF", do: func(c *hpCtx) {
			c.p.write(hpFallback(c.p.version, 100, c.id, 0, "short"))
			c.p.conn.CloseWrite()
		}, is: io.ErrUnexpectedEOF, want: []string{"inside"}},
		{name: "FallbackData larger than MaxFallbackFrameSize", do: func(c *hpCtx) {
			c.p.write(hpFallback(c.p.version, minFallbackFrame+1, c.id, 0, "x"))
		}, want: []string{"FallbackData", fmt.Sprint(minFallbackFrame + 1)}},
		{name: "FallbackData for stream id 0", do: func(c *hpCtx) {
			c.p.write(hpFallback(c.p.version, 0, 0, 0, "x"))
		}, want: []string{"stream id 0"}},
		{name: "FallbackData with status 1", do: func(c *hpCtx) {
			c.p.write(hpFallback(c.p.version, 0, c.id, 1, "x"))
		}, want: []string{"status"}},
		{name: "HotRestart is ignored by the client", do: f(16, 8, 0, 0, 0, 0, 0, 0, 0, 1), survive: hpSurviveRoundTrip},
		{name: "StreamClose for an unknown stream is ignored", do: f(12, 2, 0, 0, 1, 0), survive: hpSurviveRoundTrip},
		{name: "FallbackData on the open stream", do: func(c *hpCtx) {
			c.p.write(hpFallback(c.p.version, 0, c.id, 0, "fallback data"))
		}, survive: func(c *hpCtx) error { return c.expectData(c.id, "fallback data") }},
	}
	env := hpStartServer(t, defaultConsumerSpinTime)
	for _, mode := range hpModes {
		for _, tc := range cases {
			t.Run(hpModeName(mode)+"/"+tc.name, func(t *testing.T) {
				c := hpClientCase(t, mode, false)
				tc.do(c)
				hpFinish(c, tc)
				env.checkGood(t)
			})
		}
	}
}

// TestHostileServerHandshake: bad replies during a version 3 handshake make
// Dial fail with ErrHandshake.
func TestHostileServerHandshake(t *testing.T) {
	read := func(c *net.UnixConn) error {
		h, err := hpReadN(c, 8)
		if err != nil {
			return err
		}
		if n := binary.BigEndian.Uint32(h); n > 8 {
			_, err = hpReadN(c, int(n)-8)
		}
		return err
	}
	write := func(c *net.UnixConn, b []byte) error { _, err := c.Write(b); return err }
	toPaths := func(c *net.UnixConn) error {
		if err := read(c); err != nil {
			return err
		}
		if err := write(c, hpFrame(8, hpMagic, 3, 4)); err != nil {
			return err
		}
		return read(c)
	}
	toFds := func(c *net.UnixConn) error {
		if err := toPaths(c); err != nil {
			return err
		}
		if err := write(c, hpFrame(8, hpMagic, 3, 7)); err != nil {
			return err
		}
		fds, err := hpRecvFds(c)
		closeFds(fds...)
		return err
	}
	cases := []struct {
		name   string
		script func(c *net.UnixConn) error
		want   []string
	}{
		{"ExchangeProtoVersion reply of 12 bytes", func(c *net.UnixConn) error {
			if err := read(c); err != nil {
				return err
			}
			return write(c, hpFrame(12, hpMagic, 3, 4, 0, 0, 0, 0))
		}, []string{"ExchangeProtoVersion", "12"}},
		{"ExchangeProtoVersion reply with version 2", func(c *net.UnixConn) error {
			if err := read(c); err != nil {
				return err
			}
			return write(c, hpFrame(8, hpMagic, 2, 4))
		}, []string{"version 2"}},
		{"AckReadyRecvFD with bad magic", func(c *net.UnixConn) error {
			if err := toPaths(c); err != nil {
				return err
			}
			return write(c, hpFrame(8, 0xBEEF, 3, 7))
		}, []string{"magic"}},
		{"unknown type instead of AckReadyRecvFD", func(c *net.UnixConn) error {
			if err := toPaths(c); err != nil {
				return err
			}
			return write(c, hpFrame(8, hpMagic, 3, 10))
		}, []string{"type"}},
		{"Polling instead of AckShareMemory", func(c *net.UnixConn) error {
			if err := toFds(c); err != nil {
				return err
			}
			return write(c, hpFrame(8, hpMagic, 3, 1))
		}, []string{"AckShareMemory"}},
		{"AckShareMemory of 9 bytes", func(c *net.UnixConn) error {
			if err := toFds(c); err != nil {
				return err
			}
			return write(c, hpFrame(9, hpMagic, 3, 6, 0))
		}, []string{"AckShareMemory", "9"}},
	}
	env := hpStartServer(t, defaultConsumerSpinTime)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			conf := hpConfig(t, MemMapTypeMemFd, 0)
			sock := filepath.Join(t.TempDir(), "raw.sock")
			ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			ch := hpGo(func() (*Session, error) { return Dial("unix", sock, conf) })
			ln.SetDeadline(time.Now().Add(hpTimeout))
			c, err := ln.AcceptUnix()
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(hpTimeout))
			if err := tc.script(c); err != nil {
				t.Fatalf("raw server: %v", err)
			}
			res := hpAwait(t, ch)
			if res.err == nil {
				t.Fatal("Dial succeeded")
			}
			t.Logf("victim: %v", res.err)
			if !errors.Is(res.err, ErrHandshake) {
				t.Errorf("Dial error %v: want ErrHandshake", res.err)
			}
			msg := strings.ToLower(res.err.Error())
			for _, w := range tc.want {
				if !strings.Contains(msg, strings.ToLower(w)) {
					t.Errorf("Dial error %q does not mention %q", res.err, w)
				}
			}
			env.checkGood(t)
		})
	}
}

// TestHostileListenerStillAccepts: after all that, a new client can still
// connect to a listener that served hostile clients.
func TestHostileListenerStillAccepts(t *testing.T) {
	env := hpStartServer(t, defaultConsumerSpinTime)
	for _, mode := range hpModes {
		c := hpServerCase(t, env, mode, false)
		c.publish(c.id, 0xFFFFFFF0, statusOpened)
		hpExpectClosed(t, c.victim, nil, []string{"offset"})
	}
	s, err := Dial("unix", env.addr, hpConfig(t, MemMapTypeDevShmFile, 0))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := hpEcho(s, "new client"); err != nil {
		t.Fatal(err)
	}
	env.checkGood(t)
}

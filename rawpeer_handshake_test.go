package shmipc

// Raw peers after a correct handshake: a raw client that creates its own
// regions and hands them to a real server, and a raw server that maps the
// regions of a real client.

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/shm"
	"golang.org/x/sys/unix"
)

// ---- hostile client: regions and handshake ----

// rawRegionSeq numbers the regions raw clients create, for unique names.
var rawRegionSeq atomic.Uint32

// rawRegions are the regions a raw client made with the package's own
// helpers, mapped, with their names and descriptors.
type rawRegions struct {
	queuePath, bufPath string
	bufFd, queueFd     int
	buf, queue         *shm.Region
}

// rawLayout describes the regions a hostile client creates. Zero values give
// the valid regions of the configuration.
type rawLayout struct {
	bufSize   int
	queueSize int
	initBuf   func(buf []byte)    // nil: the valid layout of the configuration
	mutate    func(buf, q []byte) // damage applied before the handshake
}

// createRawRegions creates and maps the two regions of a raw client under
// the configuration's path prefix and lays them out as lay says. They are
// unmapped, closed and removed when the test ends.
func createRawRegions(t *testing.T, conf *Config, mode MemMapType, lay rawLayout) *rawRegions {
	t.Helper()
	base := fmt.Sprintf("%s_%d", conf.ShareMemoryPathPrefix, rawRegionSeq.Add(1))
	r := &rawRegions{queuePath: base + "_queue_0", bufPath: base + "_buffer", bufFd: -1, queueFd: -1}
	bufSize, qSize := lay.bufSize, lay.queueSize
	if bufSize == 0 {
		bufSize = int(conf.ShareMemoryBufferCap)
	}
	if qSize == 0 {
		qSize = shm.QueueRegionSize(conf.QueueCap)
	}
	var err error
	if r.buf, r.bufFd, err = createRegion(mode, r.bufPath, bufSize); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { shm.CloseFds(r.bufFd); r.buf.Release(); os.Remove(r.bufPath) })
	if r.queue, r.queueFd, err = createRegion(mode, r.queuePath, qSize); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { shm.CloseFds(r.queueFd); r.queue.Release(); os.Remove(r.queuePath) })
	if lay.initBuf != nil {
		lay.initBuf(r.buf.Mem())
	} else {
		plans, err := planLists(conf.ShareMemoryBufferCap, conf.BufferSliceSizes)
		if err != nil {
			t.Fatal(err)
		}
		shm.InitBuffer(r.buf.Mem(), plans)
	}
	if half := qSize / 2; half >= queueHeaderSize {
		shm.InitQueues(r.queue.Mem(), uint32((half-queueHeaderSize)/queueElemSize))
	}
	if lay.mutate != nil {
		lay.mutate(r.buf.Mem(), r.queue.Mem())
	}
	return r
}

// handshake runs the client side: version 2 with file paths, or version 3
// with memfds (docs/protocol.md §4.1, §4.2), which needs a Unix connection. It
// returns the version in use.
func (r *rawRegions) handshake(c net.Conn, mode MemMapType) (byte, error) {
	c.SetDeadline(time.Now().Add(peerTimeout))
	defer c.SetDeadline(time.Time{})
	if mode == MemMapTypeDevShmFile {
		_, err := c.Write(rawPathFrame(2, 0, r.queuePath, r.bufPath))
		return 2, err
	}
	expect := func(typ byte) error {
		h, err := readN(c, 8)
		if err != nil {
			return err
		}
		if want := rawFrame(8, rawMagic, 3, typ); !bytes.Equal(h, want) {
			return fmt.Errorf("got % x, want % x", h, want)
		}
		return nil
	}
	if _, err := c.Write(rawFrame(8, rawMagic, 3, 4)); err != nil {
		return 3, err
	}
	if err := expect(4); err != nil {
		return 3, err
	}
	if _, err := c.Write(rawPathFrame(3, 5, r.queuePath, r.bufPath)); err != nil {
		return 3, err
	}
	if err := expect(7); err != nil {
		return 3, err
	}
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return 3, fmt.Errorf("memfds cannot be passed over %s", c.LocalAddr().Network())
	}
	if _, _, err := uc.WriteMsgUnix([]byte{0}, unix.UnixRights(r.bufFd, r.queueFd), nil); err != nil {
		return 3, err
	}
	return 3, expect(6)
}

// connectRawClient makes a hostile client with valid regions, hands them to
// the listener and returns it with the server session it got.
func connectRawClient(t *testing.T, env *testServer, mode MemMapType) (*rawPeer, *Session) {
	t.Helper()
	p, _, victim := connectRawClientRegions(t, env, mode)
	return p, victim
}

// connectRawClientRegions is connectRawClient that also returns the regions.
func connectRawClientRegions(t *testing.T, env *testServer, mode MemMapType) (*rawPeer, *rawRegions, *Session) {
	t.Helper()
	return connectRawClientLayout(t, env, mode, rawLayout{})
}

// connectRawClientLayout is connectRawClientRegions with regions laid out
// as layout says.
func connectRawClientLayout(t *testing.T, env *testServer, mode MemMapType, layout rawLayout) (*rawPeer, *rawRegions, *Session) {
	t.Helper()
	conf := peerConfig(t, mode, 0)
	r := createRawRegions(t, conf, mode, layout)
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
	return rawPeerOf(t, c, v, r, conf), r, victim
}

// rawPeerOf is the raw client of regions r after its handshake on c.
func rawPeerOf(t *testing.T, c *net.UnixConn, version byte, r *rawRegions, conf *Config) *rawPeer {
	t.Helper()
	bm, err := shm.NewBuffer(r.buf, true)
	if err != nil {
		t.Fatal(err)
	}
	half := len(r.queue.Mem()) / 2
	return &rawPeer{
		t: t, conn: c, version: version, buf: r.buf.Mem(), bm: bm, lists: rawLists(r.buf.Mem()),
		send: rawQueue{mem: r.queue.Mem()[:half], cap: conf.QueueCap},
		recv: rawQueue{mem: r.queue.Mem()[half:], cap: conf.QueueCap},
	}
}

func rawMmap(fd int) ([]byte, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, err
	}
	return unix.Mmap(fd, 0, int(st.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
}

// serveRawHandshake plays a correct server handshake and maps the client's
// regions itself. Memfds need a Unix connection.
func serveRawHandshake(c net.Conn, mode MemMapType) (buf, q []byte, version byte, err error) {
	c.SetDeadline(time.Now().Add(peerTimeout))
	defer c.SetDeadline(time.Time{})
	readPaths := func(h []byte) (string, string, error) {
		p, err := readN(c, int(binary.BigEndian.Uint32(h))-8)
		if err != nil {
			return "", "", err
		}
		return decodeRawPaths(p)
	}
	h, err := readN(c, 8)
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
		if buf, err = rawMmap(fds[0]); err != nil {
			return nil, nil, 0, err
		}
		q, err = rawMmap(fds[1])
		return buf, q, 2, err
	}
	if !bytes.Equal(h, rawFrame(8, rawMagic, 3, 4)) {
		return nil, nil, 0, fmt.Errorf("first header % x", h)
	}
	if _, err := c.Write(rawFrame(8, rawMagic, 3, 4)); err != nil {
		return nil, nil, 0, err
	}
	if h, err = readN(c, 8); err != nil || h[7] != 5 {
		return nil, nil, 0, fmt.Errorf("path header % x: %v", h, err)
	}
	if _, _, err := readPaths(h); err != nil {
		return nil, nil, 0, err
	}
	if _, err := c.Write(rawFrame(8, rawMagic, 3, 7)); err != nil {
		return nil, nil, 0, err
	}
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return nil, nil, 0, fmt.Errorf("memfds cannot be received over %s", c.LocalAddr().Network())
	}
	fds, err := rawRecvFds(uc)
	if err != nil {
		return nil, nil, 0, err
	}
	defer shm.CloseFds(fds...)
	if len(fds) != 2 {
		return nil, nil, 0, fmt.Errorf("%d fds", len(fds))
	}
	if buf, err = rawMmap(fds[0]); err != nil {
		return nil, nil, 0, err
	}
	if q, err = rawMmap(fds[1]); err != nil {
		return buf, nil, 0, err
	}
	_, err = c.Write(rawFrame(8, rawMagic, 3, 6))
	return buf, q, 3, err
}

func rawRecvFds(c *net.UnixConn) ([]int, error) {
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

// listenRaw listens for the connection of a real client to a raw server on
// a socket of the test's own, until the test ends.
func listenRaw(t *testing.T) (ln *net.UnixListener, sock string) {
	t.Helper()
	sock = filepath.Join(t.TempDir(), "raw.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln, sock
}

// acceptRaw accepts the next connection on ln within peerTimeout; it is
// closed when the test ends.
func acceptRaw(t *testing.T, ln *net.UnixListener) *net.UnixConn {
	t.Helper()
	ln.SetDeadline(time.Now().Add(peerTimeout))
	c, err := ln.AcceptUnix()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// mapRawClient plays a correct server handshake on c (serveRawHandshake)
// and keeps the client's regions mapped until the test ends.
func mapRawClient(t *testing.T, c *net.UnixConn, mode MemMapType) (buf, q []byte, version byte) {
	t.Helper()
	buf, q, version, err := serveRawHandshake(c, mode)
	for _, m := range [][]byte{buf, q} {
		if m != nil {
			t.Cleanup(func() { unix.Munmap(m) })
		}
	}
	if err != nil {
		t.Fatalf("raw server handshake: %v", err)
	}
	return buf, q, version
}

// acceptRawVictim starts a real client (Dial) against a raw server, which
// completes a correct handshake. It returns the raw server's peer and the
// client session.
func acceptRawVictim(t *testing.T, mode MemMapType, spin time.Duration) (*rawPeer, *Session) {
	t.Helper()
	return acceptRawVictimWith(t, mode, spin, nil)
}

// acceptRawVictimWith is acceptRawVictim with the client's configuration
// changed by edit first.
func acceptRawVictimWith(t *testing.T, mode MemMapType, spin time.Duration, edit func(*Config)) (*rawPeer, *Session) {
	t.Helper()
	conf := peerConfig(t, mode, spin)
	if edit != nil {
		edit(conf)
	}
	ln, sock := listenRaw(t)
	ch := startHandshake(func() (*Session, error) { return Dial("unix", sock, conf) })
	c := acceptRaw(t, ln)
	buf, q, v := mapRawClient(t, c, mode)
	res := awaitHandshake(t, ch, peerTimeout)
	if res.err != nil {
		t.Fatalf("Dial: %v", res.err)
	}
	bm, err := shm.NewBuffer(shm.RegionOf(buf), false)
	if err != nil {
		t.Fatal(err)
	}
	half := len(q) / 2
	qcap := uint32((half - queueHeaderSize) / queueElemSize)
	p := &rawPeer{
		t: t, conn: c, version: v, buf: buf, bm: bm, lists: rawLists(buf),
		send: rawQueue{mem: q[half:], cap: qcap},
		recv: rawQueue{mem: q[:half], cap: qcap},
	}
	return p, res.s
}

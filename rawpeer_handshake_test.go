package shmipc

// Raw peers after a correct handshake: a raw client that creates its own
// regions and hands them to a real server, and a raw server that maps the
// regions of a real client.

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

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

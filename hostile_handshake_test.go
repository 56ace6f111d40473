package shmipc

// Hostile handshakes: a raw client offers regions that cannot be right, a
// raw server answers the version 3 handshake wrongly; and a listener that
// served hostile clients still accepts good ones.

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

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

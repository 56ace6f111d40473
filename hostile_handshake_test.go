package shmipc

// Hostile handshakes: a raw client offers regions that cannot be right, a
// raw server answers the version 3 handshake wrongly; and a listener that
// served hostile clients still accepts good ones.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/shm"
)

// hpPlans returns an initBuf that lays out the given lists.
func hpPlans(plans ...shm.ListPlan) func(buf []byte) {
	return func(buf []byte) { shm.InitBuffer(buf, plans) }
}

// hpListHeader returns the offset of list i's header in a region laid out
// from the reference sizes at 1 MiB.
func hpListHeader(i int) uint32 {
	plans, _ := planLists(1<<20, ReferenceSliceSizes())
	off := uint32(shm.BufferHeaderSize)
	for _, p := range plans[:i] {
		off += shm.ListHeaderSize + p.Count*(p.SliceCap+shm.SliceHeaderSize)
	}
	return off
}

// TestHostileClientHandshake: regions that cannot be right make Server fail
// with ErrHandshake; the listener's good session is untouched.
func TestHostileClientHandshake(t *testing.T) {
	le := binary.LittleEndian
	qsize := shm.QueueRegionSize(64)
	cases := []struct {
		name string
		lay  rawLayout
		want []string
	}{
		{"queue cap field not matching its size", rawLayout{mutate: func(_, q []byte) { le.PutUint32(q, 32) }}, []string{"capacity 32"}},
		{"second queue cap field not matching", rawLayout{mutate: func(_, q []byte) { le.PutUint32(q[len(q)/2:], 128) }}, []string{"server-to-client", "capacity"}},
		{"queue region of odd size", rawLayout{queueSize: qsize + 1}, []string{"queue region"}},
		{"queue region not two whole queues", rawLayout{queueSize: qsize + 2}, []string{"queue region"}},
		{"queue cap not a multiple of 16", rawLayout{queueSize: shm.QueueRegionSize(24)}, []string{"multiple of 16"}},
		{"queue region of 16 bytes", rawLayout{queueSize: 16}, []string{"size 16"}},
		{"queue head and tail 2^32 apart", rawLayout{mutate: func(_, q []byte) { le.PutUint64(q[queueTailOff:], 1<<32) }}, []string{"apart"}},
		{"queue tail behind head", rawLayout{mutate: func(_, q []byte) { le.PutUint64(q[queueHeadOff:], 10); le.PutUint64(q[queueTailOff:], 5) }}, []string{"apart"}},
		{"buffer with zero lists", rawLayout{mutate: func(b, _ []byte) { le.PutUint16(b, 0) }}, []string{"no lists"}},
		{"buffer used field beyond the region", rawLayout{mutate: func(b, _ []byte) { le.PutUint32(b[4:], 1<<20) }}, []string{"claims"}},
		{"buffer used field 0xFFFFFFFF", rawLayout{mutate: func(b, _ []byte) { le.PutUint32(b[4:], 0xFFFFFFFF) }}, []string{"claims"}},
		{"buffer list overrunning the region", rawLayout{mutate: func(b, _ []byte) {
			h := hpListHeader(2)
			le.PutUint32(b[h+listCountOff:], 100)
		}}, []string{"past"}},
		{"buffer list count 0xFFFFFFFF", rawLayout{mutate: func(b, _ []byte) {
			h := hpListHeader(0)
			le.PutUint32(b[h+listCountOff:], 0xFFFFFFFF)
			le.PutUint32(b[h+listCapOff:], 0xFFFFFFFC)
		}}, []string{"past"}},
		{"more lists than the used bytes hold", rawLayout{mutate: func(b, _ []byte) { le.PutUint16(b, 200) }}, []string{"outside"}},
		{"list with no slices", rawLayout{mutate: func(b, _ []byte) { le.PutUint32(b[hpListHeader(1)+listCountOff:], 0) }}, []string{"no slices"}},
		{"duplicate slice sizes", rawLayout{initBuf: hpPlans(shm.ListPlan{SliceCap: 4096, Count: 100}, shm.ListPlan{SliceCap: 4096, Count: 100})}, []string{"two lists", "4096"}},
		{"slice size not a multiple of 4", rawLayout{initBuf: hpPlans(shm.ListPlan{SliceCap: 4098, Count: 100})}, []string{"multiple of 4"}},
		{"slice size 0", rawLayout{initBuf: hpPlans(shm.ListPlan{SliceCap: 0, Count: 100})}, []string{"multiple of 4"}},
		{"buffer region of 16 bytes", rawLayout{bufSize: 16, initBuf: func([]byte) {}}, []string{"size 16"}},
	}
	env := startTestServer(t, defaultConsumerSpinTime)
	for _, mode := range bothModes {
		for _, tc := range cases {
			t.Run(modeName(mode)+"/"+tc.name, func(t *testing.T) {
				r := createRawRegions(t, peerConfig(t, mode, 0), mode, tc.lay)
				cli, srv := unixPair(t)
				ch := startHandshake(func() (*Session, error) { return Server(srv, env.conf) })
				if _, err := r.handshake(cli, mode); err != nil {
					t.Logf("raw client handshake: %v", err)
				}
				res := awaitHandshake(t, ch, peerTimeout)
				if res.err == nil {
					t.Fatalf("Server accepted the regions")
				}
				checkVictimError(t, "Server error", res.err, ErrHandshake, tc.want)
				cli.SetReadDeadline(time.Now().Add(peerTimeout))
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
		h, err := readN(c, 8)
		if err != nil {
			return err
		}
		if n := binary.BigEndian.Uint32(h); n > 8 {
			_, err = readN(c, int(n)-8)
		}
		return err
	}
	write := func(c *net.UnixConn, b []byte) error { _, err := c.Write(b); return err }
	toPaths := func(c *net.UnixConn) error {
		if err := read(c); err != nil {
			return err
		}
		if err := write(c, rawFrame(8, rawMagic, 3, 4)); err != nil {
			return err
		}
		return read(c)
	}
	toFds := func(c *net.UnixConn) error {
		if err := toPaths(c); err != nil {
			return err
		}
		if err := write(c, rawFrame(8, rawMagic, 3, 7)); err != nil {
			return err
		}
		fds, err := rawRecvFds(c)
		shm.CloseFds(fds...)
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
			return write(c, rawFrame(12, rawMagic, 3, 4, 0, 0, 0, 0))
		}, []string{"ExchangeProtoVersion", "12"}},
		{"ExchangeProtoVersion reply with version 2", func(c *net.UnixConn) error {
			if err := read(c); err != nil {
				return err
			}
			return write(c, rawFrame(8, rawMagic, 2, 4))
		}, []string{"version 2"}},
		{"AckReadyRecvFD with bad magic", func(c *net.UnixConn) error {
			if err := toPaths(c); err != nil {
				return err
			}
			return write(c, rawFrame(8, 0xBEEF, 3, 7))
		}, []string{"magic"}},
		{"unknown type instead of AckReadyRecvFD", func(c *net.UnixConn) error {
			if err := toPaths(c); err != nil {
				return err
			}
			return write(c, rawFrame(8, rawMagic, 3, 10))
		}, []string{"type"}},
		{"Polling instead of AckShareMemory", func(c *net.UnixConn) error {
			if err := toFds(c); err != nil {
				return err
			}
			return write(c, rawFrame(8, rawMagic, 3, 1))
		}, []string{"AckShareMemory"}},
		{"AckShareMemory of 9 bytes", func(c *net.UnixConn) error {
			if err := toFds(c); err != nil {
				return err
			}
			return write(c, rawFrame(9, rawMagic, 3, 6, 0))
		}, []string{"AckShareMemory", "9"}},
		// A server that goes away mid-handshake: the client reports the end
		// of the connection (io.EOF) and what it was waiting for.
		{"closed instead of ExchangeProtoVersion", func(c *net.UnixConn) error {
			if err := read(c); err != nil {
				return err
			}
			return c.Close()
		}, []string{"ExchangeProtoVersion", "EOF"}},
		{"closed instead of AckReadyRecvFD", func(c *net.UnixConn) error {
			if err := toPaths(c); err != nil {
				return err
			}
			return c.Close()
		}, []string{"AckReadyRecvFD", "EOF"}},
		{"closed instead of AckShareMemory", func(c *net.UnixConn) error {
			if err := toFds(c); err != nil {
				return err
			}
			return c.Close()
		}, []string{"AckShareMemory", "EOF"}},
	}
	env := startTestServer(t, defaultConsumerSpinTime)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			conf := peerConfig(t, MemMapTypeMemFd, 0)
			ln, sock := listenRaw(t)
			ch := startHandshake(func() (*Session, error) { return Dial("unix", sock, conf) })
			c := acceptRaw(t, ln)
			c.SetDeadline(time.Now().Add(peerTimeout))
			if err := tc.script(c); err != nil {
				t.Fatalf("raw server: %v", err)
			}
			res := awaitHandshake(t, ch, peerTimeout)
			if res.err == nil {
				t.Fatal("Dial succeeded")
			}
			checkVictimError(t, "Dial error", res.err, ErrHandshake, tc.want)
			if strings.Contains(tc.name, "closed") && !errors.Is(res.err, io.EOF) {
				t.Errorf("Dial error %v: want it to wrap io.EOF", res.err)
			}
			env.checkGood(t)
		})
	}
}

// TestHostileListenerStillAccepts: after all that, a new client can still
// connect to a listener that served hostile clients.
func TestHostileListenerStillAccepts(t *testing.T) {
	env := startTestServer(t, defaultConsumerSpinTime)
	for _, mode := range bothModes {
		c := hpServerCase(t, env, mode, false)
		c.publish(c.id, 0xFFFFFFF0, shm.StatusOpened)
		expectClosedWith(t, c.victim, nil, []string{"offset"})
	}
	s, err := Dial("unix", env.addr, peerConfig(t, MemMapTypeDevShmFile, 0))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := echoRoundTrip(s, "new client"); err != nil {
		t.Fatal(err)
	}
	env.checkGood(t)
}

// Hostile socket frames: wrong lengths, unknown types, frames of the wrong
// phase, bad magic or version mid-stream, truncation and malformed
// FallbackData, against a real server and a real client.

func TestHostileClientFrames(t *testing.T) {
	f := func(length uint32, typ byte, payload ...byte) func(c *hpCtx) {
		return func(c *hpCtx) { c.p.write(rawFrame(length, rawMagic, c.p.version, typ, payload...)) }
	}
	poll := func(c *hpCtx) []byte { return rawFrame(8, rawMagic, c.p.version, 1) }
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
			c.p.write(rawPathFrame(c.p.version, 5, "/dev/shm/a", "/dev/shm/b"))
		}, want: []string{"ShareMemoryByMemfd"}},
		{name: "AckReadyRecvFD in the running phase", do: f(8, 7), want: []string{"AckReadyRecvFD"}},
		{name: "bad magic mid-stream", do: func(c *hpCtx) {
			b := append(poll(c), rawFrame(12, rawMagic, c.p.version, 2, 0, 0, 0, 99)...)
			c.p.write(append(b, rawFrame(8, 0x7759, c.p.version, 1)...))
		}, want: []string{"magic"}},
		{name: "version 0 mid-stream", do: func(c *hpCtx) {
			c.p.write(append(poll(c), rawFrame(8, rawMagic, 0, 1)...))
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
			c.p.write(rawFrame(12, rawMagic, c.p.version, 2, 0, 0))
			c.p.conn.CloseWrite()
		}, is: io.ErrUnexpectedEOF, want: []string{"inside"}},
		{name: "truncated header then EOF", do: func(c *hpCtx) {
			c.p.write(rawFrame(8, rawMagic, c.p.version, 1)[:5])
			c.p.conn.CloseWrite()
		}, is: io.ErrUnexpectedEOF, want: []string{"inside"}},
		{name: "FallbackData larger than MaxFallbackFrameSize", do: func(c *hpCtx) {
			c.p.write(rawFallbackFrame(c.p.version, minFallbackFrame+1, 2, 0, "x"))
		}, want: []string{"FallbackData", fmt.Sprint(minFallbackFrame + 1)}},
		{name: "FallbackData of length 0xFFFFFFFF", do: func(c *hpCtx) {
			c.p.write(rawFallbackFrame(c.p.version, 0xFFFFFFFF, 2, 0, "x"))
		}, want: []string{"FallbackData", "4294967295"}},
		{name: "FallbackData shorter than its id and status", do: f(12, 3, 0, 0, 0, 2), want: []string{"FallbackData", "12"}},
		{name: "FallbackData for stream id 0", do: func(c *hpCtx) {
			c.p.write(rawFallbackFrame(c.p.version, 0, 0, 0, "x"))
		}, want: []string{"stream id 0"}},
		{name: "FallbackData with status 1", do: func(c *hpCtx) {
			c.p.write(rawFallbackFrame(c.p.version, 0, 2, 1, "x"))
		}, want: []string{"status"}},
		{name: "FallbackData with status 0x2FF", do: func(c *hpCtx) {
			c.p.write(rawFallbackFrame(c.p.version, 0, 2, 0x2FF, "x"))
		}, want: []string{"status"}},
		// Legal frames: the documented behaviour.
		{name: "FallbackData for an unknown stream opens it", do: func(c *hpCtx) {
			c.p.write(rawFallbackFrame(c.p.version, 0, 55, 0, "fallback open"))
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
	env := startTestServer(t, defaultConsumerSpinTime)
	for _, mode := range bothModes {
		for _, tc := range cases {
			t.Run(modeName(mode)+"/"+tc.name, func(t *testing.T) {
				c := hpServerCase(t, env, mode, false)
				tc.do(c)
				hpFinish(c, tc)
				env.checkGood(t)
			})
		}
	}
}

func TestHostileServerFrames(t *testing.T) {
	f := func(length uint32, typ byte, payload ...byte) func(c *hpCtx) {
		return func(c *hpCtx) { c.p.write(rawFrame(length, rawMagic, c.p.version, typ, payload...)) }
	}
	cases := []hpCase{
		{name: "Polling of length 9", do: f(9, 1, 0), want: []string{"Polling", "9"}},
		{name: "StreamClose of length 13", do: f(13, 2, 0, 0, 0, 2, 0), want: []string{"StreamClose", "13"}},
		{name: "HotRestart of length 15", do: f(15, 8, 0, 0, 0, 0, 0, 0, 1), want: []string{"HotRestart", "15"}},
		{name: "HotRestartAck to a client", do: f(16, 9, 0, 0, 0, 0, 0, 0, 0, 1), want: []string{"HotRestartAck"}},
		{name: "unknown type 10", do: f(8, 10), want: []string{"type", "10"}},
		{name: "AckShareMemory in the running phase", do: f(8, 6), want: []string{"AckShareMemory"}},
		{name: "bad magic mid-stream", do: func(c *hpCtx) {
			c.p.write(append(rawFrame(8, rawMagic, c.p.version, 1), rawFrame(8, 0x5877, c.p.version, 1)...))
		}, want: []string{"magic"}},
		{name: "version 0 mid-stream", do: func(c *hpCtx) {
			c.p.write(append(rawFrame(8, rawMagic, c.p.version, 1), rawFrame(8, rawMagic, 0, 1)...))
		}, want: []string{"version"}},
		{name: "truncated frame then EOF", do: func(c *hpCtx) {
			c.p.write(rawFallbackFrame(c.p.version, 100, c.id, 0, "short"))
			c.p.conn.CloseWrite()
		}, is: io.ErrUnexpectedEOF, want: []string{"inside"}},
		{name: "FallbackData larger than MaxFallbackFrameSize", do: func(c *hpCtx) {
			c.p.write(rawFallbackFrame(c.p.version, minFallbackFrame+1, c.id, 0, "x"))
		}, want: []string{"FallbackData", fmt.Sprint(minFallbackFrame + 1)}},
		{name: "FallbackData for stream id 0", do: func(c *hpCtx) {
			c.p.write(rawFallbackFrame(c.p.version, 0, 0, 0, "x"))
		}, want: []string{"stream id 0"}},
		{name: "FallbackData with status 1", do: func(c *hpCtx) {
			c.p.write(rawFallbackFrame(c.p.version, 0, c.id, 1, "x"))
		}, want: []string{"status"}},
		{name: "HotRestart is ignored by the client", do: f(16, 8, 0, 0, 0, 0, 0, 0, 0, 1), survive: hpSurviveRoundTrip},
		{name: "StreamClose for an unknown stream is ignored", do: f(12, 2, 0, 0, 1, 0), survive: hpSurviveRoundTrip},
		{name: "FallbackData on the open stream", do: func(c *hpCtx) {
			c.p.write(rawFallbackFrame(c.p.version, 0, c.id, 0, "fallback data"))
		}, survive: func(c *hpCtx) error { return c.expectData(c.id, "fallback data") }},
	}
	env := startTestServer(t, defaultConsumerSpinTime)
	for _, mode := range bothModes {
		for _, tc := range cases {
			t.Run(modeName(mode)+"/"+tc.name, func(t *testing.T) {
				c := hpClientCase(t, mode, false)
				tc.do(c)
				hpFinish(c, tc)
				env.checkGood(t)
			})
		}
	}
}

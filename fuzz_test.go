package shmipc

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
	"unsafe"

	"github.com/goshm/shmipc/internal/wire"
)

// Fuzz targets for everything a peer controls: the bytes on the socket
// (frames and the server handshake) and the contents of the shared regions
// (buffer region and IO queues). Inputs live in ordinary Go memory, so any
// access outside a mapping panics, which the fuzzer reports as a crash.
//
// Run one target at a time, for example:
//
//	go test -run XXX -fuzz '^FuzzReadFrame$' -fuzztime=1000000x .
//
// A plain `go test` runs the seed corpora (f.Add and testdata/fuzz).

// ---------------------------------------------------------------------------
// Helpers

// fzScript reads an op script; once exhausted it yields zeros.
type fzScript struct{ b []byte }

func (s *fzScript) done() bool { return len(s.b) == 0 }

func (s *fzScript) u8() byte {
	if len(s.b) == 0 {
		return 0
	}
	v := s.b[0]
	s.b = s.b[1:]
	return v
}

func (s *fzScript) u16() uint16 { return uint16(s.u8()) | uint16(s.u8())<<8 }

func (s *fzScript) u32() uint32 { return uint32(s.u16()) | uint32(s.u16())<<16 }

func (s *fzScript) u64() uint64 { return uint64(s.u32()) | uint64(s.u32())<<32 }

var errFzConnGone = errors.New("fuzz conn: connection reset")

// fzAddr is the address of the fake connection.
type fzAddr struct{}

func (fzAddr) Network() string { return "fuzz" }
func (fzAddr) String() string  { return "fuzz" }

// fzConn is a net.Conn whose reads return data in chunks of fuzz-chosen
// sizes and then end with endErr. Writes are discarded and deadlines
// ignored. It is not a *net.UnixConn, so file descriptors cannot pass.
type fzConn struct {
	data        []byte
	chunks      []byte // chunk sizes, cycled; 0 means as much as asked for
	ci          int
	endErr      error // io.EOF or errFzConnGone
	errWithData bool  // return endErr together with the last bytes
}

func (c *fzConn) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	if len(c.data) == 0 {
		return 0, c.endErr
	}
	n := len(p)
	if len(c.chunks) > 0 {
		if k := int(c.chunks[c.ci%len(c.chunks)]); k != 0 {
			n = k
		}
		c.ci++
	}
	n = min(n, len(p), len(c.data))
	copy(p, c.data[:n])
	c.data = c.data[n:]
	if len(c.data) == 0 && c.errWithData {
		return n, c.endErr
	}
	return n, nil
}

func (c *fzConn) Write(p []byte) (int, error)        { return len(p), nil }
func (c *fzConn) Close() error                       { return nil }
func (c *fzConn) LocalAddr() net.Addr                { return fzAddr{} }
func (c *fzConn) RemoteAddr() net.Addr               { return fzAddr{} }
func (c *fzConn) SetDeadline(t time.Time) error      { return nil }
func (c *fzConn) SetReadDeadline(t time.Time) error  { return nil }
func (c *fzConn) SetWriteDeadline(t time.Time) error { return nil }

// peerCredentials makes the peer this process, which owns the region files
// the fuzz targets write, so that file-mode handshakes get past the
// ownership check.
func (c *fzConn) peerCredentials() (peerID, error) {
	return peerID{uid: uint32(os.Getuid()), pid: int32(os.Getpid())}, nil
}

// ---------------------------------------------------------------------------
// 1. FuzzReadFrame

// fzWantFrameLen is the frame length rule of PROTOCOL.md §2.2 as this
// implementation enforces it, written independently of frameLength: the
// length a frame with this header must have, or ok false.
func fzWantFrameLen(typ uint8, length, limit uint32) bool {
	switch wire.Type(typ) {
	case wire.TypePolling, wire.TypeExchangeProtoVersion, wire.TypeAckShareMemory, wire.TypeAckReadyRecvFD:
		return length == 8
	case wire.TypeStreamClose:
		return length == 12
	case wire.TypeHotRestart, wire.TypeHotRestartAck:
		return length == 16
	case wire.TypeFallbackData:
		return length >= 16 && length <= limit
	case wire.TypeShareMemoryByFilePath, wire.TypeShareMemoryByMemfd:
		return length >= 12 && length <= 8+4+2*0xFFFF
	}
	return false
}

func FuzzReadFrame(f *testing.F) {
	const v = wire.VersionMemfd
	polling := wire.AppendEvent(nil, v, wire.TypePolling)
	streamClose := wire.AppendStreamClose(nil, v, 7)
	fallback := append(wire.AppendFallbackHead(nil, v, 5, statusOpened, 11), "hello world"...)
	emptyFallback := wire.AppendFallbackHead(nil, 2, 9, statusOpened, 0)
	hotRestart := wire.AppendHotRestart(nil, v, wire.TypeHotRestart, 42)
	hotRestartAck := wire.AppendHotRestart(nil, v, wire.TypeHotRestartAck, 42)
	pathFrame := rawPathFrame(2, 0, "/dev/shm/q", "/dev/shm/b")
	var several []byte
	for _, fr := range [][]byte{polling, streamClose, fallback, hotRestart, polling, emptyFallback, hotRestartAck, streamClose} {
		several = append(several, fr...)
	}
	// A big fallback frame: the receive buffer must grow past readBufSize.
	big := append(wire.AppendFallbackHead(nil, v, 3, statusOpened, 70000), bytes.Repeat([]byte{0xAB}, 70000)...)
	// Many small frames: more than readBufSize in total, so frames straddle
	// the end of the receive buffer and the unread bytes slide down.
	var many []byte
	for i := 0; len(many) < readBufSize+1000; i++ {
		many = wire.AppendStreamClose(many, v, uint32(i))
		if i%7 == 0 {
			many = append(many, fallback...)
		}
	}

	const lim = 1 << 20
	seeds := []struct {
		data   []byte
		chunks []byte
		limit  uint32
		mode   uint8
	}{
		{polling, nil, lim, 0},
		{streamClose, nil, lim, 0},
		{fallback, nil, lim, 0},
		{emptyFallback, []byte{1}, lim, 1},
		{several, nil, lim, 0},
		{several, []byte{1}, lim, 0},
		{several, []byte{3, 7, 0}, lim, 1},
		{several, []byte{5}, lim, 2},
		{hotRestart, nil, lim, 3},
		{pathFrame, []byte{2}, lim, 0},
		{big, nil, lim, 0},
		{big, []byte{0, 200}, lim, 1},
		{many, nil, lim, 0},
		{many, []byte{0, 0, 13}, lim, 0},
		// truncated frames
		{fallback[:len(fallback)-1], nil, lim, 0},
		{fallback[:len(fallback)-3], []byte{1}, lim, 1},
		{streamClose[:5], nil, lim, 0},
		{append(append([]byte{}, several...), streamClose[:10]...), []byte{4}, lim, 2},
		{big[:40000], nil, lim, 0},
		// near-valid frames
		{rawFrame(9, wire.Magic, v, 1), nil, lim, 0},                      // Polling of 9 bytes
		{rawFrame(12, wire.Magic, v, 1, 0, 0, 0, 1), nil, lim, 0},         // Polling of 12 bytes
		{rawFrame(8, wire.Magic, v, 2), nil, lim, 0},                      // StreamClose of 8 bytes
		{rawFrame(15, wire.Magic, v, 3, make([]byte, 7)...), nil, lim, 0}, // FallbackData below 16
		{rawFrame(lim+1, wire.Magic, v, 3, make([]byte, 8)...), nil, lim, 0},
		{rawFrame(lim, wire.Magic, v, 3, make([]byte, 8)...), nil, lim, 0}, // at the limit, truncated
		{rawFrame(0xFFFFFFFF, wire.Magic, v, 3), nil, lim, 0},
		{rawFrame(0, wire.Magic, v, 3), nil, lim, 0},
		{rawFrame(8, 0x5877, v, 1), nil, lim, 0},      // bad magic
		{rawFrame(8, wire.Magic, 0, 1), nil, lim, 0},  // version 0
		{rawFrame(8, wire.Magic, v, 10), nil, lim, 0}, // type 10
		{rawFrame(8, wire.Magic, v, 255), nil, lim, 0},
		{rawFrame(11, wire.Magic, 2, 0, 0, 0, 0), nil, lim, 0}, // path frame below 12
		{rawFrame(8+4+2*0xFFFF+1, wire.Magic, 2, 5), nil, lim, 0},
		{fallback, nil, 15, 0}, // limit below any FallbackData frame
		{fallback, nil, uint32(len(fallback)), 0},
		{fallback, nil, uint32(len(fallback) - 1), 0},
		{nil, nil, lim, 0},
	}
	for _, s := range seeds {
		f.Add(s.data, s.chunks, s.limit, s.mode)
	}

	f.Fuzz(func(t *testing.T, data, chunks []byte, limit uint32, mode uint8) {
		// Keep the receive buffer a receiver may grow within reason.
		limit %= 1<<20 + 1
		conn := &fzConn{data: data, chunks: chunks, endErr: io.EOF, errWithData: mode&1 != 0}
		if mode&2 != 0 {
			conn.endErr = errFzConnGone
		}
		c := newEventConn(conn, time.Second)
		pos := 0
		for frames := 0; ; frames++ {
			if frames > len(data)/wire.HeaderSize+1 {
				t.Fatalf("readFrame returned %d frames from %d bytes", frames, len(data))
			}
			h, payload, err := c.readFrame(limit, 0)
			rest := data[pos:]

			// What an independent reading of PROTOCOL.md §2 expects.
			var want error
			n := 0
			switch {
			case len(rest) == 0:
				want = conn.endErr
			case len(rest) < wire.HeaderSize:
				want = io.ErrUnexpectedEOF
			case binary.BigEndian.Uint16(rest[4:]) != wire.Magic:
				want = wire.ErrBadMagic
			case rest[6] == 0:
				want = wire.ErrBadVersion
			case rest[7] > 9:
				want = wire.ErrBadType
			case !fzWantFrameLen(rest[7], binary.BigEndian.Uint32(rest), limit):
				want = wire.ErrBadLength
			default:
				n = int(binary.BigEndian.Uint32(rest))
				if len(rest) < n {
					want = io.ErrUnexpectedEOF
				}
			}
			if want == io.ErrUnexpectedEOF && conn.endErr != io.EOF {
				want = conn.endErr
			}

			if want != nil {
				if err == nil {
					t.Fatalf("frame %d at %d: readFrame returned a %d-byte frame (header % x), want error %v", frames, pos, wire.HeaderSize+len(payload), []byte(h), want)
				}
				if !errors.Is(err, want) {
					t.Fatalf("frame %d at %d: error %q does not wrap %q", frames, pos, err, want)
				}
				if h != nil || payload != nil {
					t.Fatalf("frame %d at %d: error %v with a non-nil frame", frames, pos, err)
				}
				return
			}
			if err != nil {
				t.Fatalf("frame %d at %d (% x): unexpected error %v", frames, pos, rest[:min(len(rest), 16)], err)
			}
			// The frame must be exactly the next n input bytes and obey the
			// length rules of frameLength.
			if len(h) != wire.HeaderSize {
				t.Fatalf("frame %d: header of %d bytes", frames, len(h))
			}
			if err := h.Check(); err != nil {
				t.Fatalf("frame %d: returned header fails Check: %v", frames, err)
			}
			if got := wire.HeaderSize + len(payload); got != int(h.Length()) || got != n {
				t.Fatalf("frame %d: %d bytes returned, header says %d, want %d", frames, got, h.Length(), n)
			}
			if !fzWantFrameLen(uint8(h.Type()), h.Length(), limit) {
				t.Fatalf("frame %d: %v breaks the length rules (limit %d)", frames, h, limit)
			}
			if fl, err := frameLength(h, limit); err != nil || fl != n {
				t.Fatalf("frame %d: frameLength(%v) = %d, %v; want %d", frames, h, fl, err, n)
			}
			if !bytes.Equal(h, rest[:wire.HeaderSize]) || !bytes.Equal(payload, rest[wire.HeaderSize:n]) {
				t.Fatalf("frame %d at %d: returned bytes differ from the input", frames, pos)
			}
			if len(c.rbuf) < c.w || c.r > c.w {
				t.Fatalf("frame %d: receive buffer state r=%d w=%d len=%d", frames, c.r, c.w, len(c.rbuf))
			}
			pos += n
			c.shrink() // as the receive loop does after each frame
		}
	})
}

// ---------------------------------------------------------------------------
// 2. FuzzServerHandshake

// fzDirPlaceholder stands for the per-process region directory in seeds; it
// has the same length as the real name so frame lengths stay right.
const (
	fzDirBase        = "/tmp/shmipc-fuzz-"
	fzDirPlaceholder = "@@@@@@@@"
)

// fzHandshakeDir creates the directory regions may be opened from:
// fzDirBase followed by 8 hex digits.
func fzHandshakeDir(f *testing.F) string {
	for range 100 {
		dir := fmt.Sprintf("%s%08x", fzDirBase, rand.Uint32())
		if err := os.Mkdir(dir, 0o700); err == nil {
			f.Cleanup(func() { os.RemoveAll(dir) })
			return dir
		} else if !errors.Is(err, os.ErrExist) {
			f.Fatalf("create fuzz region directory: %v", err)
		}
	}
	f.Fatal("cannot create a fuzz region directory")
	return ""
}

// fzValidBufferFile is a small valid buffer region.
func fzValidBufferFile() []byte {
	plans := []listPlan{{sliceCap: 4, count: 3}, {sliceCap: 12, count: 2}}
	mem := make([]byte, bufferRegionSize(plans)+8)
	initBufferRegion(mem, plans)
	return mem
}

// fzValidQueueFile is a valid queue region of capacity cap.
func fzValidQueueFile(cap uint32) []byte {
	mem := make([]byte, queueRegionSize(cap))
	initQueueRegion(mem, cap)
	return mem
}

func FuzzServerHandshake(f *testing.F) {
	dir := fzHandshakeDir(f)
	pdir := fzDirBase + fzDirPlaceholder
	q, b := pdir+"/queue", pdir+"/buf"
	exchange := rawFrame(8, wire.Magic, 3, uint8(wire.TypeExchangeProtoVersion))
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	buf, queue := fzValidBufferFile(), fzValidQueueFile(16)

	badCount := append([]byte{}, buf...)
	binary.LittleEndian.PutUint16(badCount, 0)
	badUsed := append([]byte{}, buf...)
	binary.LittleEndian.PutUint32(badUsed[4:], 1<<20)
	badCap := append([]byte{}, queue...)
	binary.LittleEndian.PutUint32(badCap[len(badCap)/2:], 32)
	badTail := append([]byte{}, queue...)
	binary.LittleEndian.PutUint64(badTail[queueTailOff:], 17)
	negCounters := append([]byte{}, queue...)
	binary.LittleEndian.PutUint64(negCounters[queueHeadOff:], math.MaxUint64-3)
	binary.LittleEndian.PutUint64(negCounters[queueTailOff:], math.MaxUint64-1)

	seeds := []struct{ stream, buf, queue []byte }{
		// valid handshakes
		{rawPathFrame(2, 0, q, b), buf, queue},
		{cat(exchange, rawPathFrame(3, 0, q, b)), buf, queue},
		{cat(rawPathFrame(2, 0, q, b), wire.AppendEvent(nil, 2, wire.TypePolling)), buf, fzValidQueueFile(32)},
		// memfd: fds cannot pass over this conn
		{cat(exchange, rawPathFrame(3, 5, q, b)), buf, queue},
		// paths outside the directory, relative, unclean, swapped, shared
		{rawPathFrame(2, 0, "/etc/passwd", b), buf, queue},
		{rawPathFrame(2, 0, q, "/tmp/buf"), buf, queue},
		{rawPathFrame(2, 0, "queue", "buf"), buf, queue},
		{rawPathFrame(2, 0, pdir+"/../queue", b), buf, queue},
		{rawPathFrame(2, 0, pdir+"//queue", b), buf, queue},
		{rawPathFrame(2, 0, pdir, b), buf, queue},
		{rawPathFrame(2, 0, b, q), buf, queue},
		{rawPathFrame(2, 0, q, q), buf, queue},
		{rawPathFrame(2, 0, b, b), buf, queue},
		{rawPathFrame(2, 0, q, b), nil, nil},
		{rawPathFrame(2, 0, q, b), buf, nil},
		// bad regions
		{rawPathFrame(2, 0, q, b), badCount, queue},
		{rawPathFrame(2, 0, q, b), badUsed, queue},
		{rawPathFrame(2, 0, q, b), buf[:40], queue},
		{rawPathFrame(2, 0, q, b), buf, badCap},
		{rawPathFrame(2, 0, q, b), buf, badTail},
		{rawPathFrame(2, 0, q, b), buf, negCounters},
		{rawPathFrame(2, 0, q, b), buf, queue[:len(queue)-12]},
		{rawPathFrame(2, 0, q, b), buf, append(append([]byte{}, queue...), 0, 0)},
		// bad frames
		{nil, buf, queue},
		{rawPathFrame(2, 0, q, b)[:5], buf, queue},
		{rawPathFrame(2, 0, q, b)[:20], buf, queue},
		{rawFrame(8, 0x5877, 2, 0), buf, queue},
		{rawFrame(8, wire.Magic, 1, 0), buf, queue},
		{rawFrame(8, wire.Magic, 4, 4), buf, queue},
		{rawFrame(8, wire.Magic, 2, 4), buf, queue},
		{rawFrame(8, wire.Magic, 3, 0), buf, queue},
		{rawFrame(9, wire.Magic, 3, 4), buf, queue},
		{rawFrame(11, wire.Magic, 2, 0, 0, 0, 0), buf, queue},
		{rawFrame(0xFFFFFFFF, wire.Magic, 2, 0), buf, queue},
		{cat(exchange, exchange), buf, queue},
		{cat(exchange, rawFrame(8, wire.Magic, 3, 6)), buf, queue},
		{rawFrame(14, wire.Magic, 2, 0, 0, 0, 0, 0, 0, 0), buf, queue},
		{rawFrame(16, wire.Magic, 2, 0, 0, 1, 'x', 0, 0, 0, 0, 0), buf, queue},
	}
	for _, s := range seeds {
		f.Add(s.stream, s.buf, s.queue)
	}

	conf := DefaultConfig()
	conf.ShareMemoryPathPrefix = dir + "/shmipc"
	bufFile, queueFile := dir+"/buf", dir+"/queue"
	placeholder := []byte(filepath.Base(pdir))
	realName := []byte(filepath.Base(dir))

	f.Fuzz(func(t *testing.T, stream, bufData, queueData []byte) {
		stream = bytes.ReplaceAll(stream, placeholder, realName)
		for _, p := range []struct {
			name string
			data []byte
		}{{bufFile, bufData}, {queueFile, queueData}} {
			if err := os.Remove(p.name); err != nil && !errors.Is(err, os.ErrNotExist) {
				t.Fatal(err)
			}
			if len(p.data) > 0 {
				if err := os.WriteFile(p.name, p.data, 0o600); err != nil {
					t.Fatal(err)
				}
			}
		}

		s := newSession(&fzConn{data: stream, endErr: io.EOF}, conf, false)
		err := s.serverHandshake()
		buf, qr := s.buf, s.queueRegion
		var bufPath, queuePath string
		if buf != nil {
			bufPath = buf.region.path
		}
		if qr != nil {
			queuePath = qr.path
		}
		s.releaseRegions()

		// Whatever happened, nothing stays mapped or cached.
		if buf != nil {
			if n := buf.region.refs.Load(); n != 0 || buf.region.mem != nil {
				t.Fatalf("buffer region %s still has %d references after release", bufPath, n)
			}
			if cachedBuffers(bufPath) != 0 {
				t.Fatalf("buffer region %s is still cached after release", bufPath)
			}
		}
		if qr != nil {
			if n := qr.refs.Load(); n != 0 || qr.mem != nil {
				t.Fatalf("queue region %s still has %d references after release", queuePath, n)
			}
		}
		for _, p := range []string{bufPath, queuePath} {
			if p != "" && filepath.Dir(p) != dir {
				t.Fatalf("server mapped %q, outside %s (err %v)", p, dir, err)
			}
		}

		if err != nil {
			if len(stream) < wire.HeaderSize {
				if !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) {
					t.Fatalf("%d-byte stream: error %v is not EOF", len(stream), err)
				}
			} else if binary.BigEndian.Uint16(stream[4:]) != wire.Magic {
				if !errors.Is(err, wire.ErrBadMagic) {
					t.Fatalf("bad magic: error %v does not wrap wire.ErrBadMagic", err)
				}
			} else if v := stream[6]; v != 2 && v != 3 && (v == 0 || stream[7] <= 9) && !errors.Is(err, wire.ErrBadVersion) {
				t.Fatalf("first header version %d: error %v does not wrap wire.ErrBadVersion", v, err)
			}
			return
		}
		if buf == nil || qr == nil || s.recvQ == nil || s.sendQ == nil {
			t.Fatalf("handshake succeeded without mapping everything: buf %v queue %v", buf != nil, qr != nil)
		}
		if s.version != 2 && s.version != 3 {
			t.Fatalf("handshake succeeded with version %d", s.version)
		}
		// The server removes region files it is done with.
		for _, p := range []string{bufPath, queuePath} {
			if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("region file %s left behind after release: %v", p, err)
			}
		}
	})
}

// ---------------------------------------------------------------------------
// 3 and 4. Buffer region targets

// fzBufModel drives a buffer manager with an op script and checks every
// result. While pristine is set the region has only been used through the
// API, so every operation must succeed exactly as PROTOCOL.md §4 says;
// afterwards only memory safety and error classification are checked.
type fzBufModel struct {
	t        *testing.T
	m        *bufferManager
	pristine bool
	owned    []segment // slices we hold (popped or received)
	initFree []int32
	ownedBy  []int32 // slices held per list while pristine
	scratch  []segment
}

func newFzBufModel(t *testing.T, m *bufferManager, pristine bool) *fzBufModel {
	fm := &fzBufModel{t: t, m: m, pristine: pristine, initFree: m.freeCounts(), ownedBy: make([]int32, len(m.lists))}
	fm.checkLayout()
	return fm
}

// checkLayout checks the manager's copy of the layout against the mapping.
func (fm *fzBufModel) checkLayout() {
	t, m := fm.t, fm.m
	var total uint64
	prevEnd := uint64(managerHeaderSize)
	for i, l := range m.lists {
		if uint64(l.header) != prevEnd || l.area != l.header+listHeaderSize || l.stride != l.sliceCap+sliceHeaderSize ||
			l.count == 0 || l.sliceCap == 0 || l.sliceCap%4 != 0 || uint64(l.area)+uint64(l.count)*uint64(l.stride) > uint64(len(m.mem)) {
			t.Fatalf("list %d %+v is inconsistent with a %d-byte region", i, l, len(m.mem))
		}
		prevEnd = uint64(l.end())
		total += uint64(l.count)
	}
	if uint64(m.slices) != total {
		t.Fatalf("manager counts %d slices, lists hold %d", m.slices, total)
	}
	for k := 1; k < len(m.bySize); k++ {
		if m.lists[m.bySize[k-1]].sliceCap >= m.lists[m.bySize[k]].sliceCap {
			t.Fatalf("bySize not strictly ascending")
		}
	}
}

// isSlice is an independent check that off is the header of a slice of li.
func (fm *fzBufModel) isSlice(li int, off uint32) bool {
	l := fm.m.lists[li]
	return off >= l.area && off < l.end() && (off-l.area)%l.stride == 0
}

func (fm *fzBufModel) wantProtocol(op string, err error) {
	if err == nil {
		return
	}
	if fm.pristine {
		fm.t.Fatalf("%s on an uncorrupted region: %v", op, err)
	}
	if !errors.Is(err, ErrProtocol) {
		fm.t.Fatalf("%s: error %q does not wrap ErrProtocol", op, err)
	}
}

// took records a slice handed out by pop or alloc.
func (fm *fzBufModel) took(op string, li int, off uint32) {
	if li < 0 || li >= len(fm.m.lists) || !fm.isSlice(li, off) {
		fm.t.Fatalf("%s returned list %d offset %d, not a slice of that list", op, li, off)
	}
	if fm.m.mem[off+sliceFlagsOff] != flagInUse {
		fm.t.Fatalf("%s: slice %d has flags %#x, want %#x", op, off, fm.m.mem[off+sliceFlagsOff], flagInUse)
	}
	if fm.pristine {
		for _, s := range fm.owned {
			if s.off == off {
				fm.t.Fatalf("%s handed out slice %d, which is already in use", op, off)
			}
		}
		fm.ownedBy[li]++
	}
	fm.owned = append(fm.owned, segment{list: int32(li), off: off})
}

// checkFree checks the free counts against what we hold.
func (fm *fzBufModel) checkFree() {
	if !fm.pristine {
		return
	}
	free := fm.m.freeCounts()
	for i := range free {
		if free[i] != fm.initFree[i]-fm.ownedBy[i] {
			fm.t.Fatalf("list %d: free count %d, want %d - %d held", i, free[i], fm.initFree[i], fm.ownedBy[i])
		}
	}
}

func (fm *fzBufModel) dropOwned(k int) segment {
	s := fm.owned[k]
	fm.owned[k] = fm.owned[len(fm.owned)-1]
	fm.owned = fm.owned[:len(fm.owned)-1]
	if fm.pristine {
		fm.ownedBy[s.list]--
	}
	return s
}

// value picks a value to write into a header: raw, or one of the offsets
// and boundary values that matter.
func (fm *fzBufModel) value(s *fzScript, li int) uint32 {
	l := fm.m.lists[li]
	sel, k, raw := s.u8(), s.u16(), s.u32()
	switch sel % 10 {
	case 0:
		return raw
	case 1:
		return uint32(k) % l.count * l.stride // relative offset of a slice
	case 2:
		return l.area + uint32(k)%l.count*l.stride // absolute offset of a slice
	case 3:
		return math.MaxUint32 - uint32(k&7)
	case 4:
		return 0
	case 5:
		return l.count * l.stride // one past the last slice
	case 6:
		return uint32(k & 0xFF)
	case 7:
		return uint32(int32(k)) - 0x8000 // small signed, for counters
	case 8:
		return l.sliceCap + uint32(k&3)
	default:
		other := fm.m.lists[int(k)%len(fm.m.lists)]
		return other.area + uint32(k>>4)%other.count*other.stride
	}
}

// checkChain checks slices readChain returned.
func (fm *fzBufModel) checkChain(got []segment) {
	if uint64(len(got)) > uint64(fm.m.slices) {
		fm.t.Fatalf("readChain returned %d slices of a region with %d", len(got), fm.m.slices)
	}
	base := uintptr(unsafe.Pointer(unsafe.SliceData(fm.m.mem)))
	for _, s := range got {
		li := int(s.list)
		if li < 0 || li >= len(fm.m.lists) || !fm.isSlice(li, s.off) {
			fm.t.Fatalf("readChain returned list %d offset %d, not a slice of it", li, s.off)
		}
		if len(s.data) == 0 || len(s.data) > int(fm.m.lists[li].sliceCap) {
			fm.t.Fatalf("readChain returned %d bytes from a %d-byte slice", len(s.data), fm.m.lists[li].sliceCap)
		}
		d := uint32(uintptr(unsafe.Pointer(unsafe.SliceData(s.data))) - base)
		if d < s.off+sliceHeaderSize || uint64(d)+uint64(cap(s.data)) > uint64(s.off)+sliceHeaderSize+uint64(fm.m.lists[li].sliceCap) {
			fm.t.Fatalf("readChain data at %d+%d lies outside slice %d", d, cap(s.data), s.off)
		}
	}
}

func (fm *fzBufModel) run(script []byte) {
	t, m := fm.t, fm.m
	s := &fzScript{b: script}
	nl := len(m.lists)
	for steps := 0; !s.done(); steps++ {
		op := s.u8()
		switch op % 12 {
		case 0, 1: // alloc
			n := int(s.u32() % (2*m.maxSliceCap() + 2))
			split := op&0x80 != 0
			li, off, err := m.alloc(n, split, false)
			fm.wantProtocol("alloc", err)
			if err != nil {
				if off != 0 {
					t.Fatalf("alloc returned offset %d with error %v", off, err)
				}
				break
			}
			if off == 0 {
				if li != -1 {
					t.Fatalf("alloc returned list %d without a slice", li)
				}
				if fm.pristine {
					// No list that could serve may have a slice to spare:
					// one whose slices hold n, or for a split one whose
					// slices hold an eighth of it (maxSplitPieces).
					floor := min(n, int(m.usable)) / maxSplitPieces
					for i, free := range m.freeCounts() {
						if c := int(m.lists[i].sliceCap); free >= 2 && (c >= n || split && c >= floor) {
							t.Fatalf("alloc(%d, %v) failed while list %d (cap %d) has %d free", n, split, i, m.lists[i].sliceCap, free)
						}
					}
				}
				break
			}
			if fm.pristine && !split && int(m.lists[li].sliceCap) < n {
				t.Fatalf("alloc(%d) returned a slice of %d bytes", n, m.lists[li].sliceCap)
			}
			fm.took("alloc", li, off)
		case 2: // pop
			li := int(s.u8()) % nl
			var before int32
			if fm.pristine {
				before = m.freeCounts()[li]
			}
			off, err := m.pop(li)
			fm.wantProtocol("pop", err)
			if off != 0 && err != nil {
				t.Fatalf("pop returned offset %d with error %v", off, err)
			}
			if off != 0 {
				fm.took("pop", li, off)
			} else if fm.pristine && before >= 2 {
				t.Fatalf("pop of list %d failed with %d free", li, before)
			}
		case 3: // push a slice we hold
			if len(fm.owned) == 0 {
				break
			}
			sl := fm.dropOwned(int(s.u16()) % len(fm.owned))
			fm.wantProtocol("push", m.push(int(sl.list), sl.off))
		case 4: // link held slices into a message and read it back
			k := 1 + int(s.u8()%4)
			if k > len(fm.owned) {
				break
			}
			chain := make([]segment, 0, k)
			sizes := make([]uint32, 0, k)
			for range k {
				sl := fm.dropOwned(int(s.u16()) % len(fm.owned))
				// A slice received earlier goes into a message of ours as a
				// kept slice does: a writer takes it (takeKept), and it is
				// no longer held as received.
				m.unhold(int(sl.list), sl.off)
				if fm.pristine {
					fm.ownedBy[sl.list]++ // still held until readChain says otherwise
				}
				chain = append(chain, sl)
				size := s.u32() % (m.lists[sl.list].sliceCap + 1)
				if s.u8()&3 == 0 {
					size = 0
				}
				sizes = append(sizes, size)
			}
			for i, sl := range chain {
				var next uint32
				if i+1 < len(chain) {
					next = chain[i+1].off
				}
				m.linkSlice(sl.off, int(sizes[i]), next)
			}
			got, err := m.readChain(fm.scratch[:0], chain[0].off)
			fm.wantProtocol("readChain of a linked message", err)
			fm.checkChain(got)
			if fm.pristine {
				// Empty slices were freed; the others come back in order.
				j := 0
				for i, sl := range chain {
					if sizes[i] == 0 {
						fm.ownedBy[sl.list]--
						continue
					}
					if j >= len(got) || got[j].off != sl.off || got[j].list != sl.list || len(got[j].data) != int(sizes[i]) {
						t.Fatalf("readChain of %v sizes %v returned %+v", chain, sizes, got)
					}
					want := m.sliceData(int(sl.list), sl.off)[:sizes[i]]
					if unsafe.SliceData(got[j].data) != unsafe.SliceData(want) {
						t.Fatalf("readChain data of slice %d is not its data area", sl.off)
					}
					j++
				}
				if j != len(got) {
					t.Fatalf("readChain returned %d slices, want %d", len(got), j)
				}
			}
			for _, g := range got {
				fm.owned = append(fm.owned, segment{list: g.list, off: g.off})
			}
			if err != nil {
				// readChain freed what it had appended; we cannot tell
				// which of the chain we still hold.
				fm.pristine = false
			}
			fm.scratch = got[:0]
		case 5: // readChain from a fuzz-chosen root, as a peer's queue element names
			var root uint32
			if s.u8()&1 == 0 {
				root = s.u32()
			} else {
				l := m.lists[int(s.u8())%nl]
				root = l.area + uint32(s.u16())%l.count*l.stride
			}
			fm.pristine = false // it may free slices that are free already
			got, err := m.readChain(fm.scratch[:0], root)
			fm.wantProtocol("readChain", err)
			if err != nil && len(got) != 0 {
				t.Fatalf("readChain failed (%v) but returned %d slices", err, len(got))
			}
			fm.checkChain(got)
			if s.u8()&1 == 0 {
				for _, g := range got {
					fm.wantProtocol("push", m.push(int(g.list), g.off))
				}
			} else {
				for _, g := range got {
					fm.owned = append(fm.owned, segment{list: g.list, off: g.off})
				}
			}
			fm.scratch = got[:0]
		case 6: // locate
			off := s.u32()
			if s.u8()&1 == 0 {
				l := m.lists[int(s.u8())%nl]
				off = l.area + uint32(s.u16())%(l.count+1)*l.stride + uint32(s.u8()%3)
			}
			li, err := m.locate(off)
			want := -1
			for i := range m.lists {
				if fm.isSlice(i, off) {
					want = i
				}
			}
			if err != nil {
				if !errors.Is(err, ErrProtocol) {
					t.Fatalf("locate(%d): error %q does not wrap ErrProtocol", off, err)
				}
				if want >= 0 {
					t.Fatalf("locate(%d) failed (%v) but it is a slice of list %d", off, err, want)
				}
			} else if li != want {
				t.Fatalf("locate(%d) = %d, want %d", off, li, want)
			}
		case 7: // corrupt a list header field
			li := int(s.u8()) % nl
			field := uint32(s.u8() % (listHeaderSize / 4))
			v := fm.value(s, li)
			binary.LittleEndian.PutUint32(m.mem[m.lists[li].header+4*field:], v)
			if field != creatorCounter/4 && field != mapperCounter/4 {
				fm.pristine = false
			}
		case 8: // corrupt a slice header field
			li := int(s.u8()) % nl
			l := m.lists[li]
			off := l.area + uint32(s.u16())%l.count*l.stride
			field := uint32(s.u8() % 5)
			v := fm.value(s, li)
			if field == 4 {
				m.mem[off+sliceFlagsOff] = byte(v)
			} else {
				binary.LittleEndian.PutUint32(m.mem[off+4*field:], v)
			}
			fm.pristine = false
		case 9: // sliceData of a held slice
			if len(fm.owned) == 0 {
				break
			}
			sl := fm.owned[int(s.u16())%len(fm.owned)]
			d := m.sliceData(int(sl.list), sl.off)
			if len(d) != int(m.lists[sl.list].sliceCap) || cap(d) != len(d) {
				t.Fatalf("sliceData of %d: %d bytes, cap %d", sl.off, len(d), cap(d))
			}
		case 10: // free counts
			fm.checkFree()
		case 11: // free everything we hold
			for len(fm.owned) > 0 {
				sl := fm.dropOwned(len(fm.owned) - 1)
				fm.wantProtocol("push", m.push(int(sl.list), sl.off))
			}
			fm.checkFree()
		}
	}
	fm.checkFree()
}

// fzBufferScript is an op script for the seeds: allocate, send, free.
func fzBufferScript() []byte {
	var b []byte
	u32 := func(v uint32) { b = binary.LittleEndian.AppendUint32(b, v) }
	for i := range 6 {
		b = append(b, 0) // alloc
		u32(uint32(i * 10))
	}
	b = append(b, 2, 0, 2, 1) // pop lists 0 and 1
	b = append(b, 4, 2)       // send a 3-slice message
	for i := range 3 {
		b = append(b, byte(i), 0)
		u32(uint32(4 + i))
		b = append(b, 1)
	}
	b = append(b, 10, 9, 0, 0, 6, 0, 0, 0, 0, 0, 0)
	b = append(b, 3, 0, 0, 11, 10)
	b = append(b, 5, 1, 0, 0, 0, 0) // readChain at the first slice
	b = append(b, 11)
	return b
}

// fzCorruptScript corrupts list and slice headers, then reads and frees.
func fzCorruptScript() []byte {
	var b []byte
	b = append(b, 0x80, 4, 0, 0, 0) // alloc split
	b = append(b, 4, 0, 0, 0, 4, 0, 0, 0, 1)
	for field := range byte(9) {
		b = append(b, 7, 0, field, field, 1, 0, 0, 0, 0, 0)
		b = append(b, 2, 0, 0x80, 4, 0, 0, 0, 5, 1, 0, 3, 0, 0)
	}
	for field := range byte(5) {
		b = append(b, 8, 0, 1, 0, field, field+1, 2, 0, 0, 0, 0, 0)
		b = append(b, 5, 1, 0, 1, 0, 1, 2, 0)
	}
	b = append(b, 11)
	return b
}

func FuzzBufferRegion(f *testing.F) {
	valid := func(plans []listPlan) []byte {
		mem := make([]byte, bufferRegionSize(plans))
		initBufferRegion(mem, plans)
		return mem
	}
	small := valid([]listPlan{{sliceCap: 4, count: 3}, {sliceCap: 12, count: 2}})
	three := valid([]listPlan{{sliceCap: 8, count: 8}, {sliceCap: 32, count: 4}, {sliceCap: 64, count: 2}})
	script := fzBufferScript()
	corrupt := fzCorruptScript()
	mod := func(b []byte, off int, v uint32) []byte {
		c := append([]byte{}, b...)
		binary.LittleEndian.PutUint32(c[off:], v)
		return c
	}
	seeds := [][]byte{
		small,
		three,
		valid([]listPlan{{sliceCap: 4, count: 1}}),
		valid([]listPlan{{sliceCap: 1 << 10, count: 2}}),
		mod(small, 0, 0),                                  // no lists
		mod(small, 0, 3),                                  // more lists than fit
		mod(small, 4, uint32(len(small))),                 // used too large
		mod(small, managerHeaderSize+listCapOff, 6),       // cap not a multiple of 4
		mod(small, managerHeaderSize+listCapOff, 12),      // duplicate cap
		mod(small, managerHeaderSize+listCountOff, 0),     // no slices
		mod(small, managerHeaderSize+listCountOff, 1<<30), // past the end
		mod(small, managerHeaderSize+listCapOff, math.MaxUint32-3),
		mod(small, managerHeaderSize+listHeadOff, 3),
		mod(small, managerHeaderSize+listTailOff, 1<<31),
		mod(small, managerHeaderSize+listFreeOff, math.MaxInt32),
		mod(three, managerHeaderSize+listHeaderSize+sliceNextOff, 7),
		small[:managerHeaderSize+listHeaderSize],
		{},
	}
	for i, s := range seeds {
		f.Add(s, script, i%2 == 0)
		f.Add(s, corrupt, i%2 == 1)
	}

	f.Fuzz(func(t *testing.T, data, script []byte, creator bool) {
		mem := alignedBytes(max(len(data), managerHeaderSize))
		copy(mem, data)
		m, err := newBufferManager(heapRegion(mem), creator)
		if err != nil {
			if m != nil {
				t.Fatalf("newBufferManager returned a manager and error %v", err)
			}
			return
		}
		newFzBufModel(t, m, false).run(script)
	})
}

// fzLayouts are the valid regions FuzzReadChain starts from.
var fzLayouts = []struct {
	size  uint32
	sizes []SizePercentPair
}{
	{1 << 20, ReferenceSliceSizes()},
	{16 << 10, []SizePercentPair{{64, 50}, {256, 30}, {1024, 20}}},
	{4 << 10, []SizePercentPair{{4, 100}}},
	{1 << 10, []SizePercentPair{{4, 50}, {8, 50}}},
	{4 << 10, []SizePercentPair{{128, 40}, {32, 40}, {512, 20}}},
}

func FuzzReadChain(f *testing.F) {
	script := fzBufferScript()
	corrupt := fzCorruptScript()
	for i := range fzLayouts {
		f.Add(uint8(i), script)
		f.Add(uint8(i)|0x80, corrupt)
		f.Add(uint8(i), append(append([]byte{}, script...), corrupt...))
	}
	// A cycle: link a slice to itself, then read it.
	f.Add(uint8(1), []byte{2, 0, 2, 0, 4, 1, 0, 0, 5, 0, 0, 0, 1, 1, 0, 0, 0, 1,
		8, 0, 0, 0, 3, 2, 0, 0, 0, 0, 0, 5, 1, 0, 0, 0, 0, 11})

	type template struct {
		mem  []byte
		size int
	}
	templates := make([]template, len(fzLayouts))
	for i, l := range fzLayouts {
		plans, err := planLists(l.size, l.sizes)
		if err != nil {
			f.Fatalf("layout %d: %v", i, err)
		}
		// The region ends right after its last slice, so a slice past the
		// last one would be outside the mapping.
		size := int(bufferRegionSize(plans))
		mem := make([]byte, size)
		initBufferRegion(mem, plans)
		templates[i] = template{mem: mem, size: size}
	}

	f.Fuzz(func(t *testing.T, layout uint8, script []byte) {
		tp := templates[int(layout&0x7F)%len(templates)]
		mem := alignedBytes(tp.size)[:tp.size]
		copy(mem, tp.mem)
		m, err := newBufferManager(heapRegion(mem), layout&0x80 == 0)
		if err != nil {
			t.Fatalf("valid layout %d: %v", layout, err)
		}
		newFzBufModel(t, m, true).run(script)
	})
}

// ---------------------------------------------------------------------------
// 5. FuzzQueue

// fzQueueModel is the expected content of one queue while its counters have
// only been moved through put and pop.
type fzQueueModel struct {
	q        *ioQueue
	off      int // offset of this half in the region
	pristine bool
	elems    []queueElem
	flag     uint32
}

// fzCountersSafe reports whether counters starting at c cannot cross from -1
// to 0 in the ops of one input, where slot numbering restarts (PROTOCOL.md
// §5.4 counters are monotonic and never get there in practice).
func fzCountersSafe(c int64) bool { return c >= 0 || c < -(1<<40) }

func fzQueueSize(data []byte, sizeSel uint8) int {
	switch sel := int(sizeSel & 0x3F); sel {
	case 0:
		return len(data)
	default:
		return queueRegionSize(uint32(16 * sel))
	}
}

func FuzzQueue(f *testing.F) {
	const fix = 0x80 // sizeSel bit: write the right capacity into both headers
	q16, q32 := fzValidQueueFile(16), fzValidQueueFile(32)
	var script []byte
	elem := func(op byte, id, off, status uint32) {
		script = append(script, op)
		script = binary.LittleEndian.AppendUint32(script, id)
		script = binary.LittleEndian.AppendUint32(script, off)
		script = binary.LittleEndian.AppendUint32(script, status)
	}
	for i := range 20 {
		elem(0, uint32(i+1), uint32(44+i*24), 0) // put on c2s
	}
	script = append(script, 1, 1, 1, 0x81, 5, 6, 0x85, 6, 7)
	elem(0x80, 9, 0, statusClosed) // put on s2c
	script = append(script, 0x81, 0x81, 8)
	corrupt := append([]byte{}, script...)
	for _, field := range []byte{2, 3, 4} {
		for _, v := range []byte{0, 1, 2, 3, 4, 5, 6, 7} {
			corrupt = append(corrupt, field, v, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0x80, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1)
		}
	}
	corrupt = append(corrupt, 9, 30, 0, 4, 1, 2, 3, 4, 8, 1, 0)

	neg := append([]byte{}, q16...)
	for _, half := range []int{0, len(neg) / 2} {
		binary.LittleEndian.PutUint64(neg[half+queueHeadOff:], math.MaxUint64-2)
		binary.LittleEndian.PutUint64(neg[half+queueTailOff:], math.MaxUint64)
	}
	huge := append([]byte{}, q16...)
	binary.LittleEndian.PutUint64(huge[queueHeadOff:], math.MaxInt64-1)
	binary.LittleEndian.PutUint64(huge[queueTailOff:], math.MaxInt64)
	full := append([]byte{}, q16...)
	binary.LittleEndian.PutUint64(full[queueTailOff:], 16)
	over := append([]byte{}, q16...)
	binary.LittleEndian.PutUint64(over[queueTailOff:], 17)
	badCap := append([]byte{}, q16...)
	binary.LittleEndian.PutUint32(badCap[len(badCap)/2:], 15)

	for _, r := range [][]byte{q16, q32, neg, huge, full, over, badCap, q16[:len(q16)-2], {}} {
		f.Add(r, uint8(0), script)
		f.Add(r, uint8(0), corrupt)
	}
	f.Add([]byte{}, uint8(fix|1), script)
	f.Add([]byte{}, uint8(fix|3), corrupt)
	f.Add(q16, uint8(2), script)
	f.Add(q16[:100], uint8(fix|1), corrupt)
	f.Add(q16, uint8(0x3F|fix), corrupt)

	f.Fuzz(func(t *testing.T, data []byte, sizeSel uint8, script []byte) {
		size := fzQueueSize(data, sizeSel)
		mem := alignedBytes(size)[:size]
		copy(mem, data)
		if sizeSel&fix != 0 && size >= 2*queueHeaderSize && size%2 == 0 {
			half := size / 2
			c := uint32((half - queueHeaderSize) / queueElemSize)
			binary.LittleEndian.PutUint32(mem[queueCapOff:], c)
			binary.LittleEndian.PutUint32(mem[half+queueCapOff:], c)
		}

		// Independent check of the mapping rules (PROTOCOL.md §5.1, §5.2).
		mapOK := func() bool {
			if size%2 != 0 {
				return false
			}
			half := size / 2
			if half < queueHeaderSize+queueElemSize || (half-queueHeaderSize)%queueElemSize != 0 {
				return false
			}
			c := (half - queueHeaderSize) / queueElemSize
			if c%16 != 0 || c > maxQueueCap {
				return false
			}
			for _, h := range []int{0, half} {
				if int(binary.LittleEndian.Uint32(mem[h+queueCapOff:])) != c {
					return false
				}
				head := int64(binary.LittleEndian.Uint64(mem[h+queueHeadOff:]))
				tail := int64(binary.LittleEndian.Uint64(mem[h+queueTailOff:]))
				if head < 0 || tail < 0 {
					return false
				}
				if n := tail - head; n < 0 || n > int64(c) {
					return false
				}
			}
			return true
		}

		want := mapOK()
		c2s, s2c, err := mapQueues(mem)
		if (err == nil) != want {
			t.Fatalf("mapQueues of %d bytes: err %v, want success %v", size, err, want)
		}
		if err != nil {
			if c2s != nil || s2c != nil {
				t.Fatal("mapQueues returned queues with an error")
			}
			return
		}

		half := size / 2
		models := [2]*fzQueueModel{{q: c2s, off: 0}, {q: s2c, off: half}}
		// load (re)builds a model from the memory behind a freshly mapped queue.
		load := func(md *fzQueueModel) {
			q := md.q
			head := int64(binary.LittleEndian.Uint64(mem[md.off+queueHeadOff:]))
			tail := int64(binary.LittleEndian.Uint64(mem[md.off+queueTailOff:]))
			if q.ptail != tail || q.chead.Load() != head || q.cap != uint32((half-queueHeaderSize)/queueElemSize) {
				t.Fatalf("queue at %d mapped with tail %d head %d cap %d; memory says %d, %d", md.off, q.ptail, q.chead.Load(), q.cap, tail, head)
			}
			md.pristine = fzCountersSafe(head) && fzCountersSafe(tail)
			md.elems = md.elems[:0]
			for c := head; c != tail; c++ {
				md.elems = append(md.elems, fzReadElem(mem[md.off:], q.cap, c))
			}
			md.flag = binary.LittleEndian.Uint32(mem[md.off+queueFlagOff:])
		}
		load(models[0])
		load(models[1])

		s := &fzScript{b: script}
		for !s.done() {
			op := s.u8()
			md := models[op>>7]
			q := md.q
			hm := mem[md.off:]
			switch op & 0x7F % 10 {
			case 0: // put
				e := queueElem{id: s.u32(), offset: s.u32(), status: s.u32()}
				t0 := q.ptail
				head := int64(binary.LittleEndian.Uint64(hm[queueHeadOff:]))
				ok, err := q.put(e)
				n := t0 - head
				switch {
				case n < 0 || n > int64(q.cap):
					if ok || err == nil || !errors.Is(err, ErrProtocol) {
						t.Fatalf("put with tail %d head %d cap %d: %v, %v; want an ErrProtocol error", t0, head, q.cap, ok, err)
					}
				case n == int64(q.cap):
					if ok || err != nil {
						t.Fatalf("put on a full queue: %v, %v", ok, err)
					}
				default:
					if !ok || err != nil {
						t.Fatalf("put with tail %d head %d cap %d: %v, %v; want success", t0, head, q.cap, ok, err)
					}
					if got := fzReadElem(hm, q.cap, t0); got != e {
						t.Fatalf("put wrote %+v at slot of %d, want %+v", got, t0, e)
					}
					if tail := int64(binary.LittleEndian.Uint64(hm[queueTailOff:])); tail != t0+1 || q.ptail != t0+1 {
						t.Fatalf("put published tail %d (local %d), want %d", tail, q.ptail, t0+1)
					}
				}
				if md.pristine {
					if wantOK := len(md.elems) < int(q.cap); ok != wantOK || err != nil {
						t.Fatalf("put with %d of %d queued: %v, %v", len(md.elems), q.cap, ok, err)
					}
					if ok {
						md.elems = append(md.elems, e)
					}
				}
			case 1: // pop
				h0 := q.chead.Load()
				tail := int64(binary.LittleEndian.Uint64(hm[queueTailOff:]))
				var slotElem queueElem
				n := tail - h0
				if n > 0 && n <= int64(q.cap) {
					slotElem = fzReadElem(hm, q.cap, h0)
				}
				e, ok, err := q.pop()
				switch {
				case n < 0 || n > int64(q.cap):
					if ok || err == nil || !errors.Is(err, ErrProtocol) {
						t.Fatalf("pop with head %d tail %d cap %d: %v, %v; want an ErrProtocol error", h0, tail, q.cap, ok, err)
					}
				case n == 0:
					if ok || err != nil {
						t.Fatalf("pop on an empty queue: %v, %v", ok, err)
					}
				default:
					if !ok || err != nil || e != slotElem {
						t.Fatalf("pop with head %d tail %d: %+v, %v, %v; want %+v", h0, tail, e, ok, err, slotElem)
					}
					if head := int64(binary.LittleEndian.Uint64(hm[queueHeadOff:])); head != h0+1 || q.chead.Load() != h0+1 {
						t.Fatalf("pop published head %d (local %d), want %d", head, q.chead.Load(), h0+1)
					}
				}
				if md.pristine {
					if len(md.elems) == 0 {
						if ok || err != nil {
							t.Fatalf("pop of an empty queue: %+v, %v, %v", e, ok, err)
						}
					} else {
						if !ok || err != nil || e != md.elems[0] {
							t.Fatalf("pop: %+v, %v, %v; want %+v", e, ok, err, md.elems[0])
						}
						md.elems = md.elems[1:]
					}
				}
			case 2, 3: // corrupt head or tail
				off := queueHeadOff
				if op&0x7F%10 == 3 {
					off = queueTailOff
				}
				cur := int64(binary.LittleEndian.Uint64(hm[off:]))
				var v int64
				sel, raw := s.u8(), s.u64()
				switch sel % 8 {
				case 0:
					v = int64(raw)
				case 1:
					v = cur + int64(int8(raw))
				case 2:
					v = cur + int64(q.cap) + int64(raw%3) - 1
				case 3:
					v = cur - int64(q.cap) - int64(raw%3) + 1
				case 4:
					v = math.MaxInt64 - int64(raw%4)
				case 5:
					v = math.MinInt64 + int64(raw%4)
				case 6:
					v = -1 - int64(raw%4)
				default:
					v = int64(raw % 64)
				}
				binary.LittleEndian.PutUint64(hm[off:], uint64(v))
				if v != cur {
					md.pristine = false
				}
			case 4: // corrupt cap: read only at mapping, so nothing changes
				binary.LittleEndian.PutUint32(hm[queueCapOff:], s.u32())
			case 5: // markWorking
				got := q.markWorking()
				if got != (md.flag == 0) {
					t.Fatalf("markWorking with flag %d returned %v", md.flag, got)
				}
				if got {
					md.flag = 1
				}
			case 6: // setWorking
				on := s.u8()&1 != 0
				q.setWorking(on)
				md.flag = 0
				if on {
					md.flag = 1
				}
			case 7: // corrupt the flag
				md.flag = s.u32()
				binary.LittleEndian.PutUint32(hm[queueFlagOff:], md.flag)
			case 8: // isEmpty
				tail := int64(binary.LittleEndian.Uint64(hm[queueTailOff:]))
				if got := q.isEmpty(); got != (tail == q.chead.Load()) || (md.pristine && got != (len(md.elems) == 0)) {
					t.Fatalf("isEmpty = %v with tail %d head %d, %d queued", got, tail, q.chead.Load(), len(md.elems))
				}
			case 9: // raw write anywhere, then map again
				off := int(s.u32() % uint32(size))
				n := int(s.u8() % 9)
				for i := 0; i < n && off+i < size; i++ {
					mem[off+i] = s.u8()
				}
				want := mapOK()
				nc, ns, err := mapQueues(mem)
				if (err == nil) != want {
					t.Fatalf("remap: err %v, want success %v", err, want)
				}
				if err == nil {
					models[0].q, models[1].q = nc, ns
					load(models[0])
					load(models[1])
				} else if n > 0 {
					models[0].pristine, models[1].pristine = false, false
				}
			}
		}
	})
}

// fzReadElem reads the element for counter c of the queue half hm, as
// PROTOCOL.md §5.3 places it.
func fzReadElem(hm []byte, cap uint32, c int64) queueElem {
	off := queueHeaderSize + int(uint64(c)%uint64(cap))*queueElemSize
	return queueElem{
		id:     binary.LittleEndian.Uint32(hm[off:]),
		offset: binary.LittleEndian.Uint32(hm[off+4:]),
		status: binary.LittleEndian.Uint32(hm[off+8:]),
	}
}

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

	"github.com/goshm/shmipc/internal/shm"
	"github.com/goshm/shmipc/internal/wire"
)

// Fuzz targets for the bytes a peer sends on the socket: frames and the
// server handshake (the shared regions' parsers are fuzzed in
// internal/shm). Inputs live in ordinary Go memory, so any access outside
// a mapping panics, which the fuzzer reports as a crash.
//
// Run one target at a time, for example:
//
//	go test -run XXX -fuzz '^FuzzReadFrame$' -fuzztime=1000000x .
//
// A plain `go test` runs the seed corpora (f.Add and testdata/fuzz).

// ---------------------------------------------------------------------------
// Helpers

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

// fzValidQueueFile is a valid queue region of capacity cap.
func fzValidQueueFile(cap uint32) []byte {
	mem := make([]byte, shm.QueueRegionSize(cap))
	shm.InitQueues(mem, cap)
	return mem
}

// ---------------------------------------------------------------------------
// 1. FuzzReadFrame

// fzWantFrameLen is the frame length rule of docs/protocol.md §3.2 as this
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
	fallback := append(wire.AppendFallbackHead(nil, v, 5, shm.StatusOpened, 11), "hello world"...)
	emptyFallback := wire.AppendFallbackHead(nil, 2, 9, shm.StatusOpened, 0)
	hotRestart := wire.AppendHotRestart(nil, v, wire.TypeHotRestart, 42)
	hotRestartAck := wire.AppendHotRestart(nil, v, wire.TypeHotRestartAck, 42)
	pathFrame := rawPathFrame(2, 0, "/dev/shm/q", "/dev/shm/b")
	var several []byte
	for _, fr := range [][]byte{polling, streamClose, fallback, hotRestart, polling, emptyFallback, hotRestartAck, streamClose} {
		several = append(several, fr...)
	}
	// A big fallback frame: the receive buffer must grow past readBufSize.
	big := append(wire.AppendFallbackHead(nil, v, 3, shm.StatusOpened, 70000), bytes.Repeat([]byte{0xAB}, 70000)...)
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

			// What an independent reading of docs/protocol.md §3 expects.
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

// FuzzServerHandshake: the bytes a client sends during the handshake, with
// the region files it names.

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
	plans := []shm.ListPlan{{SliceCap: 4, Count: 3}, {SliceCap: 12, Count: 2}}
	mem := make([]byte, bufferRegionSize(plans)+8)
	shm.InitBuffer(mem, plans)
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
			bufPath = buf.Region().Path()
		}
		if qr != nil {
			queuePath = qr.Path()
		}
		s.releaseRegions()

		// Whatever happened, nothing stays mapped or cached.
		if buf != nil {
			if n := refCount(buf.Region()); n != 0 || buf.Region().Mem() != nil {
				t.Fatalf("buffer region %s still has %d references after release", bufPath, n)
			}
			if cachedBuffers(bufPath) != 0 {
				t.Fatalf("buffer region %s is still cached after release", bufPath)
			}
		}
		if qr != nil {
			if n := refCount(qr); n != 0 || qr.Mem() != nil {
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

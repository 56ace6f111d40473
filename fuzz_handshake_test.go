package shmipc

// FuzzServerHandshake: the bytes a client sends during the handshake, with
// the region files it names.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/goshm/shmipc/internal/shm"
	"github.com/goshm/shmipc/internal/wire"
)

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

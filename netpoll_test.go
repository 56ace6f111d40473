package shmipc

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
	"slices"
	"testing"
	"time"
	"unsafe"

	"github.com/cloudwego/netpoll"
)

const npTimeout = 30 * time.Second

// npConfig is the default configuration with region names of its own.
func npConfig(t *testing.T, tweak func(*Config)) *Config {
	conf := DefaultConfig()
	conf.ShareMemoryPathPrefix = shmPrefix(t, "np")
	conf.InitializeTimeout = 10 * time.Second // handshakes are slow under -race
	if tweak != nil {
		tweak(conf)
	}
	return conf
}

// npSmallSlices makes every slice 4096 bytes (and 64 KiB for a few), so
// that messages span slices.
func npSmallSlices(c *Config) {
	c.ShareMemoryBufferCap = 4 << 20
	c.BufferSliceSizes = []SizePercentPair{{Size: 4096, Percent: 60}, {Size: 64 << 10, Percent: 40}}
	c.MaxFallbackFrameSize = minFallbackFrame
}

// npSessions connects a client to a Listener over a Unix socket in
// t.TempDir() and returns a client stream and the server's side of it. The
// client sends one byte to open the stream; the server has consumed it.
func npSessions(t *testing.T, tweak func(*Config)) (client, server *Stream) {
	t.Helper()
	conf := npConfig(t, tweak)
	sock := filepath.Join(t.TempDir(), "np.sock")
	ln, err := Listen("unix", sock, conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	sess, err := Dial("unix", sock, conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sess.Close() })
	client, err = sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	if _, err := client.Write([]byte{'!'}); err != nil {
		t.Fatal(err)
	}
	server = acceptWithin(t, ln, npTimeout)
	t.Cleanup(func() { server.Close() })
	client.SetReadDeadline(time.Now().Add(npTimeout))
	server.SetReadDeadline(time.Now().Add(npTimeout))
	r := server.NetpollReader()
	if b, err := r.ReadByte(); err != nil || b != '!' {
		t.Fatalf("first byte: %q, %v", b, err)
	}
	if err := r.Release(); err != nil {
		t.Fatal(err)
	}
	return client, server
}

func npPattern(n int, seed uint64) []byte {
	rng := rand.New(rand.NewPCG(seed, uint64(n)))
	p := make([]byte, n)
	for i := range p {
		p[i] = byte(rng.Uint32())
	}
	return p
}

// --- A length-prefixed codec written only against netpoll's interfaces.

// npEncode writes msg as a 4-byte big-endian length and the bytes, and
// flushes. Small bodies are built in place with Malloc, large ones copied
// with WriteBinary.
func npEncode(w netpoll.Writer, msg []byte) error {
	hdr, err := w.Malloc(4)
	if err != nil {
		return err
	}
	binary.BigEndian.PutUint32(hdr, uint32(len(msg)))
	if len(msg) <= 64<<10 {
		body, err := w.Malloc(len(msg))
		if err != nil {
			return err
		}
		copy(body, msg)
	} else if _, err := w.WriteBinary(msg); err != nil {
		return err
	}
	return w.Flush()
}

// npDecode reads one message. The body is valid until r.Release.
func npDecode(r netpoll.Reader) ([]byte, error) {
	hdr, err := r.Peek(4)
	if err != nil {
		return nil, err
	}
	n := int(binary.BigEndian.Uint32(hdr))
	frame, err := r.Next(4 + n)
	if err != nil {
		return nil, err
	}
	return frame[4:], nil
}

// TestNetpollCodecEcho sends messages of 0 B to 2 MiB through the codec from
// client to server, which echoes them back through the codec, and checks
// every byte, with the default slices and with small ones.
func TestNetpollCodecEcho(t *testing.T) {
	for _, tc := range []struct {
		name  string
		tweak func(*Config)
	}{{"default", nil}, {"smallslices", npSmallSlices}} {
		t.Run(tc.name, func(t *testing.T) {
			client, server := npSessions(t, tc.tweak)
			sizes := []int{0, 1, 3, 4, 5, 100, 4092, 4096, 4097, 8172, 8173, 32748, 65536, 65537, 131052, 131053, 500000, 1 << 20, 2 << 20}
			rng := rand.New(rand.NewPCG(1, 2))
			for range shortOr(40, 12) { // with -short, fewer random large sizes
				sizes = append(sizes, rng.IntN(2<<20+1))
			}
			for range 100 {
				sizes = append(sizes, rng.IntN(300))
			}
			msgs := make([][]byte, len(sizes))
			for i, n := range sizes {
				msgs[i] = npPattern(n, uint64(i))
			}

			srvErr := make(chan error, 1)
			go func() {
				r, w := server.NetpollReader(), server.NetpollWriter()
				for range msgs {
					body, err := npDecode(r)
					if err != nil {
						srvErr <- fmt.Errorf("server decode: %w", err)
						return
					}
					if err := npEncode(w, body); err != nil {
						srvErr <- fmt.Errorf("server encode: %w", err)
						return
					}
					if err := r.Release(); err != nil {
						srvErr <- err
						return
					}
				}
				srvErr <- nil
			}()
			// The client pipelines, but keeps at most budget bytes in
			// flight, as an RPC client bounds its outstanding requests:
			// with back-pressure on shared memory, unbounded pipelining
			// against an echo server deadlocks once the region is full.
			budget := int(client.s.buf.capacity / 4)
			acks := make(chan int, len(msgs))
			cliErr := make(chan error, 1)
			go func() {
				w := client.NetpollWriter()
				inflight := 0
				for i, m := range msgs {
					for inflight > 0 && inflight+len(m) > budget {
						inflight -= <-acks
					}
					inflight += len(m)
					if err := npEncode(w, m); err != nil {
						cliErr <- fmt.Errorf("client encode %d: %w", i, err)
						return
					}
				}
				cliErr <- nil
			}()
			r := client.NetpollReader()
			for i, want := range msgs {
				got, err := npDecode(r)
				if err != nil {
					t.Fatalf("message %d (%d bytes): %v", i, len(want), err)
				}
				if !bytes.Equal(got, want) {
					t.Fatalf("message %d (%d bytes): echo differs at %d", i, len(want), npFirstDiff(got, want))
				}
				if err := r.Release(); err != nil {
					t.Fatal(err)
				}
				acks <- len(want)
			}
			for _, ch := range []chan error{cliErr, srvErr} {
				if err := <-ch; err != nil {
					t.Fatal(err)
				}
			}
			if n := r.Len(); n != 0 {
				t.Fatalf("%d bytes left over", n)
			}
		})
	}
}

func npFirstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// npInShm reports whether p lies in the session's buffer region.
func npInShm(st *Stream, p []byte) bool {
	mem := st.s.buf.mem
	lo := uintptr(unsafe.Pointer(unsafe.SliceData(mem)))
	a := uintptr(unsafe.Pointer(unsafe.SliceData(p)))
	return a >= lo && a+uintptr(len(p)) <= lo+uintptr(len(mem))
}

// npAliasesSegment reports whether p lies in one of the stream's received
// segments.
func npAliasesSegment(st *Stream, p []byte) bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	a := uintptr(unsafe.Pointer(unsafe.SliceData(p)))
	for _, seg := range st.reader.segs {
		lo := uintptr(unsafe.Pointer(unsafe.SliceData(seg.data)))
		if a >= lo && a+uintptr(len(p)) <= lo+uintptr(len(seg.data)) {
			return true
		}
	}
	return false
}

// npWaitLen waits until r has n bytes.
func npWaitLen(t *testing.T, r netpoll.Reader, n int) {
	t.Helper()
	if _, err := r.Peek(n); err != nil {
		t.Fatalf("waiting for %d bytes: %v", n, err)
	}
}

func TestNetpollNextZeroCopy(t *testing.T) {
	client, server := npSessions(t, nil)
	msg := npPattern(1000, 7)
	if _, err := client.Write(msg); err != nil {
		t.Fatal(err)
	}
	r := server.NetpollReader()
	p, err := r.Peek(10)
	if err != nil {
		t.Fatal(err)
	}
	if !npAliasesSegment(server, p) || !npInShm(server, p) {
		t.Fatal("Peek of single-slice data is not zero-copy")
	}
	p, err = r.Next(1000)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(p, msg) {
		t.Fatal("Next returned other bytes")
	}
	if !npAliasesSegment(server, p) || !npInShm(server, p) {
		t.Fatal("Next of single-slice data is not zero-copy")
	}
	if r.Len() != 0 {
		t.Fatalf("Len %d after reading everything", r.Len())
	}
	if err := r.Release(); err != nil {
		t.Fatal(err)
	}
	if p, err := r.Next(0); err != nil || p == nil || len(p) != 0 {
		t.Fatalf("Next(0) = %v, %v", p, err)
	}
}

func TestNetpollNextAcrossSegments(t *testing.T) {
	client, server := npSessions(t, npSmallSlices)
	msg := npPattern(10000, 8)
	w := client.NetpollWriter()
	for _, part := range [][]byte{msg[:3000], msg[3000:6000], msg[6000:9000], msg[9000:]} {
		p, err := w.Malloc(len(part)) // 3000 bytes take a 4096-byte slice each
		if err != nil {
			t.Fatal(err)
		}
		copy(p, part)
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	r := server.NetpollReader()
	npWaitLen(t, r, len(msg))
	server.mu.Lock()
	nsegs := len(server.reader.segs)
	server.mu.Unlock()
	if nsegs < 2 {
		t.Fatalf("message arrived in %d segment(s); the test needs several", nsegs)
	}
	// The copy path allocates nothing once the arena has grown.
	allocs := testing.AllocsPerRun(100, func() {
		p, err := r.Peek(len(msg))
		if err != nil || !bytes.Equal(p, msg) {
			t.Fatalf("Peek across segments: %v", err)
		}
		if err := r.Release(); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Errorf("Peek across segments + Release: %v allocations per run, want 0", allocs)
	}
	p, err := r.Next(5000) // spans the first two slices (3000 + 2000)
	if err != nil || !bytes.Equal(p, msg[:5000]) {
		t.Fatalf("Next across segments: %v", err)
	}
	if npInShm(server, p) {
		t.Fatal("Next across segments returned shared memory")
	}
	q, err := r.Next(100) // within the second slice (bytes 2000..2100)
	if err != nil || !bytes.Equal(q, msg[5000:5100]) {
		t.Fatalf("Next: %v", err)
	}
	if !npInShm(server, q) {
		t.Fatal("Next within one slice is not zero-copy")
	}
	if !bytes.Equal(p, msg[:5000]) {
		t.Fatal("copy changed before Release")
	}
	if r.Len() != len(msg)-5100 {
		t.Fatalf("Len %d, want %d", r.Len(), len(msg)-5100)
	}
	rest, err := r.Next(len(msg) - 5100)
	if err != nil || !bytes.Equal(rest, msg[5100:]) {
		t.Fatalf("Next rest: %v", err)
	}
	if err := r.Release(); err != nil {
		t.Fatal(err)
	}
}

func TestNetpollUntilSkipSlice(t *testing.T) {
	client, server := npSessions(t, npSmallSlices)
	w := client.NetpollWriter()
	long := bytes.Repeat([]byte("x"), 6000) // a line spanning slices
	text := "hello\nworld\n" + string(long) + "\nnew"
	if _, err := w.WriteString(text); err != nil {
		t.Fatal(err)
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	r := server.NetpollReader()
	check := func(what string, got []byte, err error, want string) {
		t.Helper()
		if err != nil || string(got) != want {
			t.Fatalf("%s = %q (%d bytes), %v; want %q", what, got[:min(len(got), 20)], len(got), err, want[:min(len(want), 20)])
		}
	}
	line, err := r.Until('\n')
	check("Until", line, err, "hello\n")
	if err := r.Skip(2); err != nil {
		t.Fatal(err)
	}
	line, err = r.Until('\n')
	check("Until after Skip", line, err, "rld\n")
	line, err = r.Until('\n')
	check("Until across slices", line, err, string(long)+"\n")

	// Until waits for the delimiter to arrive.
	done := make(chan struct{})
	go func() {
		defer close(done)
		line, err := r.Until(';')
		if err != nil || string(line) != "new line;" {
			t.Errorf("blocking Until = %q, %v", line, err)
		}
	}()
	time.Sleep(20 * time.Millisecond)
	if _, err := client.Write([]byte(" line")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond)
	if _, err := client.Write([]byte(";slice me, and more")); err != nil {
		t.Fatal(err)
	}
	<-done

	npWaitLen(t, r, len("slice me, and more"))
	s, err := r.Slice(8)
	if err != nil {
		t.Fatal(err)
	}
	if s.Len() != 8 {
		t.Fatalf("Slice Len %d", s.Len())
	}
	sp, err := s.Next(8)
	check("Slice", sp, err, "slice me")
	if str, err := r.ReadString(2); err != nil || str != ", " {
		t.Fatalf("ReadString = %q, %v", str, err)
	}
	b, err := r.ReadBinary(3)
	check("ReadBinary", b, err, "and")
	if npInShm(server, b) {
		t.Fatal("ReadBinary returned shared memory")
	}
	if c, err := r.ReadByte(); err != nil || c != ' ' {
		t.Fatalf("ReadByte = %q, %v", c, err)
	}
	if r.Len() != 4 {
		t.Fatalf("Len %d, want 4", r.Len())
	}

	// After the peer closes: Until returns the rest and io.EOF.
	client.Close()
	line, err = r.Until('\n')
	if string(line) != "more" || !errors.Is(err, io.EOF) {
		t.Fatalf("Until at end = %q, %v; want \"more\", io.EOF", line, err)
	}
	for what, f := range map[string]func() error{
		"Next":       func() error { _, err := r.Next(1); return err },
		"Peek":       func() error { _, err := r.Peek(1); return err },
		"Skip":       func() error { return r.Skip(1) },
		"ReadByte":   func() error { _, err := r.ReadByte(); return err },
		"ReadString": func() error { _, err := r.ReadString(1); return err },
		"ReadBinary": func() error { _, err := r.ReadBinary(1); return err },
		"Slice":      func() error { _, err := r.Slice(1); return err },
		"Until":      func() error { _, err := r.Until('x'); return err },
	} {
		if err := f(); !errors.Is(err, io.EOF) {
			t.Errorf("%s after peer close: %v, want io.EOF", what, err)
		}
	}
	if err := server.NetpollWriter().WriteByte(1); !errors.Is(err, ErrStreamPeerClosed) {
		t.Errorf("WriteByte after peer close: %v, want ErrStreamPeerClosed", err)
	}
	if _, err := server.NetpollWriter().Malloc(1); !errors.Is(err, ErrStreamPeerClosed) {
		t.Errorf("Malloc after peer close: %v, want ErrStreamPeerClosed", err)
	}
}

func TestNetpollPeerCloseShortRead(t *testing.T) {
	client, server := npSessions(t, nil)
	if _, err := client.Write([]byte("abcde")); err != nil {
		t.Fatal(err)
	}
	client.Close()
	r := server.NetpollReader()
	p, err := r.Next(3)
	if err != nil || string(p) != "abc" {
		t.Fatalf("Next(3) = %q, %v", p, err)
	}
	if _, err := r.Next(5); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("Next(5) with 2 left after close: %v, want io.ErrUnexpectedEOF", err)
	}
	if err := r.Skip(2); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Next(1); !errors.Is(err, io.EOF) {
		t.Fatalf("Next at end: %v, want io.EOF", err)
	}
	server.Close()
	if _, err := r.Next(1); !errors.Is(err, ErrStreamClosed) {
		t.Fatalf("Next after Close: %v, want ErrStreamClosed", err)
	}
}

func TestNetpollSessionClose(t *testing.T) {
	client, server := npSessions(t, nil)
	r := server.NetpollReader()
	errc := make(chan error, 1)
	go func() { _, err := r.Next(1); errc <- err }()
	time.Sleep(20 * time.Millisecond)
	client.Session().Close()
	select {
	case err := <-errc:
		if !errors.Is(err, ErrSessionClosed) {
			t.Fatalf("Next when the peer session closed: %v, want ErrSessionClosed", err)
		}
	case <-time.After(npTimeout):
		t.Fatal("Next did not return after the session closed")
	}
	if _, err := client.NetpollWriter().Malloc(1); err == nil {
		t.Fatal("Malloc on a closed session succeeded")
	}
}

func TestNetpollReadDeadline(t *testing.T) {
	_, server := npSessions(t, nil)
	r := server.NetpollReader()
	for what, f := range map[string]func() error{
		"Next":  func() error { _, err := r.Next(1); return err },
		"Peek":  func() error { _, err := r.Peek(4); return err },
		"Skip":  func() error { return r.Skip(1) },
		"Until": func() error { _, err := r.Until('\n'); return err },
		"Slice": func() error { _, err := r.Slice(2); return err },
	} {
		start := time.Now() // before the deadline is set: a pause between cannot fail the check
		server.SetReadDeadline(start.Add(30 * time.Millisecond))
		err := f()
		var ne net.Error
		if !errors.As(err, &ne) || !ne.Timeout() || !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Errorf("%s past the deadline: %v, want a timeout", what, err)
		}
		if d := time.Since(start); d < 30*time.Millisecond {
			t.Errorf("%s returned after %v, before the deadline", what, d)
		}
	}
}

func TestNetpollMallocAck(t *testing.T) {
	client, server := npSessions(t, npSmallSlices)
	free0 := client.s.buf.freeCounts()
	w := client.NetpollWriter()
	var bufs [][]byte
	for _, c := range []byte("abc") {
		p, err := w.Malloc(3000) // one 4096-byte slice each
		if err != nil {
			t.Fatal(err)
		}
		if len(p) != 3000 {
			t.Fatalf("Malloc(3000) returned %d bytes", len(p))
		}
		for j := range p {
			p[j] = c
		}
		bufs = append(bufs, p)
	}
	if n := len(client.writer.segs); n != 3 {
		t.Fatalf("%d segments, want 3", n)
	}
	// Each buffer is shared memory of its own: none was overwritten by a
	// later Malloc's bytes.
	for i, p := range bufs {
		if !npInShm(client, p) {
			t.Errorf("buffer %d is not in shared memory", i)
		}
		if want := bytes.Repeat([]byte{"abc"[i]}, len(p)); !bytes.Equal(p, want) {
			t.Errorf("buffer %d holds other bytes than the %q written to it", i, "abc"[i])
		}
	}
	if w.MallocLen() != 9000 {
		t.Fatalf("MallocLen %d", w.MallocLen())
	}
	if err := w.MallocAck(9001); err == nil {
		t.Fatal("MallocAck beyond MallocLen succeeded")
	}
	if err := w.MallocAck(4000); err != nil { // into the second segment
		t.Fatal(err)
	}
	if w.MallocLen() != 4000 || len(client.writer.segs) != 2 || client.writer.segs[1].n != 1000 {
		t.Fatalf("after MallocAck(4000): MallocLen %d, %d segments", w.MallocLen(), len(client.writer.segs))
	}
	if err := w.MallocAck(3000); err != nil { // exactly the end of the first
		t.Fatal(err)
	}
	if w.MallocLen() != 3000 || len(client.writer.segs) != 1 {
		t.Fatalf("after MallocAck(3000): MallocLen %d, %d segments", w.MallocLen(), len(client.writer.segs))
	}
	if _, err := w.WriteString("tail"); err != nil {
		t.Fatal(err)
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	want := append(bytes.Repeat([]byte("a"), 3000), "tail"...)
	r := server.NetpollReader()
	got, err := r.Next(len(want))
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("received %d bytes, %v", len(got), err)
	}
	// MallocAck(0) drops everything; Flush then sends nothing.
	if _, err := w.Malloc(100); err != nil {
		t.Fatal(err)
	}
	if err := w.MallocAck(0); err != nil || w.MallocLen() != 0 {
		t.Fatalf("MallocAck(0): %v, MallocLen %d", err, w.MallocLen())
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := r.Release(); err != nil {
		t.Fatal(err)
	}
	if r.Len() != 0 {
		t.Fatalf("%d unexpected bytes", r.Len())
	}
	if free := client.s.buf.freeCounts(); !slices.Equal(free, free0) {
		t.Fatalf("free slices %v after everything was released, want %v", free, free0)
	}
}

func TestNetpollWriteDirect(t *testing.T) {
	client, server := npSessions(t, nil)
	w := client.NetpollWriter()
	buf, err := w.Malloc(10)
	if err != nil {
		t.Fatal(err)
	}
	copy(buf, "AAAA")
	if err := w.WriteDirect([]byte("XYZ"), 6); err != nil {
		t.Fatal(err)
	}
	copy(buf[4:], "BBBBBB") // filled after WriteDirect, as netpoll allows
	if w.MallocLen() != 13 {
		t.Fatalf("MallocLen %d, want 13", w.MallocLen())
	}
	if err := w.WriteByte('!'); err != nil {
		t.Fatal(err)
	}
	if err := w.WriteDirect([]byte("<>"), 0); err != nil {
		t.Fatal(err)
	}
	if err := w.WriteDirect([]byte("x"), 100); err == nil {
		t.Fatal("WriteDirect with remainCap beyond MallocLen succeeded")
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	r := server.NetpollReader()
	got, err := r.Next(16)
	if err != nil || string(got) != "AAAAXYZBBBBBB!<>" {
		t.Fatalf("got %q, %v", got, err)
	}
	r.Release()
}

// TestNetpollWriterModel runs random sequences of Malloc, WriteBinary,
// WriteDirect, MallocAck and late fills of Malloc'ed bytes against a stream
// and against a netpoll.LinkBuffer, and checks that the stream sends what
// the LinkBuffer holds, and that no slice of shared memory leaks.
func TestNetpollWriterModel(t *testing.T) {
	for _, tc := range []struct {
		name  string
		tweak func(*Config)
	}{{"default", nil}, {"smallslices", npSmallSlices}} {
		t.Run(tc.name, func(t *testing.T) {
			client, server := npSessions(t, tc.tweak)
			free0 := client.s.buf.freeCounts()
			w := client.NetpollWriter()
			r := server.NetpollReader()
			rng := rand.New(rand.NewPCG(3, 4))
			size := func() int {
				switch rng.IntN(4) {
				case 0:
					return rng.IntN(8)
				case 1:
					return rng.IntN(200)
				case 2:
					return rng.IntN(5000)
				}
				return rng.IntN(20000)
			}
			for msg := range 150 {
				lb := netpoll.NewLinkBuffer()
				type pending struct{ a, b []byte } // ours, the model's
				var open []pending
				fill := func(i int) {
					data := npPattern(len(open[i].a), rng.Uint64())
					copy(open[i].a, data)
					copy(open[i].b, data)
					open = slices.Delete(open, i, i+1)
				}
				var ops []string
				for range 1 + rng.IntN(12) {
					switch k := rng.IntN(10); {
					case k < 3:
						n := size()
						a, err := w.Malloc(n)
						if err != nil {
							t.Fatal(err)
						}
						b, _ := lb.Malloc(n)
						open = append(open, pending{a, b})
						ops = append(ops, fmt.Sprintf("Malloc(%d)", n))
					case k < 5:
						p := npPattern(size(), rng.Uint64())
						if _, err := w.WriteBinary(p); err != nil {
							t.Fatal(err)
						}
						lb.WriteBinary(p)
						ops = append(ops, fmt.Sprintf("WriteBinary(%d)", len(p)))
					case k < 8:
						p := npPattern(1+size(), rng.Uint64())
						remain := rng.IntN(w.MallocLen() + 1)
						if err := w.WriteDirect(p, remain); err != nil {
							t.Fatal(err)
						}
						lb.WriteDirect(p, remain)
						ops = append(ops, fmt.Sprintf("WriteDirect(%d, %d)", len(p), remain))
					case k < 9 && len(open) > 0:
						fill(rng.IntN(len(open)))
						ops = append(ops, "fill")
					default:
						for len(open) > 0 { // MallocAck invalidates slices
							fill(0)
						}
						n := rng.IntN(w.MallocLen() + 1)
						if err := w.MallocAck(n); err != nil {
							t.Fatal(err)
						}
						lb.MallocAck(n)
						ops = append(ops, fmt.Sprintf("MallocAck(%d)", n))
					}
					if w.MallocLen() != lb.MallocLen() {
						t.Fatalf("message %d after %v: MallocLen %d, model %d", msg, ops, w.MallocLen(), lb.MallocLen())
					}
				}
				for len(open) > 0 {
					fill(rng.IntN(len(open)))
				}
				n := w.MallocLen()
				if err := w.Flush(); err != nil {
					t.Fatal(err)
				}
				lb.Flush()
				want, _ := lb.Next(lb.Len())
				got, err := r.Next(n)
				if err != nil {
					t.Fatalf("message %d: %v", msg, err)
				}
				if !bytes.Equal(got, want) {
					t.Fatalf("message %d after %v: %d bytes differ from the model's %d at %d", msg, ops, len(got), len(want), npFirstDiff(got, want))
				}
				if err := r.Release(); err != nil {
					t.Fatal(err)
				}
			}
			if free := client.s.buf.freeCounts(); !slices.Equal(free, free0) {
				t.Fatalf("free slices %v after everything was released, want %v", free, free0)
			}
		})
	}
}

func TestNetpollAppend(t *testing.T) {
	client, server := npSessions(t, nil)
	other, otherServer := npSessions(t, npSmallSlices)
	w := client.NetpollWriter()
	if _, err := w.WriteString("head|"); err != nil {
		t.Fatal(err)
	}

	lb := netpoll.NewLinkBuffer()
	lb.WriteString("flushed|")
	lb.Flush()
	p, _ := lb.Malloc(9)
	copy(p, "unflushed")
	if err := w.Append(lb); err != nil {
		t.Fatal(err)
	}
	if lb.Len() != 0 || lb.MallocLen() != 0 {
		t.Fatalf("LinkBuffer not emptied: Len %d, MallocLen %d", lb.Len(), lb.MallocLen())
	}

	ow := other.NetpollWriter()
	big := npPattern(10000, 9) // several slices of the other session
	buf, _ := ow.Malloc(1)
	ow.WriteDirect(big, 1)
	buf[0] = '|'
	if err := w.Append(ow); err != nil {
		t.Fatal(err)
	}
	if ow.MallocLen() != 0 {
		t.Fatalf("appended writer keeps %d bytes", ow.MallocLen())
	}
	if err := w.Append(w); !errors.Is(err, ErrNotSupported) {
		t.Fatalf("Append to itself: %v", err)
	}
	if err := w.Append(netpoll.NewWriter(io.Discard)); !errors.Is(err, ErrNotSupported) {
		t.Fatalf("Append of another writer type: %v", err)
	}
	want := append([]byte("head|flushed|unflushed"), big...)
	want = append(want, '|')
	if w.MallocLen() != len(want) {
		t.Fatalf("MallocLen %d, want %d", w.MallocLen(), len(want))
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	got, err := server.NetpollReader().Next(len(want))
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("got %d bytes, %v", len(got), err)
	}
	// The other stream still works and sent nothing.
	if err := ow.Flush(); err != nil {
		t.Fatal(err)
	}
	if n := otherServer.NetpollReader().Len(); n != 0 {
		t.Fatalf("the appended writer's stream received %d bytes", n)
	}
}

// TestNetpollWriteDirectStale checks that a WriteDirect whose message was
// discarded elsewhere (here by a failed Stream.Flush after Close) does not
// write into memory the writer no longer owns.
func TestNetpollWriteDirectStale(t *testing.T) {
	client, _ := npSessions(t, nil)
	w := client.NetpollWriter()
	buf, _ := w.Malloc(8)
	if err := w.WriteDirect([]byte("direct"), 4); err != nil {
		t.Fatal(err)
	}
	copy(buf, "12345678")
	client.Close()
	if err := w.Flush(); !errors.Is(err, ErrStreamClosed) {
		t.Fatalf("Flush after Close: %v, want ErrStreamClosed", err)
	}
	if w.MallocLen() != 0 {
		t.Fatalf("MallocLen %d after a failed Flush", w.MallocLen())
	}
}

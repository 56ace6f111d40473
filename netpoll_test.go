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
	"runtime"
	"testing"
	"time"

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
			budget := 0 // a quarter of what the region can hand out (a list keeps its last slice)
			for _, l := range client.s.buf.Lists() {
				budget += int(l.Count-1) * int(l.SliceCap) / 4
			}
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

// TestNetpollAnnouncedLengthCostsNothing: reads of a length no bytes back
// yet (in a codec, a length prefix the peer sent) allocate nothing while
// they wait, however large the length.
func TestNetpollAnnouncedLengthCostsNothing(t *testing.T) {
	_, server := npSessions(t, nil)
	r := server.NetpollReader()
	for what, f := range map[string]func() error{
		"ReadBinary": func() error { _, err := r.ReadBinary(1 << 50); return err },
		"ReadString": func() error { _, err := r.ReadString(1 << 30); return err },
		"Slice":      func() error { _, err := r.Slice(1 << 30); return err },
	} {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		server.SetReadDeadline(time.Now().Add(30 * time.Millisecond))
		err := f()
		runtime.ReadMemStats(&after)
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Errorf("%s with no data: %v, want a timeout", what, err)
		}
		if n := after.TotalAlloc - before.TotalAlloc; n > 1<<20 {
			t.Errorf("%s allocated %d bytes while it waited", what, n)
		}
	}
}

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
	"slices"
	"sync"
	"testing"
	"time"
)

// streamTestTimeout bounds every blocking step of these tests, so that a lost
// wake-up fails the test instead of hanging it.
const streamTestTimeout = 20 * time.Second

// streamTestSizes are message sizes around the slice sizes of the default
// configuration (8172, 32748 and 131052 data bytes per slice).
var streamTestSizes = []int{1, 64, 4096, 8172, 8173, 32748, 131052, 131053, 300000, 1 << 20, 4 << 20}

// forEachStreamMode runs test as a subtest for each transport of the
// matrix: a Unix socket with memfd regions and with /dev/shm file regions.
func forEachStreamMode(t *testing.T, test func(t *testing.T, mode MemMapType)) {
	for _, mode := range bothModes {
		t.Run(mode.String(), func(t *testing.T) { test(t, mode) })
	}
}

// streamTestConfig is the default configuration with its own region names, so
// that leftover files can be found and concurrent test runs do not collide.
func streamTestConfig(t *testing.T, mode MemMapType) *Config {
	conf := DefaultConfig()
	conf.MemMapType = mode
	conf.ShareMemoryPathPrefix = shmPrefix(t, "st")
	// A loaded machine (CI runs suites side by side, -race) can take more
	// than the default second for a handshake.
	conf.InitializeTimeout = 10 * time.Second
	return conf
}

// streamTestPair is a client session and the server session it is connected
// to.
type streamTestPair struct {
	client *Session
	server *Session
}

// newStreamTestPair connects a client and a server session over a Unix socket
// in t.TempDir(). tweak, if not nil, adjusts the configuration of both sides.
// Both sessions are closed when the test ends.
func newStreamTestPair(t *testing.T, mode MemMapType, tweak func(*Config)) *streamTestPair {
	t.Helper()
	conf := streamTestConfig(t, mode)
	if tweak != nil {
		tweak(conf)
	}
	serverConf := *conf
	sock := filepath.Join(t.TempDir(), "s.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	type result struct {
		s   *Session
		err error
	}
	accepted := make(chan result, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			accepted <- result{nil, err}
			return
		}
		s, err := Server(c, &serverConf)
		accepted <- result{s, err}
	}()
	client, err := Dial("unix", sock, conf)
	if err != nil {
		t.Fatalf("Dial (%v): %v", mode, err)
	}
	t.Cleanup(func() { client.Close() })
	var r result
	select {
	case r = <-accepted:
	case <-time.After(streamTestTimeout):
		t.Fatal("server handshake did not finish")
	}
	if r.err != nil {
		t.Fatalf("Server (%v): %v", mode, r.err)
	}
	t.Cleanup(func() { r.s.Close() })
	return &streamTestPair{client: client, server: r.s}
}

// openStreamT opens a client stream that is closed when the test ends. Its
// read deadline keeps a broken test from hanging.
func openStreamT(t *testing.T, s *Session) *Stream {
	t.Helper()
	st, err := s.OpenStream()
	if err != nil {
		t.Fatalf("OpenStream: %v", err)
	}
	st.SetReadDeadline(time.Now().Add(streamTestTimeout))
	t.Cleanup(func() { st.Close() })
	return st
}

// acceptStreamT waits for the next stream on a server session.
func acceptStreamT(t *testing.T, s *Session) *Stream {
	t.Helper()
	st := acceptWithin(t, s, streamTestTimeout)
	st.SetReadDeadline(time.Now().Add(streamTestTimeout))
	t.Cleanup(func() { st.Close() })
	return st
}

// streamPattern returns n pseudo-random bytes; each seed gives other bytes.
func streamPattern(n int, seed uint64) []byte {
	var key [32]byte
	binary.LittleEndian.PutUint64(key[:], seed)
	p := make([]byte, n)
	rand.NewChaCha8(key).Read(p)
	return p
}

// serveFrameEcho accepts streams on srv until it is closed and echoes, on
// each, frames of a big-endian u32 length n followed by n bytes. The length
// and the body go back as two messages, so each body message has exactly the
// size the client sent.
func serveFrameEcho(srv *Session) {
	for {
		st, err := srv.AcceptStream()
		if err != nil {
			return
		}
		go echoFrames(st)
	}
}

// maxEchoFrame is larger than any frame these tests send. A longer length
// means the echo server read bytes out of order; it then closes the stream
// rather than allocate gigabytes.
const maxEchoFrame = 16 << 20

func echoFrames(st *Stream) {
	defer st.Close()
	var hdr [4]byte
	for {
		if _, err := io.ReadFull(st, hdr[:]); err != nil {
			return
		}
		n := binary.BigEndian.Uint32(hdr[:])
		if n > maxEchoFrame {
			return
		}
		body := make([]byte, n)
		if _, err := io.ReadFull(st, body); err != nil {
			return
		}
		if _, err := st.Write(hdr[:]); err != nil {
			return
		}
		if _, err := st.Write(body); err != nil {
			return
		}
	}
}

// echoWithReadWrite sends msg as a frame with Write and reads the echo with
// Read.
func echoWithReadWrite(st *Stream, msg []byte) error {
	var hdr [4]byte
	binary.BigEndian.PutUint32(hdr[:], uint32(len(msg)))
	if _, err := st.Write(hdr[:]); err != nil {
		return fmt.Errorf("write header of %d: %w", len(msg), err)
	}
	if n, err := st.Write(msg); err != nil || n != len(msg) {
		return fmt.Errorf("write %d bytes: wrote %d, %v", len(msg), n, err)
	}
	got := make([]byte, 4+len(msg))
	if _, err := io.ReadFull(st, got); err != nil {
		return fmt.Errorf("read echo of %d bytes: %w", len(msg), err)
	}
	return checkEcho(got[:4], got[4:], msg)
}

// echoInOneWrite is echoWithReadWrite with the frame's header and body
// written in one Write.
func echoInOneWrite(st *Stream, msg []byte) error {
	frame := binary.BigEndian.AppendUint32(make([]byte, 0, 4+len(msg)), uint32(len(msg)))
	frame = append(frame, msg...)
	if n, err := st.Write(frame); err != nil || n != len(frame) {
		return fmt.Errorf("write a frame of %d bytes: wrote %d, %v", len(frame), n, err)
	}
	got := make([]byte, len(frame))
	if _, err := io.ReadFull(st, got); err != nil {
		return fmt.Errorf("read echo of %d bytes: %w", len(msg), err)
	}
	return checkEcho(got[:4], got[4:], msg)
}

// echoWithBuffers sends msg as a frame built with BufferWriter and reads the
// echo with BufferReader. Messages that fit in one slice are filled through
// Reserve; larger ones with WriteBytes and a Reserve for their tail.
func echoWithBuffers(st *Stream, msg []byte) error {
	n := len(msg)
	bw := st.BufferWriter()
	hdr, err := bw.Reserve(4)
	if err != nil {
		return fmt.Errorf("reserve header: %w", err)
	}
	binary.BigEndian.PutUint32(hdr, uint32(n))
	if err := st.Flush(false); err != nil {
		return fmt.Errorf("flush header of %d: %w", n, err)
	}
	if n <= int(st.Session().buf.maxSliceCap()) {
		b, err := bw.Reserve(n)
		if err != nil {
			return fmt.Errorf("reserve %d: %w", n, err)
		}
		copy(b, msg)
	} else {
		tail := 1000
		if _, err := bw.WriteBytes(msg[:n-tail]); err != nil {
			return fmt.Errorf("WriteBytes %d: %w", n-tail, err)
		}
		b, err := bw.Reserve(tail)
		if err != nil {
			return fmt.Errorf("reserve tail of %d: %w", n, err)
		}
		copy(b, msg[n-tail:])
	}
	if got := bw.Len(); got != n {
		return fmt.Errorf("BufferWriter.Len() = %d before Flush, want %d", got, n)
	}
	if err := st.Flush(false); err != nil {
		return fmt.Errorf("flush %d bytes: %w", n, err)
	}
	br := st.BufferReader()
	gotHdr, err := br.ReadBytes(4)
	if err != nil {
		return fmt.Errorf("ReadBytes(4) for echo of %d: %w", n, err)
	}
	body, err := br.ReadBytes(n)
	if err != nil {
		return fmt.Errorf("ReadBytes(%d): %w", n, err)
	}
	err = checkEcho(gotHdr, body, msg)
	br.ReleasePreviousRead()
	return err
}

func checkEcho(hdr, body, want []byte) error {
	if n := binary.BigEndian.Uint32(hdr); n != uint32(len(want)) {
		return fmt.Errorf("echo header says %d bytes, sent %d", n, len(want))
	}
	if !bytes.Equal(body, want) {
		return fmt.Errorf("echo of %d bytes (got %d) differs first at byte %d", len(want), len(body), firstDiff(body, want))
	}
	return nil
}

// waitFreeListsFull waits until every slice of s's buffer region is back on
// its free list. The peer frees asynchronously, hence the polling.
func waitFreeListsFull(t *testing.T, s *Session) {
	t.Helper()
	want := make([]int32, len(s.buf.lists))
	for i := range s.buf.lists {
		want[i] = int32(s.buf.lists[i].count)
	}
	deadline := time.Now().Add(2 * time.Second)
	for {
		got := s.buf.freeCounts()
		if slices.Equal(got, want) {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("free counts of the buffer region are %v, want %v: slices leaked", got, want)
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// readUntilError reads st until a read fails and returns what it read and
// the error.
func readUntilError(st *Stream) ([]byte, error) {
	var out []byte
	buf := make([]byte, 64<<10)
	for {
		n, err := st.Read(buf)
		out = append(out, buf[:n]...)
		if err != nil {
			return out, err
		}
	}
}

// writeAll writes each message with its own Write.
func writeAll(t *testing.T, st *Stream, msgs [][]byte) {
	t.Helper()
	for i, m := range msgs {
		if n, err := st.Write(m); err != nil || n != len(m) {
			t.Fatalf("Write of message %d (%d bytes): wrote %d, %v", i, len(m), n, err)
		}
	}
}

func requireErrorIs(t *testing.T, err, target error, what string) {
	t.Helper()
	if !errors.Is(err, target) {
		t.Fatalf("%s: got error %v, want one wrapping %v", what, err, target)
	}
}

func requireTimeout(t *testing.T, err error, what string) {
	t.Helper()
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("%s: got error %v, want one matching os.ErrDeadlineExceeded", what, err)
	}
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("%s: error %v is not a net.Error with Timeout() true", what, err)
	}
}

// waitResult waits for a blocked call to report its error.
func waitResult(t *testing.T, ch <-chan error, what string) error {
	t.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(5 * time.Second):
		t.Fatalf("%s is still blocked after 5s", what)
		return nil
	}
}

// TestStreamEchoSizes sends messages of every size around the slice sizes
// through an echo server, with Write/Read and with BufferWriter/BufferReader,
// checks the echo byte for byte, and that every slice is freed afterwards.
func TestStreamEchoSizes(t *testing.T) {
	forEachStreamMode(t, func(t *testing.T, mode MemMapType) {
		p := newStreamTestPair(t, mode, nil)
		go serveFrameEcho(p.server)
		paths := []struct {
			name string
			echo func(*Stream, []byte) error
		}{
			{"ReadWrite", echoWithReadWrite},
			{"BufferReaderWriter", echoWithBuffers},
		}
		for k, path := range paths {
			t.Run(path.name, func(t *testing.T) {
				st := openStreamT(t, p.client)
				fallbackSeen := false
				for i, n := range streamTestSizes {
					msg := streamPattern(n, uint64(100*k+i+1))
					if err := path.echo(st, msg); err != nil {
						t.Fatalf("size %d: %v", n, err)
					}
					// Each direction holds at most two messages' slices at a
					// time, far less than the 32 MiB region.
					if !fallbackSeen && st.fallback.Load() {
						fallbackSeen = true
						t.Errorf("the %d-byte echo switched the stream to fallback data although the region had room (free counts now %v)", n, p.client.buf.freeCounts())
					}
				}
				if err := st.Close(); err != nil {
					t.Fatalf("Close: %v", err)
				}
				waitFreeListsFull(t, p.client)
			})
		}
	})
}

// TestStreamConcurrentStreams runs 64 streams at once, each doing 50 echo
// round trips of random sizes, and checks every byte and the free lists.
func TestStreamConcurrentStreams(t *testing.T) {
	const (
		streams = 64
		maxSize = 200 << 10
	)
	rounds := shortOr(50, 15) // echoes per stream; 64 streams at once either way
	forEachStreamMode(t, func(t *testing.T, mode MemMapType) {
		p := newStreamTestPair(t, mode, nil)
		go serveFrameEcho(p.server)
		pool := streamPattern(1<<20, 7)
		errs := make(chan error, streams)
		var wg sync.WaitGroup
		for g := range streams {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs <- echoRounds(p.client, rand.New(rand.NewPCG(uint64(g), 42)), pool, rounds, maxSize)
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Error(err)
			}
		}
		waitFreeListsFull(t, p.client)
	})
}

// echoRounds opens a stream and does rounds echoes of random slices of pool,
// alternating between the Read/Write and the buffer API.
func echoRounds(sess *Session, rng *rand.Rand, pool []byte, rounds, maxSize int) error {
	st, err := sess.OpenStream()
	if err != nil {
		return fmt.Errorf("OpenStream: %w", err)
	}
	defer st.Close()
	for i := range rounds {
		st.SetReadDeadline(time.Now().Add(streamTestTimeout / 2))
		n := 1 + rng.IntN(maxSize)
		off := rng.IntN(len(pool) - n + 1)
		echo := echoWithReadWrite
		if i%2 == 1 {
			echo = echoWithBuffers
		}
		if err := echo(st, pool[off:off+n]); err != nil {
			return fmt.Errorf("stream %d round %d: %w", st.ID(), i, err)
		}
	}
	return st.Close()
}

// TestStreamCloseSemantics checks end-of-stream in both directions, writes
// after the peer's close, use after a local close, and that Close is
// idempotent.
func TestStreamCloseSemantics(t *testing.T) {
	forEachStreamMode(t, func(t *testing.T, mode MemMapType) {
		p := newStreamTestPair(t, mode, nil)

		t.Run("ClientCloseServerReadsAllThenEOF", func(t *testing.T) {
			st := openStreamT(t, p.client)
			var msgs [][]byte
			for i, n := range []int{100, 8173, 300000, 1, 131053, 64} {
				msgs = append(msgs, streamPattern(n, uint64(1000+i)))
			}
			writeAll(t, st, msgs)
			if err := st.Close(); err != nil { // right after the writes
				t.Fatalf("Close: %v", err)
			}
			srv := acceptStreamT(t, p.server)
			got, err := readUntilError(srv)
			if err != io.EOF {
				t.Fatalf("server read ended with %v after %d bytes, want io.EOF", err, len(got))
			}
			if want := bytes.Join(msgs, nil); !bytes.Equal(got, want) {
				t.Fatalf("server read %d bytes, want the %d bytes sent before the close", len(got), len(want))
			}
			if _, err := srv.Read(make([]byte, 1)); err != io.EOF {
				t.Fatalf("second Read after end of stream: %v, want io.EOF", err)
			}
			_, err = srv.Write([]byte("late"))
			requireErrorIs(t, err, ErrStreamPeerClosed, "server Write after the client closed")
			if err := srv.Close(); err != nil {
				t.Fatalf("server Close of a half-closed stream: %v", err)
			}
			waitFreeListsFull(t, p.client)
		})

		t.Run("ServerCloseAfterReply", func(t *testing.T) {
			st := openStreamT(t, p.client)
			writeAll(t, st, [][]byte{[]byte("ping")})
			srv := acceptStreamT(t, p.server)
			req := make([]byte, 4)
			if _, err := io.ReadFull(srv, req); err != nil || string(req) != "ping" {
				t.Fatalf("server read %q, %v", req, err)
			}
			reply := [][]byte{streamPattern(5000, 1), streamPattern(200000, 2), []byte("end")}
			writeAll(t, srv, reply)
			if err := srv.Close(); err != nil {
				t.Fatalf("server Close: %v", err)
			}
			got, err := readUntilError(st)
			if err != io.EOF {
				t.Fatalf("client read ended with %v after %d bytes, want io.EOF", err, len(got))
			}
			if want := bytes.Join(reply, nil); !bytes.Equal(got, want) {
				t.Fatalf("client read %d bytes, want the %d-byte reply", len(got), len(want))
			}
			_, err = st.Write([]byte("after close"))
			requireErrorIs(t, err, ErrStreamPeerClosed, "client Write after the server closed")
			if err := st.Close(); err != nil {
				t.Fatalf("client Close of a half-closed stream: %v", err)
			}
			waitFreeListsFull(t, p.client)
		})

		t.Run("UseAfterLocalClose", func(t *testing.T) {
			st := openStreamT(t, p.client)
			writeAll(t, st, [][]byte{[]byte("x")})
			srv := acceptStreamT(t, p.server)
			if err := st.Close(); err != nil {
				t.Fatalf("Close: %v", err)
			}
			if err := st.Close(); err != nil {
				t.Fatalf("second Close: %v, want nil", err)
			}
			buf := make([]byte, 8)
			_, err := st.Read(buf)
			requireErrorIs(t, err, ErrStreamClosed, "Read after Close")
			_, err = st.Write([]byte("y"))
			requireErrorIs(t, err, ErrStreamClosed, "Write after Close")
			br, bw := st.BufferReader(), st.BufferWriter()
			_, err = br.ReadBytes(1)
			requireErrorIs(t, err, ErrStreamClosed, "ReadBytes after Close")
			_, err = br.Peek(1)
			requireErrorIs(t, err, ErrStreamClosed, "Peek after Close")
			_, err = br.ReadByte()
			requireErrorIs(t, err, ErrStreamClosed, "ReadByte after Close")
			_, err = br.Discard(1)
			requireErrorIs(t, err, ErrStreamClosed, "Discard after Close")
			_, err = bw.Reserve(1)
			requireErrorIs(t, err, ErrStreamClosed, "Reserve after Close")
			_, err = bw.WriteBytes([]byte("z"))
			requireErrorIs(t, err, ErrStreamClosed, "WriteBytes after Close")

			// The peer sees the data, then the end of the stream.
			got, err := readUntilError(srv)
			if err != io.EOF || string(got) != "x" {
				t.Fatalf("server read %q then %v, want \"x\" then io.EOF", got, err)
			}
		})

		t.Run("CloseWakesBlockedRead", func(t *testing.T) {
			st := openStreamT(t, p.client)
			done := make(chan error, 1)
			go func() {
				_, err := st.Read(make([]byte, 8))
				done <- err
			}()
			time.Sleep(20 * time.Millisecond) // let the Read block
			if err := st.Close(); err != nil {
				t.Fatalf("Close: %v", err)
			}
			requireErrorIs(t, waitResult(t, done, "Read on a closed stream"), ErrStreamClosed, "Read blocked during Close")
		})

		t.Run("ConcurrentClose", func(t *testing.T) {
			st := openStreamT(t, p.client)
			writeAll(t, st, [][]byte{streamPattern(10000, 3)})
			errs := make(chan error, 8)
			for range 8 {
				go func() { errs <- st.Close() }()
			}
			for range 8 {
				if err := <-errs; err != nil {
					t.Errorf("concurrent Close: %v", err)
				}
			}
			srv := acceptStreamT(t, p.server)
			got, err := readUntilError(srv)
			if err != io.EOF || len(got) != 10000 {
				t.Fatalf("server read %d bytes then %v, want 10000 then io.EOF", len(got), err)
			}
			srv.Close()
			waitFreeListsFull(t, p.client)
		})
	})
}

// TestStreamHalfClose checks that data the peer sent before closing stays
// readable, with the right Len, and that the end of the stream follows it.
func TestStreamHalfClose(t *testing.T) {
	forEachStreamMode(t, func(t *testing.T, mode MemMapType) {
		p := newStreamTestPair(t, mode, nil)
		a := openStreamT(t, p.client)
		writeAll(t, a, [][]byte{[]byte("A")})
		b := openStreamT(t, p.client)
		writeAll(t, b, [][]byte{[]byte("B")})
		srvA, srvB := acceptStreamT(t, p.server), acceptStreamT(t, p.server)
		one := make([]byte, 1)
		if _, err := io.ReadFull(srvA, one); err != nil {
			t.Fatal(err)
		}
		if one[0] == 'B' {
			srvA, srvB = srvB, srvA
		}
		if _, err := io.ReadFull(srvB, one); err != nil {
			t.Fatal(err)
		}

		msgs := [][]byte{streamPattern(100, 1), streamPattern(9000, 2), streamPattern(300000, 3)}
		want := bytes.Join(msgs, nil)
		writeAll(t, srvA, msgs)
		if err := srvA.Close(); err != nil {
			t.Fatalf("server Close: %v", err)
		}
		// Stream b's message is queued after a's close, so once it has arrived
		// the client has processed the close of a.
		writeAll(t, srvB, [][]byte{[]byte("done")})
		done := make([]byte, 4)
		if _, err := io.ReadFull(b, done); err != nil {
			t.Fatalf("read barrier message: %v", err)
		}

		br := a.BufferReader()
		if n := br.Len(); n != len(want) {
			t.Fatalf("Len() of the half-closed stream = %d, want %d", n, len(want))
		}
		_, err := a.Write([]byte("no"))
		requireErrorIs(t, err, ErrStreamPeerClosed, "Write on a stream the peer closed")

		peek, err := br.Peek(10)
		if err != nil || !bytes.Equal(peek, want[:10]) {
			t.Fatalf("Peek(10) = %x, %v", peek, err)
		}
		head, err := br.ReadBytes(150) // spans the first two messages
		if err != nil || !bytes.Equal(head, want[:150]) {
			t.Fatalf("ReadBytes(150) on the half-closed stream: %v (equal=%v)", err, bytes.Equal(head, want[:150]))
		}
		rest := make([]byte, len(want)-150-3)
		if _, err := io.ReadFull(a, rest); err != nil || !bytes.Equal(rest, want[150:len(want)-3]) {
			t.Fatalf("reading the buffered data: %v", err)
		}
		if n := br.Len(); n != 3 {
			t.Fatalf("Len() = %d with 3 bytes left", n)
		}
		if _, err := br.ReadBytes(10); err != io.ErrUnexpectedEOF {
			t.Fatalf("ReadBytes(10) with 3 bytes left before the end: %v, want io.ErrUnexpectedEOF", err)
		}
		tail, err := readUntilError(a)
		if err != io.EOF {
			t.Fatalf("read after the buffered data: %v, want io.EOF", err)
		}
		if len(tail) > 3 || !bytes.Equal(tail, want[len(want)-len(tail):]) {
			t.Fatalf("last bytes read = %x, want a suffix of %x", tail, want[len(want)-3:])
		}
		if _, err := br.ReadBytes(1); err != io.EOF {
			t.Fatalf("ReadBytes(1) at the end of the stream: %v, want io.EOF", err)
		}
		if _, err := br.ReadByte(); err != io.EOF {
			t.Fatalf("ReadByte at the end of the stream: %v, want io.EOF", err)
		}
		if err := a.Close(); err != nil {
			t.Fatalf("Close: %v", err)
		}
		b.Close()
		srvB.Close()
		waitFreeListsFull(t, p.client)
	})
}

// tinyRegion makes a 1 MiB buffer region of 4 KiB slices, so large messages
// cannot be placed in shared memory, and takes fallback frames up to the
// smallest bound allowed.
func tinyRegion(c *Config) {
	c.ShareMemoryBufferCap = 1 << 20
	c.BufferSliceSizes = []SizePercentPair{{Size: 4096, Percent: 100}}
	c.MaxFallbackFrameSize = minFallbackFrame
}

// TestStreamFallback forces fallback data with a tiny region and checks that
// large messages arrive intact and in order with the shared-memory messages
// sent before them, in both directions.
func TestStreamFallback(t *testing.T) {
	forEachStreamMode(t, func(t *testing.T, mode MemMapType) {
		t.Run("EchoLarge", func(t *testing.T) {
			p := newStreamTestPair(t, mode, tinyRegion)
			go serveFrameEcho(p.server)
			st := openStreamT(t, p.client)
			if err := echoWithReadWrite(st, streamPattern(1000, 1)); err != nil {
				t.Fatal(err)
			}
			if st.fallback.Load() {
				t.Fatal("a 1000-byte message went as fallback data")
			}
			for i, n := range []int{4 << 20, 1<<20 + 4096, 2 << 20, 100, 5000} {
				// Header and body in one Write: larger than the region
				// can give, so the message must go as fallback data.
				if err := echoInOneWrite(st, streamPattern(n, uint64(10+i))); err != nil {
					t.Fatalf("size %d: %v", n, err)
				}
				if !st.fallback.Load() {
					t.Fatalf("stream not in fallback mode after a %d-byte message", n)
				}
			}
			if err := echoWithBuffers(st, streamPattern(3000, 20)); err != nil {
				t.Fatalf("buffer API in fallback mode: %v", err)
			}
			if err := st.Close(); err != nil {
				t.Fatal(err)
			}
			waitFreeListsFull(t, p.client)
		})

		small := func(seed uint64, count int) [][]byte {
			rng := rand.New(rand.NewPCG(seed, 1))
			var msgs [][]byte
			for i := range count {
				msgs = append(msgs, streamPattern(1+rng.IntN(200), seed*1000+uint64(i)))
			}
			return msgs
		}

		t.Run("OrderAcrossSwitchClientToServer", func(t *testing.T) {
			p := newStreamTestPair(t, mode, tinyRegion)
			st := openStreamT(t, p.client)
			before, large, after := small(1, 100), streamPattern(3<<20, 5), small(2, 50)
			writeAll(t, st, before)
			if st.fallback.Load() {
				t.Fatal("small messages went as fallback data")
			}
			writeAll(t, st, [][]byte{large})
			if !st.fallback.Load() {
				t.Fatal("a 3 MiB message did not switch the stream to fallback data")
			}
			writeAll(t, st, after)
			if err := st.Close(); err != nil {
				t.Fatal(err)
			}
			srv := acceptStreamT(t, p.server)
			got, err := readUntilError(srv)
			if err != io.EOF {
				t.Fatalf("server read ended with %v after %d bytes, want io.EOF", err, len(got))
			}
			want := bytes.Join(slices.Concat(before, [][]byte{large}, after), nil)
			if !bytes.Equal(got, want) {
				t.Fatalf("server read %d bytes, want %d in order (first difference at %d)", len(got), len(want), firstDiff(got, want))
			}
			srv.Close()
			waitFreeListsFull(t, p.client)
		})

		t.Run("OrderAcrossSwitchServerToClient", func(t *testing.T) {
			p := newStreamTestPair(t, mode, tinyRegion)
			st := openStreamT(t, p.client)
			writeAll(t, st, [][]byte{[]byte("go")})
			srv := acceptStreamT(t, p.server)
			if _, err := io.ReadFull(srv, make([]byte, 2)); err != nil {
				t.Fatal(err)
			}
			before, large, after := small(3, 100), streamPattern(3<<20, 6), small(4, 50)
			writeAll(t, srv, before)
			if srv.fallback.Load() {
				t.Fatal("small replies went as fallback data")
			}
			writeAll(t, srv, [][]byte{large, streamPattern(1<<20+1, 7)})
			if !srv.fallback.Load() {
				t.Fatal("large replies did not switch the server stream to fallback data")
			}
			writeAll(t, srv, after)
			if err := srv.Close(); err != nil {
				t.Fatal(err)
			}
			got, err := readUntilError(st)
			if err != io.EOF {
				t.Fatalf("client read ended with %v after %d bytes, want io.EOF", err, len(got))
			}
			want := bytes.Join(slices.Concat(before, [][]byte{large, streamPattern(1<<20+1, 7)}, after), nil)
			if !bytes.Equal(got, want) {
				t.Fatalf("client read %d bytes, want %d in order (first difference at %d)", len(got), len(want), firstDiff(got, want))
			}
			st.Close()
			waitFreeListsFull(t, p.client)
		})
	})
}

// TestStreamFallbackOrderConcurrent switches many streams at once from
// shared memory to fallback data, each right after a shared-memory message,
// and checks that no stream's bytes are reordered. A Reserve larger than the
// largest slice forces the fallback without exhausting the region.
func TestStreamFallbackOrderConcurrent(t *testing.T) {
	const (
		workers       = 32
		streamsEach   = 25
		shmPart       = 16
		fallbackPart  = 5000
		streamsTotal  = workers * streamsEach
		contentLength = shmPart + fallbackPart
	)
	forEachStreamMode(t, func(t *testing.T, mode MemMapType) {
		p := newStreamTestPair(t, mode, tinyRegion)
		pool := streamPattern(1<<16, 11)
		content := func(id uint32) []byte {
			off := int(id*37) % (len(pool) - contentLength)
			return pool[off : off+contentLength]
		}
		// Room for a result from every stream, and from as many streams that
		// out-of-order data might open on the server by mistake.
		results := make(chan error, 2*streamsTotal)
		go func() {
			for {
				srv, err := p.server.AcceptStream()
				if err != nil {
					return
				}
				go func() {
					defer srv.Close()
					srv.SetReadDeadline(time.Now().Add(streamTestTimeout))
					got, err := readUntilError(srv)
					want := content(srv.ID())
					switch {
					case err != io.EOF:
						results <- fmt.Errorf("stream %d: read ended with %v after %d bytes", srv.ID(), err, len(got))
					case !bytes.Equal(got, want):
						results <- fmt.Errorf("stream %d: got %d bytes, want %d; first difference at %d (the first %d bytes went by shared memory, the rest as fallback data)",
							srv.ID(), len(got), len(want), firstDiff(got, want), shmPart)
					default:
						results <- nil
					}
				}()
			}
		}()
		sendErrs := make(chan error, workers)
		for range workers {
			go func() {
				sendErrs <- func() error {
					for range streamsEach {
						st, err := p.client.OpenStream()
						if err != nil {
							return err
						}
						c := content(st.ID())
						if _, err := st.Write(c[:shmPart]); err != nil {
							return fmt.Errorf("stream %d: Write: %w", st.ID(), err)
						}
						b, err := st.BufferWriter().Reserve(fallbackPart)
						if err != nil {
							return fmt.Errorf("stream %d: Reserve: %w", st.ID(), err)
						}
						copy(b, c[shmPart:])
						if err := st.Flush(false); err != nil {
							return fmt.Errorf("stream %d: Flush: %w", st.ID(), err)
						}
						if !st.fallback.Load() {
							return fmt.Errorf("stream %d: a %d-byte Reserve did not switch to fallback data", st.ID(), fallbackPart)
						}
						if err := st.Close(); err != nil {
							return fmt.Errorf("stream %d: Close: %w", st.ID(), err)
						}
					}
					return nil
				}()
			}()
		}
		for range workers {
			if err := <-sendErrs; err != nil {
				t.Fatal(err)
			}
		}
		failures := 0
		for range streamsTotal {
			select {
			case err := <-results:
				if err != nil {
					failures++
					if failures <= 5 {
						t.Error(err)
					}
				}
			case <-time.After(streamTestTimeout):
				t.Fatal("the server did not finish reading every stream")
			}
		}
		if failures > 0 {
			t.Errorf("%d of %d streams did not receive their bytes intact and in order", failures, streamsTotal)
		}
		waitFreeListsFull(t, p.client)
	})
}

// firstDiff returns the index of the first byte where a and b differ, or the
// length of the shorter one.
func firstDiff(a, b []byte) int {
	i := 0
	for i < len(a) && i < len(b) && a[i] == b[i] {
		i++
	}
	return i
}

// TestStreamDeadlines checks read deadlines in the past and the near future,
// that clearing one makes reads work again, that setting one wakes a blocked
// Read, and write deadlines.
func TestStreamDeadlines(t *testing.T) {
	forEachStreamMode(t, func(t *testing.T, mode MemMapType) {
		p := newStreamTestPair(t, mode, nil)
		st := openStreamT(t, p.client)
		writeAll(t, st, [][]byte{[]byte("hi")})
		srv := acceptStreamT(t, p.server)
		if _, err := io.ReadFull(srv, make([]byte, 2)); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 16)
		br := st.BufferReader()

		st.SetReadDeadline(time.Now().Add(-time.Second))
		_, err := st.Read(buf)
		requireTimeout(t, err, "Read with a deadline in the past")
		_, err = br.ReadBytes(1)
		requireTimeout(t, err, "ReadBytes with a deadline in the past")
		_, err = br.Peek(1)
		requireTimeout(t, err, "Peek with a deadline in the past")
		_, err = br.ReadByte()
		requireTimeout(t, err, "ReadByte with a deadline in the past")

		deadline := time.Now().Add(50 * time.Millisecond)
		st.SetReadDeadline(deadline)
		start := time.Now()
		_, err = st.Read(buf)
		requireTimeout(t, err, "Read with a deadline 50ms ahead")
		if time.Now().Before(deadline) {
			t.Fatalf("Read timed out before its deadline")
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Fatalf("Read with a 50ms deadline took %v", d)
		}

		st.SetReadDeadline(time.Time{})
		writeAll(t, srv, [][]byte{[]byte("after")})
		got := make([]byte, 5)
		if _, err := io.ReadFull(st, got); err != nil || string(got) != "after" {
			t.Fatalf("read after clearing the deadline: %q, %v", got, err)
		}

		blocked := make(chan error, 1)
		go func() {
			_, err := st.Read(buf)
			blocked <- err
		}()
		time.Sleep(20 * time.Millisecond) // let the Read block
		st.SetReadDeadline(time.Now())
		requireTimeout(t, waitResult(t, blocked, "Read after SetReadDeadline(now)"), "blocked Read woken by SetReadDeadline(now)")

		st.SetReadDeadline(time.Time{})
		writeAll(t, srv, [][]byte{[]byte("again")})
		if _, err := io.ReadFull(st, got); err != nil || string(got) != "again" {
			t.Fatalf("read after clearing the deadline again: %q, %v", got, err)
		}

		st.SetWriteDeadline(time.Now().Add(-time.Second))
		_, err = st.Write([]byte("late"))
		requireTimeout(t, err, "Write with a deadline in the past")
		st.SetWriteDeadline(time.Time{})
		writeAll(t, st, [][]byte{[]byte("ok")})
		if _, err := io.ReadFull(srv, got[:2]); err != nil || string(got[:2]) != "ok" {
			t.Fatalf("server read %q, %v after the write deadline was cleared; want only \"ok\"", got[:2], err)
		}
	})
}

// TestStreamSessionClose checks what streams and sessions do when a session
// is closed, and the role restrictions of OpenStream and AcceptStream.
func TestStreamSessionClose(t *testing.T) {
	forEachStreamMode(t, func(t *testing.T, mode MemMapType) {
		t.Run("ClientCloseWakesReads", func(t *testing.T) {
			p := newStreamTestPair(t, mode, nil)
			st := openStreamT(t, p.client)
			writeAll(t, st, [][]byte{[]byte("x")})
			srv := acceptStreamT(t, p.server)
			if _, err := io.ReadFull(srv, make([]byte, 1)); err != nil {
				t.Fatal(err)
			}
			clientRead, serverRead := make(chan error, 1), make(chan error, 1)
			go func() {
				_, err := st.Read(make([]byte, 8))
				clientRead <- err
			}()
			go func() {
				_, err := srv.Read(make([]byte, 8))
				serverRead <- err
			}()
			time.Sleep(20 * time.Millisecond) // let the Reads block
			if err := p.client.Close(); err != nil {
				t.Fatalf("Session.Close: %v", err)
			}
			requireErrorIs(t, waitResult(t, clientRead, "client Read"), ErrSessionClosed, "client Read blocked during Session.Close")
			requireErrorIs(t, waitResult(t, serverRead, "server Read"), ErrSessionClosed, "server Read when the client session closed")
			_, err := p.client.OpenStream()
			requireErrorIs(t, err, ErrSessionClosed, "OpenStream on a closed session")
			if err := p.client.Close(); err != nil {
				t.Fatalf("second Session.Close: %v", err)
			}
			if err := st.Close(); err != nil {
				t.Fatalf("stream Close after Session.Close: %v", err)
			}
		})

		t.Run("WriteAfterSessionClose", func(t *testing.T) {
			// ErrSessionClosed is documented for "the methods of a closed
			// session and of its streams"; ErrStreamClosed only for a stream's
			// own Close and a peer's close of the stream.
			p := newStreamTestPair(t, mode, nil)
			st := openStreamT(t, p.client)
			writeAll(t, st, [][]byte{[]byte("x")})
			srv := acceptStreamT(t, p.server)
			p.client.Close()
			if _, err := st.Write([]byte("y")); !errors.Is(err, ErrSessionClosed) {
				t.Errorf("Write on a stream of a session closed locally: got %v, want an error wrapping ErrSessionClosed", err)
			}
			waitSessionClosed(t, p.server, 5*time.Second)
			if _, err := srv.Write([]byte("y")); !errors.Is(err, ErrSessionClosed) {
				t.Errorf("Write on a stream whose session the peer closed: got %v, want an error wrapping ErrSessionClosed", err)
			}
		})

		t.Run("ServerSession", func(t *testing.T) {
			p := newStreamTestPair(t, mode, nil)
			_, err := p.server.OpenStream()
			requireErrorIs(t, err, ErrNotSupported, "OpenStream on a server session")
			_, err = p.client.AcceptStream()
			requireErrorIs(t, err, ErrNotSupported, "AcceptStream on a client session")

			st := openStreamT(t, p.client)
			writeAll(t, st, [][]byte{[]byte("x")})
			srv := acceptStreamT(t, p.server)
			if _, err := io.ReadFull(srv, make([]byte, 1)); err != nil {
				t.Fatal(err)
			}
			accept, read := make(chan error, 1), make(chan error, 1)
			go func() {
				_, err := p.server.AcceptStream()
				accept <- err
			}()
			go func() {
				_, err := srv.Read(make([]byte, 8))
				read <- err
			}()
			time.Sleep(20 * time.Millisecond) // let both block
			if err := p.server.Close(); err != nil {
				t.Fatalf("server Session.Close: %v", err)
			}
			requireErrorIs(t, waitResult(t, read, "server Read"), ErrSessionClosed, "server Read blocked during Session.Close")
			requireErrorIs(t, waitResult(t, accept, "AcceptStream"), ErrSessionClosed, "AcceptStream blocked during Session.Close")
			_, err = p.server.AcceptStream()
			requireErrorIs(t, err, ErrSessionClosed, "AcceptStream on a closed server session")
			_, err = p.server.OpenStream()
			requireErrorIs(t, err, ErrNotSupported, "OpenStream on a closed server session")
		})
	})
}

// TestStreamPeerSessionClosedKeepsData checks that data received before the
// peer's session ended stays readable, followed by ErrSessionClosed.
func TestStreamPeerSessionClosedKeepsData(t *testing.T) {
	forEachStreamMode(t, func(t *testing.T, mode MemMapType) {
		p := newStreamTestPair(t, mode, nil)
		st := openStreamT(t, p.client)
		writeAll(t, st, [][]byte{[]byte("req")})
		srv := acceptStreamT(t, p.server)
		if _, err := io.ReadFull(srv, make([]byte, 3)); err != nil {
			t.Fatal(err)
		}
		msgs := [][]byte{streamPattern(100, 1), streamPattern(300000, 2)}
		want := bytes.Join(msgs, nil)
		writeAll(t, srv, msgs)
		if err := p.server.Close(); err != nil {
			t.Fatalf("server Session.Close: %v", err)
		}
		waitSessionClosed(t, p.client, 5*time.Second)
		requireErrorIs(t, p.client.Err(), ErrSessionClosed, "client Session.Err after the server closed")

		if n := st.BufferReader().Len(); n != len(want) {
			t.Fatalf("Len() after the peer session ended = %d, want %d", n, len(want))
		}
		got, err := readUntilError(st)
		if !bytes.Equal(got, want) {
			t.Fatalf("read %d bytes after the peer session ended, want %d (first difference at %d)", len(got), len(want), firstDiff(got, want))
		}
		requireErrorIs(t, err, ErrSessionClosed, "Read after the buffered data of an ended session")
		if err := st.Close(); err != nil {
			t.Fatalf("Close: %v", err)
		}
	})
}

// TestStreamBufferReader checks Peek, Discard, ReadByte, ReadBytes across
// message boundaries (the copy path) and within one (zero-copy), and Len.
func TestStreamBufferReader(t *testing.T) {
	forEachStreamMode(t, func(t *testing.T, mode MemMapType) {
		p := newStreamTestPair(t, mode, nil)
		st := openStreamT(t, p.client)
		writeAll(t, st, [][]byte{[]byte("x")})
		srv := acceptStreamT(t, p.server)
		if _, err := io.ReadFull(srv, make([]byte, 1)); err != nil {
			t.Fatal(err)
		}
		br := st.BufferReader()
		if n := br.Len(); n != 0 {
			t.Fatalf("Len() before any data = %d", n)
		}

		writeAll(t, srv, [][]byte{[]byte("hello"), []byte("world")})
		all, err := br.Peek(10) // blocks until both messages are in
		if err != nil || string(all) != "helloworld" {
			t.Fatalf("Peek(10) = %q, %v", all, err)
		}
		if n := br.Len(); n != 10 {
			t.Fatalf("Len() after Peek = %d, want 10: Peek consumed", n)
		}
		if b, err := br.Peek(3); err != nil || string(b) != "hel" {
			t.Fatalf("Peek(3) = %q, %v", b, err)
		}
		if c, err := br.ReadByte(); err != nil || c != 'h' {
			t.Fatalf("ReadByte = %q, %v", c, err)
		}
		if n, err := br.Discard(2); err != nil || n != 2 {
			t.Fatalf("Discard(2) = %d, %v", n, err)
		}
		if n := br.Len(); n != 7 {
			t.Fatalf("Len() = %d, want 7", n)
		}
		spanning, err := br.ReadBytes(5) // "lo" + "wor": two messages
		if err != nil || string(spanning) != "lowor" {
			t.Fatalf("ReadBytes(5) across two messages = %q, %v", spanning, err)
		}
		end, err := br.ReadBytes(2)
		if err != nil || string(end) != "ld" {
			t.Fatalf("ReadBytes(2) = %q, %v", end, err)
		}
		if n := br.Len(); n != 0 {
			t.Fatalf("Len() = %d, want 0", n)
		}
		if empty, err := br.ReadBytes(0); err != nil || len(empty) != 0 {
			t.Fatalf("ReadBytes(0) = %q, %v", empty, err)
		}
		if string(spanning) != "lowor" || string(end) != "ld" {
			t.Fatal("slices from ReadBytes changed before ReleasePreviousRead")
		}
		br.ReleasePreviousRead()

		// A multi-slice message: a zero-copy read inside its first slice, then
		// the rest across slices.
		big := streamPattern(300000, 9)
		writeAll(t, srv, [][]byte{big})
		first, err := br.ReadBytes(100)
		if err != nil || !bytes.Equal(first, big[:100]) {
			t.Fatalf("ReadBytes(100) of a 300000-byte message: %v", err)
		}
		rest, err := br.ReadBytes(len(big) - 100)
		if err != nil || !bytes.Equal(rest, big[100:]) {
			t.Fatalf("ReadBytes of the rest of a 300000-byte message: %v (first difference at %d)", err, firstDiff(rest, big[100:]))
		}
		if !bytes.Equal(first, big[:100]) {
			t.Fatal("the first ReadBytes slice changed before ReleasePreviousRead")
		}
		br.ReleasePreviousRead()

		// Discard blocks until its bytes have arrived, across messages.
		discarded := make(chan error, 1)
		go func() {
			n, err := br.Discard(6)
			if err == nil && n != 6 {
				err = fmt.Errorf("discarded %d", n)
			}
			discarded <- err
		}()
		writeAll(t, srv, [][]byte{[]byte("abc"), []byte("def"), []byte("g")})
		if err := waitResult(t, discarded, "Discard(6)"); err != nil {
			t.Fatalf("Discard(6): %v", err)
		}
		if c, err := br.ReadByte(); err != nil || c != 'g' {
			t.Fatalf("ReadByte after Discard = %q, %v", c, err)
		}
		if _, err := br.ReadBytes(-1); err == nil {
			t.Fatal("ReadBytes(-1) succeeded")
		}
		if err := st.Close(); err != nil {
			t.Fatal(err)
		}
		srv.Close()
		waitFreeListsFull(t, p.client)
	})
}

// TestStreamWakesEveryBlockedReader: with several goroutines blocked
// reading one stream, whatever ends the reads ends all of them, as
// net.Conn promises ("any blocked Read or Write operations will be
// unblocked"; a read deadline applies to "any currently-blocked Read
// call"): Close, a deadline set in the past, the peer closing the stream,
// the session closing. Before, the wake-up went to one of them, and the
// others stayed blocked.
func TestStreamWakesEveryBlockedReader(t *testing.T) {
	for _, tc := range []struct {
		name   string
		end    func(cli, srv *Stream, p *streamTestPair)
		server bool // the readers read the server's end
	}{
		{"Close", func(cli, _ *Stream, _ *streamTestPair) { cli.Close() }, false},
		{"SetReadDeadline", func(cli, _ *Stream, _ *streamTestPair) { cli.SetReadDeadline(time.Now()) }, false},
		{"peer closes the stream", func(_, srv *Stream, _ *streamTestPair) { srv.Close() }, false},
		{"Session.Close", func(_, _ *Stream, p *streamTestPair) { p.client.Close() }, false},
		{"server side Close", func(_, srv *Stream, _ *streamTestPair) { srv.Close() }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, cli, srv := exchangedPair(t)
			st := cli
			if tc.server {
				st = srv
			}
			const readers = 4
			done := make(chan error, readers)
			for i := range readers {
				go func() {
					if i%2 == 0 {
						_, err := st.Read(make([]byte, 8))
						done <- err
					} else {
						_, err := st.BufferReader().ReadBytes(8)
						done <- err
					}
				}()
			}
			waitBlocked(t, "(*Stream).awaitReadable", readers)
			tc.end(cli, srv, p)
			for i := range readers {
				select {
				case err := <-done:
					if err == nil {
						t.Errorf("a read returned no error")
					}
				case <-time.After(peerTimeout):
					t.Fatalf("%d of %d blocked readers still blocked after %v", readers-i, readers, peerTimeout)
				}
			}
		})
	}
}

// TestStreamWakeupNotBehindFallback: while one stream's fallback frame
// waits for the peer to read it (its reader does not read), a write on
// another stream of the session returns at once, and its data arrives once
// the peer reads the socket again. The other stream's wake-up used to wait
// behind the frame for the socket, past its write deadline, up to
// ConnectionWriteTimeout.
func TestStreamWakeupNotBehindFallback(t *testing.T) {
	p := newStreamTestPair(t, MemMapTypeMemFd, noSpin)
	bigCli, bigSrv := p.openAccepted(t, 'a')
	cli, srv := p.openAccepted(t, 'b')
	bigDone := p.stalledFallbackWrite(t, bigCli)
	wrote := make(chan error, 1)
	go func() {
		cli.SetWriteDeadline(time.Now().Add(time.Second))
		_, err := cli.Write([]byte("q"))
		wrote <- err
	}()
	// It used to wait for ConnectionWriteTimeout (10 s).
	if err := errWithin(t, wrote, 4*time.Second, "a 1-byte write on another stream still blocked behind a fallback frame"); err != nil {
		t.Fatalf("write on the other stream: %v", err)
	}
	go io.Copy(io.Discard, bigSrv) // the server reads the socket again
	got := make(chan error, 1)
	go func() {
		b := make([]byte, 1)
		srv.SetReadDeadline(time.Now().Add(peerTimeout))
		_, err := io.ReadFull(srv, b)
		if err == nil && b[0] != 'q' {
			err = fmt.Errorf("got %q, want \"q\"", b)
		}
		got <- err
	}()
	if err := <-got; err != nil {
		t.Errorf("the other stream's data after the server read the socket again: %v", err)
	}
	if r := <-bigDone; r.err != nil || r.n != stalledWriteSize {
		t.Errorf("the large write: %d, %v; want %d, nil", r.n, r.err, stalledWriteSize)
	}
}

// TestStreamCloseDuringFallbackWrite: Close of a stream whose Write is
// sending a fallback frame the peer is slow to read returns at once; the
// Write fails with ErrStreamClosed once its frame is out, the rest of the
// message is not sent, the peer sees the stream end, and the session goes
// on. Close used to wait for the whole write, up to ConnectionWriteTimeout.
func TestStreamCloseDuringFallbackWrite(t *testing.T) {
	p := newStreamTestPair(t, MemMapTypeMemFd, noSpin)
	bigCli, bigSrv := p.openAccepted(t, 'a')
	wrote := p.stalledFallbackWrite(t, bigCli)
	closed := make(chan error, 1)
	go func() { closed <- bigCli.Close() }()
	// It used to wait for ConnectionWriteTimeout (10 s).
	if err := errWithin(t, closed, 4*time.Second, "Close still waiting for the stream's fallback write"); err != nil {
		t.Errorf("Close: %v", err)
	}
	bigSrv.SetReadDeadline(time.Now().Add(time.Minute))
	n, err := io.Copy(io.Discard, bigSrv) // the peer reads again, to the end
	if err != nil {
		t.Errorf("the peer's read of the closed stream: %v", err)
	}
	if n >= stalledWriteSize {
		t.Errorf("the peer read %d bytes: the whole message went out after Close", n)
	}
	select {
	case r := <-wrote:
		if !errors.Is(r.err, ErrStreamClosed) {
			t.Errorf("the Write that Close interrupted: %v, want ErrStreamClosed", r.err)
		}
		// It reports what the peer got, as the stats do.
		if int64(r.n) != n {
			t.Errorf("the Write that Close interrupted returned n = %d; the peer read %d bytes", r.n, n)
		}
		if out := p.client.Stats().FallbackBytesOut; out != uint64(n) {
			t.Errorf("FallbackBytesOut = %d; the peer read %d bytes", out, n)
		}
	case <-time.After(peerTimeout):
		t.Fatal("the Write did not return after its frame went out")
	}
	cli, _ := p.openAccepted(t, 'b') // the session goes on
	cli.Close()
}

// writeResult is what a Write returned.
type writeResult struct {
	n   int
	err error
}

// stalledWriteSize is what stalledFallbackWrite writes.
const stalledWriteSize = 100 << 20

// stalledFallbackWrite starts a write of stalledWriteSize bytes on the
// client stream cli, whose server end nobody reads, and returns once the
// write is stalled in a fallback frame: more than the region holds goes
// over the socket in frames of up to 1 MiB, and the server's receive loop
// stops reading its socket once it holds MaxFallbackBufferedPerStream of
// it unread. The channel gets the write's result.
func (p *streamTestPair) stalledFallbackWrite(t *testing.T, cli *Stream) <-chan writeResult {
	t.Helper()
	done := make(chan writeResult, 1)
	go func() {
		n, err := cli.Write(make([]byte, stalledWriteSize))
		done <- writeResult{n, err}
	}()
	deadline := time.Now().Add(30 * time.Second) // copying 32 MiB is slow under -race
	for p.server.Stats().FallbackBytesIn < 16<<20 {
		if time.Now().After(deadline) {
			t.Fatalf("the server got %d bytes of fallback data", p.server.Stats().FallbackBytesIn)
		}
		time.Sleep(10 * time.Millisecond)
	}
	waitBlocked(t, "(*eventConn).writeFallback", 1) // the client is in its next frame's write
	return done
}

// openAccepted opens a stream, sends the byte b on it, and returns it with
// the server's end, which has read b.
func (p *streamTestPair) openAccepted(t *testing.T, b byte) (cli, srv *Stream) {
	t.Helper()
	cli, err := p.client.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Write([]byte{b}); err != nil {
		t.Fatal(err)
	}
	if srv, err = p.server.AcceptStream(); err != nil {
		t.Fatal(err)
	}
	one := make([]byte, 1)
	srv.SetReadDeadline(time.Now().Add(peerTimeout))
	if _, err := io.ReadFull(srv, one); err != nil || one[0] != b {
		t.Fatalf("first byte: %q, %v", one, err)
	}
	srv.SetReadDeadline(time.Time{})
	return cli, srv
}

// Streams whose ids share a slot of the session's index (Session.index)
// each get their own messages, on both ends, while streams open and close
// around them; and no slot is left holding a stream that is gone.
func TestStreamIndexSharedSlots(t *testing.T) {
	conf := DefaultConfig()
	c, srv := dialListenerSession(t, startEchoListener(t, conf), conf)
	var open []*Stream
	openN := func(n int) {
		for range n {
			st, err := c.OpenStream()
			if err != nil {
				t.Fatal(err)
			}
			st.SetDeadline(time.Now().Add(20 * time.Second))
			open = append(open, st)
		}
	}
	checkAll := func(round int) {
		t.Helper()
		for _, st := range open {
			echoChecked(t, st, fmt.Appendf(nil, "stream %d message %d", st.ID(), round))
		}
	}
	checkIndex := func(s *Session) {
		t.Helper()
		s.mu.Lock()
		defer s.mu.Unlock()
		for i := range s.index {
			if st := s.index[i].Load(); st != nil && s.streams[st.id] != st {
				t.Errorf("index slot %d holds stream %d, which is not open", i, st.id)
			}
		}
	}
	// More than two streams per slot.
	openN(2*streamIndexSize + 5)
	checkAll(0)
	// Close every other stream, then open as many again: their ids share
	// slots with the streams left open.
	kept := open[:0]
	for i, st := range open {
		if i%2 == 0 {
			st.Close()
		} else {
			kept = append(kept, st)
		}
	}
	open = kept
	waitUntil(t, "the server forgets the closed streams", peerTimeout, func() bool {
		srv.mu.Lock()
		defer srv.mu.Unlock()
		return len(srv.streams) == len(open)
	})
	checkIndex(c)
	checkIndex(srv)
	openN(streamIndexSize + 3)
	checkAll(1)
	checkIndex(c)
	checkIndex(srv)
	for _, st := range open {
		st.Close()
	}
}

// A count too large to allocate is an error, as a negative one is, not a
// panic in make; the stream goes on working.
func TestReserveBeyondMaxReserve(t *testing.T) {
	s := dialEchoSession(t, nil)
	st, err := s.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	for _, n := range []int{MaxReserve + 1, 1 << 50, math.MaxInt} {
		if p, err := st.BufferWriter().Reserve(n); !errors.Is(err, ErrLimitExceeded) || p != nil {
			t.Errorf("Reserve(%d) = %d bytes, %v; want an error wrapping ErrLimitExceeded", n, len(p), err)
		}
		if p, err := st.NetpollWriter().Malloc(n); !errors.Is(err, ErrLimitExceeded) || p != nil {
			t.Errorf("Malloc(%d) = %d bytes, %v; want an error wrapping ErrLimitExceeded", n, len(p), err)
		}
	}
	p, err := st.BufferWriter().Reserve(5)
	if err != nil {
		t.Fatal(err)
	}
	copy(p, "hello")
	if err := st.Flush(false); err != nil {
		t.Fatal(err)
	}
	st.SetReadDeadline(time.Now().Add(peerTimeout))
	got := make([]byte, 5)
	if _, err := io.ReadFull(st, got); err != nil || string(got) != "hello" {
		t.Fatalf("echo after the refused counts: %q, %v", got, err)
	}
}

// TestFlushAfterCloseFails builds a message with each writing API, has
// another goroutine Close the stream, which discards the message, and
// then flushes: the Flush must fail with ErrStreamClosed, not report the
// message sent.
func TestFlushAfterCloseFails(t *testing.T) {
	s := dialEchoSession(t, nil)
	msg := []byte("a message Close discards")
	for _, api := range []string{"WriteBytes", "Reserve", "Malloc"} {
		t.Run(api, func(t *testing.T) {
			st, err := s.OpenStream()
			if err != nil {
				t.Fatal(err)
			}
			var p []byte
			switch api {
			case "WriteBytes":
				_, err = st.BufferWriter().WriteBytes(msg)
			case "Reserve":
				p, err = st.BufferWriter().Reserve(len(msg))
			case "Malloc":
				p, err = st.NetpollWriter().Malloc(len(msg))
			}
			if err != nil {
				t.Fatal(err)
			}
			copy(p, msg)
			closed := make(chan error, 1)
			go func() { closed <- st.Close() }()
			if err := errWithin(t, closed, peerTimeout, "Close"); err != nil {
				t.Fatal(err)
			}
			if api == "Malloc" {
				err = st.NetpollWriter().Flush()
			} else {
				err = st.Flush(false)
			}
			if !errors.Is(err, ErrStreamClosed) {
				t.Errorf("Flush after Close discarded the message: %v, want ErrStreamClosed", err)
			}
		})
	}
}

// noSpin turns spinning off, so that a reader waiting for data sleeps
// until its data comes with a wake-up.
func noSpin(c *Config) { c.ConsumerSpinTime = 0 }

// exchangedPair returns a pair without spinning and a stream open on both
// sides, after one request and reply on it.
func exchangedPair(t *testing.T) (p *streamTestPair, cli, srv *Stream) {
	t.Helper()
	p = newStreamTestPair(t, MemMapTypeMemFd, noSpin)
	cli, err := p.client.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	srv, err = p.server.AcceptStream()
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 5)
	if _, err := io.ReadFull(srv, buf); err != nil {
		t.Fatal(err)
	}
	if _, err := srv.Write(buf); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(cli, buf); err != nil {
		t.Fatal(err)
	}
	return p, cli, srv
}

package shmipc

// Data through a stream: echoes of every size and over many streams at once
// with each writing API, streams sharing a slot of the session's index, the
// buffer reader across slices, and Reserve and Malloc counts beyond MaxReserve.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"sync"
	"testing"
	"time"
)

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
	if n <= maxSliceCap(st.Session().buf) {
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
						t.Errorf("the %d-byte echo switched the stream to fallback data although the region had room (free counts now %v)", n, freeCounts(p.client.buf))
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

// Package cells holds the client side of the interoperability cells and the
// echo loop of a server, written once against a small Stream interface so
// that the same code drives this module's library and the Go reference.
//
// Every stream follows the echo contract of the Shmipc conformance kit: the
// client sends frames (a big-endian u32 length n, then n bytes), the server
// echoes each frame unchanged and, after a frame with n == 0, closes the
// stream.
package cells

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"
)

// Stream is what the cells need of a stream of any library.
type Stream interface {
	io.ReadWriteCloser
	SetReadDeadline(t time.Time) error
}

// Lib is one library's client: how to open a stream and how it says that a
// stream has ended.
type Lib struct {
	Open  func() (Stream, error)
	IsEOF func(err error) bool
}

// ReadTimeout bounds every read of an echo, so that a lost wake-up fails a
// cell instead of hanging it.
const ReadTimeout = 15 * time.Second

// Pattern returns n bytes that differ per seed and per position, so that a
// byte misplaced, lost or routed to the wrong stream shows.
func Pattern(n, seed int) []byte {
	p := make([]byte, n)
	for i := range p {
		p[i] = byte(i + seed*131 + i>>8 + i>>16)
	}
	return p
}

// Frame returns the frame carrying payload: its length, then its bytes.
func Frame(payload []byte) []byte {
	f := make([]byte, 4+len(payload))
	binary.BigEndian.PutUint32(f, uint32(len(payload)))
	copy(f[4:], payload)
	return f
}

// expectEcho reads the echo of frame from st and compares it.
func expectEcho(st Stream, frame []byte) error {
	got := make([]byte, len(frame))
	st.SetReadDeadline(time.Now().Add(ReadTimeout))
	if n, err := io.ReadFull(st, got); err != nil {
		return fmt.Errorf("echo of a %d-byte frame: %d bytes, then %w", len(frame)-4, n, err)
	}
	if !bytes.Equal(got, frame) {
		return fmt.Errorf("echo of a %d-byte frame differs from what was sent at byte %d", len(frame)-4, firstDiff(got, frame))
	}
	return nil
}

func firstDiff(a, b []byte) int {
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return len(a)
}

// RoundTrip sends one frame with payload on st and checks its echo.
func RoundTrip(st Stream, payload []byte) error {
	frame := Frame(payload)
	if _, err := st.Write(frame); err != nil {
		return fmt.Errorf("write a %d-byte frame: %w", len(payload), err)
	}
	return expectEcho(st, frame)
}

// expectEnd checks that st reads end-of-stream and nothing else.
func expectEnd(lib Lib, st Stream) error {
	var b [1]byte
	st.SetReadDeadline(time.Now().Add(ReadTimeout))
	n, err := st.Read(b[:])
	if n != 0 || !lib.IsEOF(err) {
		return fmt.Errorf("after the last echo: read %d bytes and %v, want end of stream", n, err)
	}
	return nil
}

// ZeroFrame sends the zero-length frame on a new stream, checks its echo,
// then that the server closed the stream.
func ZeroFrame(lib Lib) error {
	st, err := lib.Open()
	if err != nil {
		return fmt.Errorf("open: %w", err)
	}
	defer st.Close()
	if err := RoundTrip(st, nil); err != nil {
		return fmt.Errorf("zero-length frame: %w", err)
	}
	if err := expectEnd(lib, st); err != nil {
		return fmt.Errorf("zero-length frame: %w", err)
	}
	return st.Close()
}

// Sizes echoes one frame of each size, each on a stream of its own, then
// the zero-length frame.
func Sizes(lib Lib, sizes []int) error {
	for i, n := range sizes {
		st, err := lib.Open()
		if err != nil {
			return fmt.Errorf("open: %w", err)
		}
		err = RoundTrip(st, Pattern(n, i))
		if cerr := st.Close(); err == nil && cerr != nil {
			err = fmt.Errorf("close: %w", cerr)
		}
		if err != nil {
			return fmt.Errorf("size %d: %w", n, err)
		}
	}
	return ZeroFrame(lib)
}

// DefaultSizes are the message sizes of the sizes cell, from 1 byte to
// 40 MiB: slice boundaries of the default layout (8 KiB, 32 KiB, 128 KiB),
// chains across lists, messages of more than half a 32 MiB region (which
// this library sends as fallback data) and larger than the region.
var DefaultSizes = []int{1, 2, 3, 100, 4092, 4096, 8168, 8192, 32744, 65536, 131048, 300000,
	1 << 20, 4 << 20, 17 << 20, 33 << 20, 40 << 20}

// Concurrent runs streams streams at once, each rounds round trips of
// sizes that differ per stream and round.
func Concurrent(lib Lib, streams, rounds int) error {
	errs := make(chan error, streams)
	var wg sync.WaitGroup
	for s := range streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- streamRounds(lib, s, rounds)
		}()
	}
	wg.Wait()
	close(errs)
	return errors.Join(collect(errs)...)
}

func collect(errs <-chan error) []error {
	var out []error
	for err := range errs {
		if err != nil {
			out = append(out, err)
		}
	}
	return out
}

func streamRounds(lib Lib, s, rounds int) error {
	st, err := lib.Open()
	if err != nil {
		return fmt.Errorf("stream %d: open: %w", s, err)
	}
	defer st.Close()
	for r := range rounds {
		n := 1 + (s*7919+r*104729)%(300<<10)
		if err := RoundTrip(st, Pattern(n, s*rounds+r)); err != nil {
			return fmt.Errorf("stream %d round %d: %w", s, r, err)
		}
	}
	if err := st.Close(); err != nil {
		return fmt.Errorf("stream %d: close: %w", s, err)
	}
	return nil
}

// Sequential opens n streams one after another, each for one round trip.
func Sequential(lib Lib, n int) error {
	for i := range n {
		st, err := lib.Open()
		if err != nil {
			return fmt.Errorf("stream %d of %d: open: %w", i+1, n, err)
		}
		err = RoundTrip(st, Pattern(64+i%512, i))
		if cerr := st.Close(); err == nil && cerr != nil {
			err = fmt.Errorf("close: %w", cerr)
		}
		if err != nil {
			return fmt.Errorf("stream %d of %d: %w", i+1, n, err)
		}
	}
	return nil
}

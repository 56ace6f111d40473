package shmipc

// Fallback data, sent over the socket when the region is full: its order,
// and a stalled fallback write delaying neither another stream's wake-up nor
// the stream's Close.

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

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

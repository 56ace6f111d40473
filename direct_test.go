package shmipc

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"sync"
	"testing"
	"time"
)

// pairedStreamPair connects two sessions of this process, waits until they
// are paired, and returns the two ends of a new stream: cst on the client
// session c, sst on the server session. The first stream of every
// connection is echoed (dialListenerSession's round trip); later ones come
// out of accepted.
func pairedStreamPair(t *testing.T, conf *Config) (c *Session, cst, sst *Stream) {
	t.Helper()
	paired(t)
	ln := startListener(t, conf)
	accepted := make(chan *Stream, 4)
	go func() {
		first := true
		for {
			st, err := ln.AcceptStream()
			if err != nil {
				close(accepted)
				return
			}
			if first {
				first = false
				go echoStream(st)
				continue
			}
			accepted <- st
		}
	}()
	c, srv := dialListenerSession(t, ln, conf)
	waitUntil(t, "the sessions are paired", peerTimeout, func() bool {
		return c.localPeerSession.Load() == srv && srv.localPeerSession.Load() == c
	})
	cst, err := c.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cst.Close() })
	if _, err := cst.Write([]byte{0}); err != nil { // the server learns of the stream
		t.Fatal(err)
	}
	select {
	case sst = <-accepted:
	case <-time.After(peerTimeout):
		t.Fatal("no stream accepted")
	}
	t.Cleanup(func() { sst.Close() })
	sst.SetDeadline(time.Now().Add(peerTimeout))
	if _, err := io.ReadFull(sst, make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
	return c, cst, sst
}

// startListener listens with conf on a new socket; the listener is closed
// when the test ends.
func startListener(t *testing.T, conf *Config) *Listener {
	t.Helper()
	ln, err := Listen("unix", sockPath(t), conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln
}

// waitOffered waits until a reader of st waits in Read with its buffer on
// offer.
func waitOffered(t *testing.T, st *Stream) {
	t.Helper()
	waitUntil(t, "a reader offers its buffer", peerTimeout, func() bool {
		st.mu.Lock()
		defer st.mu.Unlock()
		return st.offered != nil && st.offerN == 0 && st.reader.unread == 0
	})
}

// awaitOffer waits up to within for a reader of st to offer its buffer,
// so that the next write may be copied into it.
func awaitOffer(st *Stream, within time.Duration) {
	for end := time.Now().Add(within); time.Now().Before(end); {
		st.mu.Lock()
		offered := st.offered != nil && st.offerN == 0 && st.reader.unread == 0
		st.mu.Unlock()
		if offered {
			return
		}
		time.Sleep(10 * time.Microsecond)
	}
}

// patterned returns n bytes that differ from message to message (seed).
func patterned(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = seed + byte(i*7+i>>8)
	}
	return b
}

// A Write to a stream whose reader, in a session of this process, waits in
// Read with room for it is copied straight into the reader's buffer: the
// reader gets exactly those bytes, and the writer's Stats count it.
// Messages larger than a slice of the region, which shared memory would
// carry as fallback data, are copied the same way.
func TestCopyToReader(t *testing.T) {
	c, cst, sst := pairedStreamPair(t, DefaultConfig())
	before := c.Stats()
	sizes := []int{1, 7, 4 << 10, 64 << 10, 1 << 20, 5 << 20, 3}
	buf := make([]byte, 6<<20)
	for i, n := range sizes {
		msg := patterned(n, byte(i))
		got := make(chan []byte, 1)
		go func() {
			sst.SetReadDeadline(time.Now().Add(peerTimeout))
			k, err := sst.Read(buf)
			if err != nil {
				t.Errorf("Read: %v", err)
			}
			got <- buf[:k]
		}()
		waitOffered(t, sst)
		if k, err := cst.Write(msg); k != n || err != nil {
			t.Fatalf("Write of %d bytes: %d, %v", n, k, err)
		}
		if b := <-got; !bytes.Equal(b, msg) {
			t.Fatalf("message %d of %d bytes: read %d bytes, not those written", i, n, len(b))
		}
	}
	after := c.Stats()
	if d := after.CopiedToReader - before.CopiedToReader; d != uint64(len(sizes)) {
		t.Errorf("Stats.CopiedToReader went up by %d, want %d (one per message)", d, len(sizes))
	}
	if d := after.MessagesOut - before.MessagesOut; d != uint64(len(sizes)) {
		t.Errorf("Stats.MessagesOut went up by %d, want %d", d, len(sizes))
	}
	if d := after.FallbackMessagesOut - before.FallbackMessagesOut; d != 0 {
		t.Errorf("%d messages went as fallback data", d)
	}
}

// Messages copied into the reader's buffer and messages through shared
// memory keep their order in the byte stream: a reader with a small buffer
// gets some messages copied in (those that fit while it waits) and the
// others through shared memory, and reads every byte once, in order.
func TestCopyToReaderKeepsOrder(t *testing.T) {
	c, cst, sst := pairedStreamPair(t, DefaultConfig())
	before := c.Stats().CopiedToReader
	rng := rand.New(rand.NewPCG(1, 2))
	var want bytes.Buffer
	var msgs [][]byte
	for i := range 3000 {
		n := 1 + rng.IntN(2<<10)
		if i%3 == 0 {
			n = 4<<10 + rng.IntN(12<<10) // larger than the reader's buffer
		}
		m := patterned(n, byte(i))
		msgs = append(msgs, m)
		want.Write(m)
	}
	done := make(chan error, 1)
	go func() {
		defer cst.Close()
		for i, m := range msgs {
			if i%2 == 0 {
				awaitOffer(sst, time.Millisecond) // let the reader catch up and wait
			}
			if _, err := cst.Write(m); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	var got bytes.Buffer
	buf := make([]byte, 4<<10)
	sst.SetReadDeadline(time.Now().Add(30 * time.Second))
	for {
		n, err := sst.Read(buf)
		got.Write(buf[:n])
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("Read after %d bytes: %v", got.Len(), err)
		}
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.Bytes(), want.Bytes()) {
		i := 0
		for i < min(got.Len(), want.Len()) && got.Bytes()[i] == want.Bytes()[i] {
			i++
		}
		t.Fatalf("read %d bytes, wrote %d; first difference at byte %d", got.Len(), want.Len(), i)
	}
	t.Logf("%d of %d messages copied into the reader's buffer", c.Stats().CopiedToReader-before, len(msgs))
}

// A reader whose deadline passes takes its buffer off offer: what is
// written afterwards is read by the next Read, whole.
func TestCopyToReaderAfterDeadline(t *testing.T) {
	_, cst, sst := pairedStreamPair(t, DefaultConfig())
	buf := make([]byte, 64<<10)
	sst.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	if n, err := sst.Read(buf); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Read with nothing sent: %d, %v; want a timeout", n, err)
	}
	sst.mu.Lock()
	offered := sst.offered != nil
	sst.mu.Unlock()
	if offered {
		t.Fatal("the timed-out reader's buffer is still on offer")
	}
	msg := patterned(40<<10, 9)
	if _, err := cst.Write(msg); err != nil {
		t.Fatal(err)
	}
	sst.SetReadDeadline(time.Now().Add(peerTimeout))
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(sst, got); err != nil || !bytes.Equal(got, msg) {
		t.Fatalf("reading the message written after the timeout: %v (equal: %v)", err, bytes.Equal(got, msg))
	}
}

// Two goroutines reading one stream while the peer writes: every byte
// reaches one of them exactly once, whether it was copied into a waiting
// reader's buffer or went through shared memory, and both see the end.
func TestCopyToReaderTwoReaders(t *testing.T) {
	c, cst, sst := pairedStreamPair(t, DefaultConfig())
	before := c.Stats().CopiedToReader
	const msgs = 2000
	rng := rand.New(rand.NewPCG(3, 4))
	var want [256]int
	sizes := make([]int, msgs)
	for i := range sizes {
		sizes[i] = 1 + rng.IntN(32<<10)
		want[byte(i)] += sizes[i]
	}
	var mu sync.Mutex
	var got [256]int
	var wg sync.WaitGroup
	sst.SetReadDeadline(time.Now().Add(60 * time.Second))
	for range 2 {
		wg.Go(func() {
			buf := make([]byte, 40<<10)
			for {
				n, err := sst.Read(buf)
				mu.Lock()
				for _, b := range buf[:n] {
					got[b]++
				}
				mu.Unlock()
				if err == io.EOF {
					return
				}
				if err != nil {
					t.Errorf("Read: %v", err)
					return
				}
			}
		})
	}
	for i, n := range sizes {
		if i%2 == 0 {
			awaitOffer(sst, time.Millisecond)
		}
		if _, err := cst.Write(bytes.Repeat([]byte{byte(i)}, n)); err != nil {
			t.Fatal(err)
		}
	}
	cst.Close()
	wg.Wait()
	if got != want {
		for v := range got {
			if got[v] != want[v] {
				t.Errorf("byte %d: read %d times, written %d times", v, got[v], want[v])
			}
		}
	}
	t.Logf("%d of %d messages copied into a reader's buffer", c.Stats().CopiedToReader-before, msgs)
}

// A reader that closes its stream while waiting with its buffer on offer
// returns ErrStreamClosed, and the peer's writes afterwards neither hang
// nor touch that buffer.
func TestCopyToReaderClosedReader(t *testing.T) {
	_, cst, sst := pairedStreamPair(t, DefaultConfig())
	buf := make([]byte, 64<<10)
	res := make(chan error, 1)
	go func() {
		sst.SetReadDeadline(time.Now().Add(peerTimeout))
		_, err := sst.Read(buf)
		res <- err
	}()
	waitOffered(t, sst)
	sst.Close()
	if err := <-res; !errors.Is(err, ErrStreamClosed) {
		t.Fatalf("Read on a stream closed meanwhile: %v, want ErrStreamClosed", err)
	}
	cst.SetWriteDeadline(time.Now().Add(peerTimeout))
	for range 10 {
		if _, err := cst.Write(patterned(1<<10, 1)); err != nil {
			if !errors.Is(err, ErrStreamClosed) {
				t.Fatalf("Write after the peer closed: %v, want nil or ErrStreamClosed", err)
			}
			break
		}
	}
	if !bytes.Equal(buf, make([]byte, len(buf))) {
		t.Error("the closed reader's buffer was written")
	}
}

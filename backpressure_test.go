package shmipc

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// bpPair starts a server whose streams are handed to the test, and a client
// session, both with conf.
func bpPair(t *testing.T, conf *Config) (*Session, <-chan *Stream) {
	t.Helper()
	ln, err := Listen("unix", filepath.Join(t.TempDir(), "bp.sock"), conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	accepted := make(chan *Stream, 16)
	go func() {
		for {
			st, err := ln.AcceptStream()
			if err != nil {
				return
			}
			accepted <- st
		}
	}()
	sess, err := Dial("unix", ln.Addr().String(), conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sess.Close() })
	return sess, accepted
}

// twoClassPair is bpPair over a 2 MiB region of two lists, 4 KiB slices and
// big ones (bigPercent of the region), after edit (if not nil) changes the
// configuration further. It checks that the list of big slices has
// bigSlices of them.
func twoClassPair(t *testing.T, big, bigPercent, bigSlices uint32, edit func(*Config)) (*Session, <-chan *Stream) {
	t.Helper()
	conf := DefaultConfig()
	conf.ShareMemoryBufferCap = 2 << 20
	conf.BufferSliceSizes = []SizePercentPair{{Size: 4096, Percent: 100 - bigPercent}, {Size: big, Percent: bigPercent}}
	if edit != nil {
		edit(conf)
	}
	sess, accepted := bpPair(t, conf)
	if l := sess.Stats().Lists; len(l) != 2 || l[1].Slices != bigSlices {
		t.Fatalf("lists %+v: want %d slices of %d bytes", l, bigSlices, big)
	}
	return sess, accepted
}

func smallRegion() *Config {
	conf := DefaultConfig()
	conf.ShareMemoryBufferCap = 1 << 20
	conf.BufferSliceSizes = []SizePercentPair{{Size: 4096, Percent: 100}}
	conf.QueueCap = 16
	return conf
}

func assertTimeout(t *testing.T, err error, what string) {
	t.Helper()
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("%s: %v is not a net.Error timeout", what, err)
	}
	if _, ok := err.(net.Error); !ok {
		t.Fatalf("%s: %T does not itself implement net.Error", what, err)
	}
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("%s: %v does not match os.ErrDeadlineExceeded", what, err)
	}
}

// TestBackPressureRegionFull fills the buffer region with messages the peer
// does not read. The next write waits for room until its deadline and then
// fails with a timeout; once the peer reads, writes go through again, and
// every byte arrives in order.
func TestBackPressureRegionFull(t *testing.T) {
	sess, accepted := bpPair(t, smallRegion())
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	msg := bytes.Repeat([]byte{7}, 4000)
	var sent bytes.Buffer
	st.SetWriteDeadline(time.Now().Add(10 * time.Second))
	// The region holds 254 slices of 4 KiB and one is never handed out.
	// The last write waits out its deadline: 100 ms with -short.
	deadline := shortOr(300*time.Millisecond, 100*time.Millisecond)
	var werr error
	for i := 0; i < 300 && werr == nil; i++ {
		start := time.Now()
		st.SetWriteDeadline(start.Add(deadline))
		msg[0] = byte(i)
		if _, werr = st.Write(msg); werr == nil {
			sent.Write(msg)
		} else if time.Since(start) < deadline {
			t.Fatalf("write %d failed after %v without waiting for its deadline: %v", i, time.Since(start), werr)
		}
	}
	if werr == nil {
		t.Fatal("300 unread 4000-byte messages fitted in a 1 MiB region")
	}
	assertTimeout(t, werr, "write into a full region")
	if st.fallback.Load() {
		t.Fatal("the stream switched to fallback data instead of waiting")
	}

	srv := <-accepted
	defer srv.Close()
	got := make([]byte, sent.Len())
	srv.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(srv, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, sent.Bytes()) {
		t.Fatal("the bytes written before the timeout arrived changed")
	}
	t.Logf("free counts after the peer read: %v", freeCounts(sess.buf))
	// The region has room again.
	st.SetWriteDeadline(time.Now().Add(5 * time.Second))
	msg[0] = 0xEE
	if _, err := st.Write(msg); err != nil {
		t.Fatalf("write after the peer read: %v", err)
	}
	if _, err := io.ReadFull(srv, got[:len(msg)]); err != nil || !bytes.Equal(got[:len(msg)], msg) {
		t.Fatalf("message after the timeout: %v", err)
	}
}

// TestBackPressureQueueFull fills the peer's IO queue (capacity 16) with
// small messages while its receiver is blocked, so that nothing drains it:
// the write waits, then fails with a timeout that wraps ErrQueueFull.
func TestBackPressureQueueFull(t *testing.T) {
	conf := smallRegion()
	conf.WriteSpaceTimeout = shortOr(300*time.Millisecond, 100*time.Millisecond) // waited out
	conf.ConsumerSpinTime = 0
	sess, accepted := bpPair(t, conf)
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := st.Write([]byte("first")); err != nil {
		t.Fatal(err)
	}
	srv := <-accepted
	defer srv.Close()
	// Stall the server's receive loop, the queue's only consumer.
	release := holdReceive(t, srv.s)
	var werr error
	for i := 0; i < 40 && werr == nil; i++ {
		_, werr = st.Write([]byte("x"))
	}
	release()
	if werr == nil {
		t.Fatal("40 messages fitted in a queue of 16")
	}
	assertTimeout(t, werr, "write into a full queue")
	if !errors.Is(werr, ErrQueueFull) {
		t.Fatalf("%v does not wrap ErrQueueFull", werr)
	}
}

// TestFallbackWhenFull checks the other policy: with no room in the region,
// messages go as fallback data at once, and arrive intact.
func TestFallbackWhenFull(t *testing.T) {
	conf := smallRegion()
	conf.FallbackWhenFull = true
	sess, accepted := bpPair(t, conf)
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	var sent bytes.Buffer
	msg := make([]byte, 4000)
	for i := range 300 {
		msg[0], msg[1] = byte(i), byte(i>>8)
		st.SetWriteDeadline(time.Now().Add(5 * time.Second))
		if _, err := st.Write(msg); err != nil {
			t.Fatalf("write %d: %v", i, err)
		}
		sent.Write(msg)
	}
	if !st.fallback.Load() {
		t.Fatal("300 unread messages in a 1 MiB region did not fall back")
	}
	srv := <-accepted
	defer srv.Close()
	got := make([]byte, sent.Len())
	srv.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(srv, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, sent.Bytes()) {
		t.Fatal("bytes differ across the switch to fallback data")
	}
}

package shmipc

import (
	"bytes"
	"fmt"
	"io"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/shm"
)

// echoChecked writes msg on st and reads the echo back, comparing it.
//
// It reads the echo through the BufferReader, so that the echo arrives as a
// message in shared memory: between sessions of one process a Write can go
// straight into the buffer of a waiting Read instead (direct.go), and
// leave no slice to keep.
func echoChecked(t *testing.T, st *Stream, msg []byte) {
	t.Helper()
	if _, err := st.Write(msg); err != nil {
		t.Fatal(err)
	}
	r := st.BufferReader()
	got, err := r.ReadBytes(len(msg))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, msg) {
		t.Fatalf("echo of %d bytes differs", len(msg))
	}
	r.ReleasePreviousRead()
}

// TestStreamReusesSlice: streams that keep the slice they read for their
// next message deliver every byte intact, with messages that fit in the
// kept slice and messages that do not, and hold at most one slice each at
// rest; closing them gives everything back.
func TestStreamReusesSlice(t *testing.T) {
	conf := DefaultConfig()
	sess := dialEchoSession(t, conf)
	small := int(sess.buf.Lists()[0].SliceCap) // lists are in ascending size

	const streams = 4
	var wg sync.WaitGroup
	opened := make([]*Stream, streams)
	for i := range opened {
		st, err := sess.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		st.SetDeadline(time.Now().Add(30 * time.Second))
		opened[i] = st
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(i), 1))
			for n := range 300 {
				size := 1 + rng.IntN(small)
				if n%10 == 9 {
					size = small + 1 + rng.IntN(3*small) // needs a larger slice
				}
				msg := make([]byte, size)
				for j := range msg {
					msg[j] = byte(rng.Uint32())
				}
				echoChecked(t, st, msg)
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	if inUse, most := sess.Stats().Buffer.InUse, keptAtMost(sess.buf); inUse > uint64(streams*most) {
		t.Errorf("Buffer.InUse %d at rest with %d streams open; want at most one slice of at most %d bytes each", inUse, streams, most)
	}
	for _, st := range opened {
		st.Close()
	}
	waitUntil(t, "the closed streams' slices are free", 5*time.Second, func() bool { return sess.Stats().Buffer.InUse == 0 })
}

// keptAtMost is the capacity of the largest slice a stream may keep.
func keptAtMost(m *shm.Buffer) int {
	most := 0
	for li, l := range m.Lists() {
		if m.Keepable(int32(li)) {
			most = max(most, int(l.SliceCap))
		}
	}
	return most
}

// keepShare: a process's streams may keep at most 1/keepShare of a list.
const keepShare = 8

// keepers counts, per list, the streams of sess that may keep a slice of
// it: those whose kept slot names the list.
func keepers(sess *Session) map[int]int32 {
	n := make(map[int]int32)
	sess.mu.Lock()
	defer sess.mu.Unlock()
	for _, st := range sess.streams {
		if v := st.kept.Load(); v != keptNone && v != keptShut {
			n[int(v>>32)]++
		}
	}
	return n
}

// TestKeptSlicesBounded: however many streams are open, a process keeps at
// most an eighth of each class, and every stream can still send.
func TestKeptSlicesBounded(t *testing.T) {
	conf := DefaultConfig()
	conf.ShareMemoryBufferCap = 1 << 20
	conf.BufferSliceSizes = []SizePercentPair{
		{Size: 8<<10 - shm.SliceHeaderSize, Percent: 50},
		{Size: 32<<10 - shm.SliceHeaderSize, Percent: 50},
	}
	sess := dialEchoSession(t, conf)
	m := sess.buf
	limit := int(m.Lists()[0].Count) / keepShare
	if limit < 2 {
		t.Fatalf("the test layout lets a process keep %d slices; want a few", limit)
	}

	streams := make([]*Stream, 4*limit)
	for i := range streams {
		st, err := sess.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		st.SetDeadline(time.Now().Add(30 * time.Second))
		streams[i] = st
		echoChecked(t, st, []byte("keep me"))
	}
	kept := keepers(sess)
	for li, l := range m.Lists() {
		if kept, max := kept[li], int32(l.Count)/keepShare; kept > max {
			t.Errorf("%d streams of this process may keep a slice of list %d; want at most %d", kept, li, max)
		}
	}
	// Both processes (here both ends are this test) keep at most limit
	// each, so the list has slices left for everybody.
	if inUse := sess.Stats().Buffer.InUse; inUse > uint64(2*limit)*uint64(m.Lists()[0].SliceCap) {
		t.Errorf("Buffer.InUse %d with %d streams open; want at most %d slices kept", inUse, len(streams), 2*limit)
	}
	for _, st := range streams {
		echoChecked(t, st, bytes.Repeat([]byte("x"), int(m.Lists()[0].SliceCap)))
	}
}

// keepOneSlice opens a stream of a client whose server is a raw peer and
// exchanges one message each way, after which the client's stream keeps
// the slice of the reply it read. It checks that it does.
func keepOneSlice(t *testing.T) (*rawPeer, *Session, *Stream) {
	t.Helper()
	p, sess := acceptRawVictim(t, MemMapTypeMemFd, defaultConsumerSpinTime)
	st := openPinged(t, p, sess)
	p.publish(st.ID(), p.msg("pong"), shm.StatusOpened)
	got := make([]byte, 4)
	if _, err := io.ReadFull(st, got); err != nil || string(got) != "pong" {
		t.Fatalf("read %q, %v; want \"pong\"", got, err)
	}
	if sess.Stats().Buffer.InUse == 0 {
		t.Fatal("the stream kept no slice of the reply it read")
	}
	return p, sess, st
}

// fullLists reports whether every list of the region, as the raw peer sees
// it, holds all its slices, and describes the lists.
func fullLists(p *rawPeer) (bool, string) {
	full := true
	var desc []string
	for _, l := range p.bm.Lists() {
		desc = append(desc, fmt.Sprintf("%d/%d", l.Free, l.Count))
		full = full && l.Free == int32(l.Count)
	}
	return full, strings.Join(desc, " ")
}

// TestKeptSliceFreeWhenPeerSeesEnd: when a client closes its session while
// a stream still keeps a slice, the slice is back on its list by the time
// the peer reads the end of the connection, as a peer that counts its free
// lists then expects.
func TestKeptSliceFreeWhenPeerSeesEnd(t *testing.T) {
	p, sess, _ := keepOneSlice(t)
	atEnd := make(chan string, 1)
	go func() {
		p.conn.SetReadDeadline(time.Now().Add(peerTimeout))
		for {
			if _, err := readN(p.conn, 8); err != nil {
				if full, desc := fullLists(p); !full {
					atEnd <- fmt.Sprintf("free lists %s at the end of the connection (%v)", desc, err)
				}
				close(atEnd)
				return
			}
		}
	}()
	closeWithin(t, sess, peerTimeout)
	if problem, ok := <-atEnd; ok {
		t.Error(problem)
	}
}

// TestKeptSliceFreeWhenPeerCloses: a stream the peer closed sends nothing
// more, so the slice it kept goes back at once, before the user closes it.
func TestKeptSliceFreeWhenPeerCloses(t *testing.T) {
	p, sess, st := keepOneSlice(t)
	p.publish(st.ID(), 0, shm.StatusClosed)
	waitUntil(t, "the kept slice is free", peerTimeout, func() bool { return sess.Stats().Buffer.InUse == 0 })
	if full, desc := fullLists(p); !full {
		t.Errorf("free lists %s after the peer closed the only stream", desc)
	}
	if _, err := st.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("Read after the peer closed the stream: %v, want io.EOF", err)
	}
}

// A stream whose messages need a larger class than the smallest keeps a
// slice of that class: its permission moves to the class its messages come
// in, and it holds one permission throughout.
func TestStreamKeepsLargerClass(t *testing.T) {
	conf := DefaultConfig()
	sess, _ := dialListenerSession(t, startEchoListener(t, conf), conf)
	m := sess.buf
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	st.SetDeadline(time.Now().Add(20 * time.Second))
	keptCap := func() int {
		v := st.kept.Load()
		if !holdsSlice(v) {
			return 0
		}
		li, _ := keptSlice(v)
		return m.SliceCap(li)
	}
	for _, size := range []int{100, 16 << 10, 16 << 10, 100 << 10, 100, 16 << 10} {
		echoChecked(t, st, bytes.Repeat([]byte{byte(size)}, size))
		got := keptCap()
		if got < size {
			t.Errorf("after an echo of %d bytes the stream keeps a slice of %d bytes; want one that holds the message", size, got)
		}
	}
	kept := int32(0)
	for _, n := range keepers(sess) {
		kept += n
	}
	if kept != 1 {
		t.Errorf("%d permissions to keep held by the process's one stream; want 1", kept)
	}
}

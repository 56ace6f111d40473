package shmipc

import (
	"bytes"
	"io"
	"math/rand/v2"
	"sync"
	"testing"
	"time"
)

// echoChecked writes msg on st and reads the echo back, comparing it.
func echoChecked(t *testing.T, st *Stream, msg []byte) {
	t.Helper()
	if _, err := st.Write(msg); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(st, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, msg) {
		t.Fatalf("echo of %d bytes differs", len(msg))
	}
}

// TestStreamReusesSlice: streams that keep the slice they read for their
// next message deliver every byte intact, with messages that fit in the
// kept slice and messages that do not, and hold at most one slice each at
// rest; closing them gives everything back.
func TestStreamReusesSlice(t *testing.T) {
	conf := DefaultConfig()
	sess := dialEchoSession(t, conf)
	small := int(sess.buf.lists[sess.buf.bySize[0]].sliceCap)

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
	if inUse := sess.Stats().Buffer.InUse; inUse > uint64(streams*small) {
		t.Errorf("Buffer.InUse %d at rest with %d streams open; want at most one %d-byte slice each", inUse, streams, small)
	}
	for _, st := range opened {
		st.Close()
	}
	waitUntil(t, "the closed streams' slices are free", 5*time.Second, func() bool { return sess.Stats().Buffer.InUse == 0 })
}

// TestKeptSlicesBounded: however many streams are open, a process keeps at
// most an eighth of the smallest class, and every stream can still send.
func TestKeptSlicesBounded(t *testing.T) {
	conf := DefaultConfig()
	conf.ShareMemoryBufferCap = 1 << 20
	conf.BufferSliceSizes = []SizePercentPair{
		{Size: 8<<10 - sliceHeaderSize, Percent: 50},
		{Size: 32<<10 - sliceHeaderSize, Percent: 50},
	}
	sess := dialEchoSession(t, conf)
	m := sess.buf
	smallest := m.lists[m.bySize[0]]
	limit := int(smallest.count) / keepShare
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
	if kept := int(m.keepers.Load()); kept > limit {
		t.Errorf("%d streams of this process may keep a slice; want at most %d", kept, limit)
	}
	// Both processes (here both ends are this test) keep at most limit
	// each, so the list has slices left for everybody.
	if inUse := sess.Stats().Buffer.InUse; inUse > uint64(2*limit)*uint64(smallest.sliceCap) {
		t.Errorf("Buffer.InUse %d with %d streams open; want at most %d slices kept", inUse, len(streams), 2*limit)
	}
	for _, st := range streams {
		echoChecked(t, st, bytes.Repeat([]byte("x"), int(smallest.sliceCap)))
	}
}

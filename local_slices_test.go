package shmipc

import (
	"bytes"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// localCounts sums the slices waiting in m's local slots.
func localCounts(m *bufferManager) int32 {
	ls := m.local.Load()
	if ls == nil {
		return 0
	}
	var n int32
	for i := range ls.count {
		n += ls.count[i].Load()
	}
	return n
}

// pinToCurrentCPU locks the goroutine to its thread and the thread to the
// processor it is on, and returns that processor and the undo.
func pinToCurrentCPU(t *testing.T) (int, func()) {
	t.Helper()
	runtime.LockOSThread()
	var old unix.CPUSet
	if err := unix.SchedGetaffinity(0, &old); err != nil {
		runtime.UnlockOSThread()
		t.Fatalf("sched_getaffinity: %v", err)
	}
	cpu := currentCPU()
	var one unix.CPUSet
	one.Set(cpu)
	if err := unix.SchedSetaffinity(0, &one); err != nil {
		runtime.UnlockOSThread()
		t.Fatalf("sched_setaffinity to processor %d: %v", cpu, err)
	}
	return cpu, func() {
		_ = unix.SchedSetaffinity(0, &old)
		runtime.UnlockOSThread()
	}
}

// The local slots of a buffer manager: a slice put there stays held and off
// its list, within the list's share; a writer on the same processor takes
// it, one that finds the lists short takes it from any processor, nobody
// takes or puts while writers wait for room, and the last paired stream to
// let go empties them.
func TestLocalSlots(t *testing.T) {
	const large = keepMaxCap + 4096
	m, _ := newHeapBuffer(t, listPlan{sliceCap: 8 << 10, count: 16}, listPlan{sliceCap: large, count: 16})
	const li = 1
	if got := m.lists[li].localLimit; got != 16/localShare {
		t.Fatalf("local limit of a list of 16 large slices = %d, want %d", got, 16/localShare)
	}
	if got := m.lists[0].localLimit; got != 0 {
		t.Fatalf("local limit of the small list = %d, want 0 (streams keep those)", got)
	}
	full := m.freeCounts()
	received := func() uint32 {
		t.Helper()
		off, err := m.pop(li)
		if err != nil || off == 0 {
			t.Fatalf("pop: %d, %v", off, err)
		}
		if !m.hold(li, off) {
			t.Fatalf("slice %d was held already", off)
		}
		return off
	}
	held := func(off uint32) bool {
		w, bit := m.heldBit(li, off)
		return w.Load()&bit != 0
	}

	a, b, c := received(), received(), received()
	// No paired stream yet: no slots (a manager serving other processes
	// only never has them).
	if put, _ := m.putLocal(li, a); put || m.local.Load() != nil {
		t.Fatalf("putLocal before any paired stream: put %v, slots set up %v", put, m.local.Load() != nil)
	}
	m.localOpen()
	_, unpin := pinToCurrentCPU(t)
	for _, off := range []uint32{a, b} {
		if put, err := m.putLocal(li, off); !put || err != nil {
			t.Fatalf("putLocal(%d) = %v, %v; want it put", off, put, err)
		}
	}
	if put, _ := m.putLocal(li, c); put {
		t.Fatal("putLocal went beyond the list's share")
	}
	if put, _ := m.putLocal(0, c); put {
		t.Fatal("putLocal took a slice of a list streams keep")
	}
	if !held(a) || !held(b) || localCounts(m) != 2 {
		t.Fatalf("slices in the slots: held %v %v, counted %d; want held, 2", held(a), held(b), localCounts(m))
	}
	if _, _, ok := m.takeLocal(large + 1); ok {
		t.Fatal("takeLocal handed out a slice smaller than asked for")
	}
	gotLi, got, ok := m.takeLocal(large)
	unpin()
	if !ok || gotLi != li || (got != a && got != b) || held(got) {
		t.Fatalf("takeLocal on the processor that put = %d/%d, %v (held %v); want one of %d, %d, unheld", gotLi, got, ok, held(got), a, b)
	}
	other := a + b - got
	if err := m.push(li, got); err != nil {
		t.Fatal(err)
	}

	// Writers waiting for room: the slots are left to the queue's turn,
	// except as a last resort.
	m.space.waiting.Add(1)
	if _, _, ok := m.takeLocal(0); ok {
		t.Fatal("takeLocal took a slice while writers waited for room")
	}
	if put, _ := m.putLocal(li, c); put {
		t.Fatal("putLocal put a slice while writers waited for room")
	}
	if _, off, ok := m.stealLocal(large); !ok || off != other {
		t.Fatalf("stealLocal = %d, %v; want %d", off, ok, other)
	}
	m.space.waiting.Add(-1)
	if err := m.push(li, other); err != nil {
		t.Fatal(err)
	}

	// The last paired stream lets go: the slots empty onto the list.
	if put, err := m.putLocal(li, c); !put || err != nil {
		t.Fatalf("putLocal(%d) = %v, %v", c, put, err)
	}
	if err := m.localClose(); err != nil {
		t.Fatal(err)
	}
	if got := m.freeCounts(); !equalCounts(got, full) || localCounts(m) != 0 || held(c) {
		t.Fatalf("after the last paired stream: free %v (want %v), %d in the slots, held %v", got, full, localCounts(m), held(c))
	}
	// A put that races the last one letting go does not stay.
	d := received()
	if put, err := m.putLocal(li, d); !put || err != nil {
		t.Fatalf("putLocal(%d) with no paired stream = %v, %v", d, put, err)
	}
	if got := m.freeCounts(); !equalCounts(got, full) || localCounts(m) != 0 {
		t.Fatalf("a put after the last paired stream let go stayed: free %v, want %v", got, full)
	}
}

func equalCounts(a, b []int32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// dialPairedWith starts a listener whose streams handle serves, dials it
// with conf, and returns the client's session once it is paired.
func dialPairedWith(t *testing.T, conf *Config, handle func(*Stream)) *Session {
	t.Helper()
	paired(t)
	ln := startListener(t, conf)
	go serveStreams(ln, handle)
	c, err := Dial("unix", ln.Addr().String(), conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	waitUntil(t, "the sessions are paired", peerTimeout, func() bool { return c.localPeerSession.Load() != nil })
	return c
}

// bufferEcho is a client of shmEchoServer (bench_test.go): it writes its
// message into shared memory (Reserve) and reads the echo in place
// (ReadBytes), so that both go through slices.
func bufferEcho(st *Stream, msg []byte) error {
	p, err := st.BufferWriter().Reserve(len(msg))
	if err != nil {
		return fmt.Errorf("reserve: %w", err)
	}
	copy(p, msg)
	if err := st.Flush(false); err != nil {
		return fmt.Errorf("flush: %w", err)
	}
	got, err := st.BufferReader().ReadBytes(len(msg))
	if err != nil {
		return fmt.Errorf("read: %w", err)
	}
	if !bytes.Equal(got, msg) {
		return fmt.Errorf("the echo differs first at byte %d", firstDiff(got, msg))
	}
	st.BufferReader().ReleasePreviousRead()
	return nil
}

// Streams of a paired session echoing large messages at once get every
// byte back, the large slices they read wait in the local slots meanwhile,
// and once the streams are closed every slice is back on its list.
func TestLocalSlotsPairedEcho(t *testing.T) {
	const streams, rounds, size = 8, 12, 1 << 20
	c := dialPairedWith(t, DefaultConfig(), func(st *Stream) { shmEchoServer(st, size) })
	var wg sync.WaitGroup
	errs := make(chan error, streams)
	opened := make([]*Stream, streams)
	for i := range opened {
		st, err := c.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		st.SetDeadline(time.Now().Add(time.Minute))
		opened[i] = st
	}
	for i, st := range opened {
		wg.Add(1)
		go func() {
			defer wg.Done()
			msg := make([]byte, size)
			for r := range rounds {
				for k := range msg {
					msg[k] = byte(i*31 + r*7 + k/4096)
				}
				if err := bufferEcho(st, msg); err != nil {
					errs <- fmt.Errorf("stream %d, round %d: %w", i, r, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if t.Failed() {
		return
	}
	if n := localCounts(c.buf); n == 0 {
		t.Error("no large slice the client read waits in its local slots")
	}
	for _, st := range opened {
		st.Close()
	}
	waitUntil(t, "the local slots are empty once the streams are closed", peerTimeout, func() bool {
		return localCounts(c.buf) == 0
	})
	waitFreeListsFull(t, c)
}

// A writer that finds the lists empty takes a large slice waiting on
// another processor's slots instead of waiting for room (or sending the
// message over the socket).
func TestLocalSlotsTakenWhenListsEmpty(t *testing.T) {
	conf := DefaultConfig()
	conf.ShareMemoryBufferCap = 32 << 20
	conf.BufferSliceSizes = []SizePercentPair{{Size: 8<<10 - sliceHeaderSize, Percent: 50}, {Size: 1<<20 + 4<<10, Percent: 50}}
	msg := bytes.Repeat([]byte("local slots "), (1<<20)/12)
	c := dialPairedWith(t, conf, func(st *Stream) { shmEchoServer(st, len(msg)) })
	m := c.buf
	li := m.bySize[len(m.bySize)-1]
	if m.lists[li].localLimit == 0 {
		t.Fatalf("the large list of %d slices has no local share", m.lists[li].count)
	}
	st, err := c.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	st.SetDeadline(time.Now().Add(time.Minute))
	if err := bufferEcho(st, msg); err != nil {
		t.Fatal(err)
	}
	if localCounts(m) != 1 {
		t.Fatalf("%d slices in the client's local slots after an echo, want the reply's", localCounts(m))
	}

	cpu, unpin := pinToCurrentCPU(t)
	defer unpin()
	if cpus := m.local.Load().cpus; len(cpus) > 1 {
		// Move the slice to another processor's slots.
		here := cpu & (len(cpus) - 1)
		for i := range cpus[here].slot {
			if v := cpus[here].slot[i].Swap(0); v != 0 {
				cpus[(here+1)&(len(cpus)-1)].slot[0].Store(v)
			}
		}
	}
	// Empty the lists (the last slice of a list is never handed out).
	var taken [][2]uint32
	err = c.access(func() error {
		for l := range m.lists {
			for {
				off, err := m.take(l, false)
				if err != nil {
					return err
				}
				if off == 0 {
					break
				}
				taken = append(taken, [2]uint32{uint32(l), off})
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	fallback := c.Stats().FallbackMessagesOut
	p, err := st.BufferWriter().Reserve(len(msg))
	if err != nil {
		t.Fatal(err)
	}
	copy(p, msg)
	if localCounts(m) != 0 {
		t.Fatal("the writer did not take the slice waiting in the local slots")
	}
	if n := c.Stats().FallbackMessagesOut - fallback; n != 0 {
		t.Fatalf("the message went over the socket (%d fallback messages)", n)
	}
	err = c.access(func() error {
		for _, s := range taken {
			if err := m.push(int(s[0]), s[1]); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Flush(false); err != nil {
		t.Fatal(err)
	}
	got, err := st.BufferReader().ReadBytes(len(msg))
	if err != nil || !bytes.Equal(got, msg) {
		t.Fatalf("echo of the message written into the stolen slice: %v (differs at %d)", err, firstDiff(got, msg))
	}
	st.BufferReader().ReleasePreviousRead()
	st.Close()
	waitFreeListsFull(t, c)
}

package shmipc

import (
	"encoding/binary"
	"fmt"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
	"github.com/goshm/shmipc/internal/shm"
)

// TestCirculationChild is the server process of the circulation tests: on
// SOCK, with DefaultConfig, it echoes each stream's messages in place. A
// stream starts with a 4-byte big-endian message size n; every message of n
// bytes is read with ReadBytes and copied into one reserved reply, so a
// stream has at most two slices in flight: its request and its reply.
func TestCirculationChild(t *testing.T) {
	if proctest.Role() == "" {
		t.Skip("runs only as the child process of the circulation tests")
	}
	ln, err := Listen("unix", proctest.MustArg(t, "SOCK"), DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			st, err := ln.AcceptStream()
			if err != nil {
				return
			}
			go circEcho(st)
		}
	}()
	proctest.Ready()
	<-proctest.StdinClosed()
}

func circEcho(st *Stream) {
	defer st.Close()
	r, w := st.BufferReader(), st.BufferWriter()
	head, err := r.ReadBytes(4)
	if err != nil {
		return
	}
	n := int(binary.BigEndian.Uint32(head))
	r.ReleasePreviousRead()
	for {
		msg, err := r.ReadBytes(n)
		if err != nil {
			return
		}
		reply, err := w.Reserve(n)
		if err != nil {
			return
		}
		copy(reply, msg)
		if st.Flush(false) != nil {
			return
		}
		r.ReleasePreviousRead()
	}
}

// circStream echoes messages of size bytes on a new stream of sess until
// stop is closed, the same way as circEcho: in place, one message in flight.
func circStream(sess *Session, size int, stop <-chan struct{}, rounds *atomic.Int64) error {
	st, err := sess.OpenStream()
	if err != nil {
		return err
	}
	defer st.Close()
	r, w := st.BufferReader(), st.BufferWriter()
	var head [4]byte
	binary.BigEndian.PutUint32(head[:], uint32(size))
	if _, err := w.WriteBytes(head[:]); err != nil {
		return err
	}
	if err := st.Flush(false); err != nil {
		return err
	}
	for i := 0; ; i++ {
		select {
		case <-stop:
			return nil
		default:
		}
		st.SetDeadline(time.Now().Add(20 * time.Second))
		p, err := w.Reserve(size)
		if err != nil {
			return err
		}
		mark := byte(i) + 1
		p[0], p[size/2], p[size-1] = mark, mark, mark
		if err := st.Flush(false); err != nil {
			return err
		}
		got, err := r.ReadBytes(size)
		if err != nil {
			return err
		}
		if got[0] != mark || got[size/2] != mark || got[size-1] != mark {
			return fmt.Errorf("echo %d of %d bytes differs", i, size)
		}
		r.ReleasePreviousRead()
		rounds.Add(1)
	}
}

// circListFor returns the list that serves a message of size bytes in one
// slice: the smallest whose slices hold it.
func circListFor(t *testing.T, m *shm.Buffer, size int) int {
	t.Helper()
	for li, l := range m.Lists() { // in ascending size, as Config lays them out
		if int(l.SliceCap) >= size {
			return li
		}
	}
	t.Fatalf("no list holds %d bytes", size)
	return -1
}

// TestCommittedFollowsInFlight runs sustained traffic against a server
// process with few messages in flight, of large classes (1 MiB and 128 KiB
// slices), and checks that the buffer region's committed memory stays
// within the bound of internal/shm circulation.go, headers + Σ over classes of
// min(slices, peak in flight + spare) × slice size, with 1 MiB of slack,
// where without circulation control every slice of both classes would be
// committed. Once traffic stops, committed memory must return to its idle
// level and every slice must be free again, none parked.
func TestCommittedFollowsInFlight(t *testing.T) {
	waitsInParallel(t)
	sock := filepath.Join(t.TempDir(), "circ.sock")
	srv := proctest.Start(t, proctest.Config{TestName: "TestCirculationChild", Role: "echo", Args: map[string]string{"SOCK": sock}})
	if _, err := srv.WaitReady(30 * time.Second); err != nil {
		t.Fatalf("server process did not start: %v\n%s", err, srv.Output())
	}
	defer srv.Stop(10 * time.Second)
	shmem0 := meminfo(t, "Shmem")
	sess, err := Dial("unix", sock, DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	m := sess.buf
	idle := sess.Stats().Buffer.Committed

	// Streams by message size. A stream has at most three slices in
	// flight: its request, the reply, and its next request reserved before
	// the server has released the previous one.
	loads := []struct{ size, streams int }{
		{1 << 20, 1},   // the 1 MiB class: 8 slices
		{100 << 10, 2}, // the 128 KiB class: 66 slices
	}
	var bound, all uint64
	for _, ld := range loads {
		l := m.Lists()[circListFor(t, m, ld.size)]
		peak := int32(3 * ld.streams)
		// The spare of a busy list: at least 2 slices and 1 MiB.
		spare := min(max(2, int32((1<<20+l.SliceCap-1)/l.SliceCap), (peak+3)/4), int32(l.Count))
		cycling := min(int32(l.Count), peak+spare)
		stride := uint64(l.SliceCap) + shm.SliceHeaderSize
		bound += uint64(cycling) * stride
		all += uint64(l.Count) * stride
	}
	const slack = 1 << 20
	limit := idle + bound + slack
	if idle+all <= limit {
		t.Fatalf("the bound (%d bytes) does not tell circulation control from none (%d bytes)", bound, all)
	}

	stop := make(chan struct{})
	var rounds atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for _, ld := range loads {
		for range ld.streams {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := circStream(sess, ld.size, stop, &rounds); err != nil {
					errs <- err
				}
			}()
		}
	}
	// The first look parks what traffic does not need; until then the FIFO
	// order may touch every slice. Measuring starts ten periods into the
	// traffic, or with -short two periods after slices are seen parked
	// (the bound holds from the first look after traffic changes).
	if testing.Short() {
		waitUntil(t, "the first look parks slices", time.Minute, func() bool {
			for _, l := range sess.Stats().Lists {
				if l.Parked > 0 {
					return true
				}
			}
			return false
		})
		time.Sleep(2 * circulationPeriods.Look)
	} else {
		time.Sleep(10 * circulationPeriods.Look)
	}
	var peak, shmemPeak uint64
	var parked int32
	// At least the measuring time and 100 echoes: a loaded machine gets
	// more time, not a failure.
	// (With -short, 500 ms: ten looks of the circulation control, whose
	// bound holds from the first look after traffic changes.)
	end, giveUp := time.Now().Add(shortOr(3*time.Second, 500*time.Millisecond)), time.Now().Add(time.Minute)
	for ; (time.Now().Before(end) || rounds.Load() < 100) && time.Now().Before(giveUp); time.Sleep(10 * time.Millisecond) {
		st := sess.Stats()
		peak = max(peak, st.Buffer.Committed)
		shmemPeak = max(shmemPeak, meminfo(t, "Shmem"))
		var p int32
		for _, l := range st.Lists {
			p += l.Parked
		}
		parked = max(parked, p)
	}
	busy := rounds.Load()
	if peak > limit {
		circLogLists(t, sess, "under load")
	}
	close(stop)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	mib := func(n uint64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }
	t.Logf("committed: idle %s; under load at most %s (bound %s over idle, %s without circulation control); at most %d slices parked; %d echoes; Shmem at most %+.1f MiB",
		mib(idle), mib(peak), mib(bound), mib(all), parked, busy, float64(int64(shmemPeak)-int64(shmem0))/(1<<20))
	if busy < 100 {
		t.Errorf("only %d echoes in the measured time: the traffic did not run", busy)
	}
	if parked == 0 {
		t.Error("no slice was parked under load")
	}
	if peak > limit {
		t.Errorf("under load %d bytes were committed; the bound is %d (idle %d + %d + %d slack)", peak, limit, idle, bound, slack)
	}

	stopped := time.Now()
	for {
		now := sess.Stats().Buffer.Committed
		if now <= idle+256<<10 {
			t.Logf("committed %s %v after traffic stopped", mib(now), time.Since(stopped).Round(time.Millisecond))
			break
		}
		if time.Since(stopped) > circulationPeriods.GiveBack+time.Minute {
			circLogLists(t, sess, "once quiet")
			t.Fatalf("committed %d bytes %v after traffic stopped; %d when idle", now, time.Since(stopped).Round(time.Second), idle)
		}
		time.Sleep(20 * time.Millisecond)
	}
	fpWaitFull(t, sess)
	for _, l := range sess.Stats().Lists {
		if l.Parked != 0 {
			t.Errorf("list of %d-byte slices: %d slices still parked once quiet", l.SliceSize, l.Parked)
		}
	}
}

// circLogLists logs the state of every list of sess's buffer region.
func circLogLists(t *testing.T, sess *Session, when string) {
	t.Helper()
	for _, l := range sess.Stats().Lists {
		t.Logf("%s: list of %d-byte slices: %d free, %d parked", when, l.SliceSize, l.Free, l.Parked)
	}
}

// TestParkedSlicesReachThePeer checks that parking never keeps slices from
// the peer: once a list has parked slices, the peer (here the server side
// of an in-process session, popping directly as any peer does) can take
// every slice of the list but the last, each within a few periods of
// finding the list short, without this process allocating anything; and
// once it pushes them back, every list is full.
func TestParkedSlicesReachThePeer(t *testing.T) {
	old := circulationPeriods
	circulationPeriods.GiveBack = time.Minute // no quiet give-back: only the refills return slices
	defer func() { circulationPeriods = old }()
	conf := DefaultConfig()
	sess := dialEchoSession(t, conf)
	m := sess.buf
	li := circListFor(t, m, 100<<10)

	// Traffic in the class until some of its slices are parked.
	msg := make([]byte, 100<<10)
	deadline := time.Now().Add(10 * time.Second)
	for sess.Stats().Lists[li].Parked == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("no slice of the %d-byte class parked after 10 s of traffic: %+v", m.Lists()[li].SliceCap, sess.Stats().Lists[li])
		}
		for range 20 {
			fpEcho(t, sess, msg).Close()
		}
	}
	t.Logf("before the peer takes them: %+v", sess.Stats().Lists[li])

	peer := regionPeer(t, m)
	pm := peer.buf
	count := int(m.Lists()[li].Count)
	var held []uint32
	var waits int
	var longest time.Duration
	for len(held) < count-1 {
		start := time.Now()
		var off uint32
		for {
			var err error
			if off, err = pm.Pop(li); err != nil {
				t.Fatal(err)
			}
			if off != 0 {
				break
			}
			if time.Since(start) > 30*time.Second { // a bound for a loaded machine: a slice comes within a few looks
				t.Fatalf("the peer holds %d of %d slices and has found none for %v: %+v", len(held), count, time.Since(start), sess.Stats().Lists[li])
			}
			time.Sleep(time.Millisecond)
		}
		if d := time.Since(start); d > time.Millisecond {
			waits++
			longest = max(longest, d)
		}
		held = append(held, off)
	}
	t.Logf("the peer took all %d slices but the last; it waited %d times, at most %v", len(held), waits, longest)
	if st := sess.Stats().Lists[li]; st.Parked != 0 {
		t.Errorf("%d slices still parked while the peer holds all it can: %+v", st.Parked, st)
	}
	for _, off := range held {
		if err := pm.Push(li, off); err != nil {
			t.Fatal(err)
		}
	}
	fpWaitFull(t, sess)
}

// regionPeer returns the server session of this process that maps m, a
// client's buffer region.
func regionPeer(t *testing.T, m *shm.Buffer) *Session {
	t.Helper()
	registry.Lock()
	defer registry.Unlock()
	for s := range registry.live {
		if !s.isClient && s.buf.Region().Path() == m.Region().Path() {
			return s
		}
	}
	t.Fatal("no server session maps the client's region")
	return nil
}

package shmipc

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/goshm/shmipc/internal/wire"
)

// Unit tests of polling and waiting (poll.go): the spin budget of one
// session, the process-wide spin governor, and the turn taking around the
// consumer token and the working flag, on a client session whose regions
// live in Go memory and that has no connection.

// pollPeer is the far side of a pollSession: it produces into the session's
// receive queue and allocates in the shared buffer region.
type pollPeer struct {
	send *ioQueue
	buf  *bufferManager
	flag *uint32 // the working flag of the session's receive queue
}

// newPollSession returns a client session with only what receiving needs:
// its receive queue and buffer region, and no streams, so that every data
// element it takes is freed (PROTOCOL.md §6.2).
func newPollSession(t *testing.T) (*Session, *pollPeer) {
	t.Helper()
	mem, client, server := newHeapQueues(t, 16)
	buf, peerBuf := newHeapBuffer(t, listPlan{sliceCap: 64, count: 16})
	s := &Session{
		conf:     DefaultConfig(),
		isClient: true,
		buf:      buf,
		recvQ:    client[1],
		streams:  make(map[uint32]*Stream),
		closed:   make(chan struct{}),
	}
	s.cons.init(time.Millisecond)
	half := len(mem) / 2
	return s, &pollPeer{send: server[1], buf: peerBuf, flag: (*uint32)(unsafe.Pointer(&mem[half+queueFlagOff]))}
}

// data publishes a one-slice message for stream id.
func (p *pollPeer) data(t *testing.T, id uint32) {
	t.Helper()
	li, off, err := p.buf.alloc(4, false, false)
	if err != nil || li < 0 {
		t.Fatalf("alloc: %d %v", li, err)
	}
	copy(p.buf.sliceData(li, off), "data")
	p.buf.linkSlice(off, 4, 0)
	p.put(t, queueElem{id: id, offset: off, status: statusOpened})
}

func (p *pollPeer) put(t *testing.T, e queueElem) {
	t.Helper()
	if ok, err := p.send.put(e); !ok || err != nil {
		t.Fatalf("put %+v: %v %v", e, ok, err)
	}
}

func (p *pollPeer) working() bool { return atomic.LoadUint32(p.flag) != 0 }

// TestConsumerSpinBudget: a spin that finds nothing halves the next one,
// down to none under a microsecond; a spin that finds something, or a
// wake-up soon after the last poller stopped, restores the full budget.
func TestConsumerSpinBudget(t *testing.T) {
	const full = 100 * time.Microsecond
	var c consumer
	c.init(full)
	budget := func() time.Duration { return time.Duration(c.budget.Load()) }
	if budget() != full {
		t.Fatalf("initial budget %v, want %v", budget(), full)
	}
	want := full
	for want >= time.Microsecond {
		c.miss()
		if want /= 2; want < time.Microsecond {
			want = 0
		}
		if budget() != want {
			t.Fatalf("budget %v after a miss, want %v", budget(), want)
		}
	}
	c.hit()
	if budget() != full {
		t.Errorf("budget %v after a hit, want %v", budget(), full)
	}

	c.miss()
	c.slept.Store(time.Now().Add(-10 * full).UnixNano())
	c.woken()
	if budget() != full/2 {
		t.Errorf("budget %v after a wake-up long after the last poller stopped, want %v", budget(), full/2)
	}
	c.slept.Store(time.Now().UnixNano())
	c.woken()
	if budget() != full {
		t.Errorf("budget %v after a wake-up that spinning would have caught, want %v", budget(), full)
	}
}

// TestSpinGovernorSlots: at most half the CPUs spin for sessions with
// another process, every CPU when the peer is this process, none on one
// CPU; a slot given back can be taken again.
func TestSpinGovernorSlots(t *testing.T) {
	for _, tc := range []struct{ cpus, remote, local int }{{1, 0, 0}, {2, 1, 2}, {4, 2, 4}, {5, 2, 5}} {
		t.Run(fmt.Sprint(tc.cpus, " CPUs"), func(t *testing.T) {
			g := newSpinGovernor(tc.cpus)
			count := func(local bool) int {
				n := 0
				for g.enter(local) {
					n++
				}
				return n
			}
			if n := count(false); n != tc.remote {
				t.Errorf("%d spinners for another process, want %d", n, tc.remote)
			}
			if n := count(true); n != tc.local-tc.remote {
				t.Errorf("%d more spinners for this process once the others spin, want %d", n, tc.local-tc.remote)
			}
			for range tc.local {
				g.exit()
			}
			if tc.remote > 0 && !g.enter(false) {
				t.Error("no slot after every spinner left")
			}
		})
	}
}

// TestSpinGovernorCooldown: pressure stops all spinning for a cool-down. A
// spinner that loses its core again right after each cool-down (an
// oversubscribed CPU) doubles it, up to a limit; one that loses it only now
// and then (another thread had a slice to run) pauses for the shortest; and
// after a calm spell the cool-down starts short again.
func TestSpinGovernorCooldown(t *testing.T) {
	g := newSpinGovernor(4)
	now := time.Now()
	off := func() time.Duration { return time.Duration(g.offUntil.Load() - now.UnixNano()) }
	g.pressure(now.Add(-time.Millisecond), now)
	if g.enter(false) || g.enter(true) || g.free(false) {
		t.Fatal("a spinner entered, or a slot looked free, during the cool-down")
	}
	want := minSpinCooldown
	for range 12 {
		if off() != want {
			t.Fatalf("cool-down %v, want %v", off(), want)
		}
		// The first spin after the cool-down loses its core at once, and
		// notices 2 ms later.
		since := time.Unix(0, g.lastEnd.Load()).Add(10 * time.Microsecond)
		now = since.Add(2 * time.Millisecond)
		g.pressure(since, now)
		want = min(2*want, maxSpinCooldown)
	}
	if want != maxSpinCooldown {
		t.Fatalf("the test did not reach the limit: %v", want)
	}
	now = time.Unix(0, g.lastEnd.Load()).Add(4*maxSpinCooldown + time.Millisecond)
	g.pressure(now.Add(-time.Millisecond), now)
	if off() != minSpinCooldown {
		t.Errorf("cool-down %v after a calm spell, want %v", off(), minSpinCooldown)
	}
	for i := range 5 {
		now = time.Unix(0, g.lastEnd.Load()).Add(100 * time.Millisecond)
		g.pressure(now.Add(-time.Millisecond), now)
		if off() != minSpinCooldown {
			t.Errorf("occasional pressure %d: cool-down %v, want %v", i, off(), minSpinCooldown)
		}
	}

	past := newSpinGovernor(4)
	past.pressure(time.Now().Add(-3*minSpinCooldown), time.Now().Add(-2*minSpinCooldown))
	if !past.free(false) || !past.enter(false) {
		t.Error("no spinning after the cool-down ended")
	}

	// A cool-down ends by itself, without a spinner asking for the time.
	live := newSpinGovernor(4)
	start := time.Now()
	live.pressure(start.Add(-time.Millisecond), start)
	if live.free(false) && time.Since(start) < minSpinCooldown {
		t.Fatal("a slot looked free right after the pressure")
	}
	waitUntil(t, "spinning resumes after the cool-down", 5*time.Second, func() bool { return live.free(false) })
	if !live.enter(false) {
		t.Error("no slot once the cool-down ended")
	}
}

// TestPollingWorkingFlag: the working flag stays set while any poller
// polls; the last one to stop clears it and looks once more, so that an
// element published meanwhile keeps it polling instead of being missed.
func TestPollingWorkingFlag(t *testing.T) {
	s, peer := newPollSession(t)
	s.startPolling()
	s.startPolling()
	if !peer.working() {
		t.Fatal("the flag is clear while two goroutines poll")
	}
	if !s.stopPolling() || !peer.working() {
		t.Fatal("the first of two pollers cleared the flag or did not stop")
	}
	if !s.stopPolling() || peer.working() {
		t.Fatal("the last poller left the flag set or did not stop with an empty queue")
	}
	if !peer.send.markWorking() {
		t.Fatal("the peer cannot tell that a wake-up is due")
	}

	s.startPolling()
	peer.data(t, 3) // published while the flag is set: no wake-up comes
	if s.stopPolling() {
		t.Fatal("the last poller stopped with an element in the queue and no wake-up coming")
	}
	if !peer.working() || s.cons.pollers.Load() != 1 {
		t.Fatalf("after the second look: flag %v, %d pollers; want set, 1", peer.working(), s.cons.pollers.Load())
	}
	if n, _, err := s.tryDrain(); n != 1 || err != nil {
		t.Fatalf("tryDrain: %d, %v", n, err)
	}
	if !s.stopPolling() || peer.working() {
		t.Error("the poller did not stop once the queue was empty")
	}
}

// TestTryDrainTurns: a reader drains only when nobody else holds the token,
// no close is pending, and stops before a close element, which only the
// receive loop applies; after sealConsumer nothing is drained.
func TestTryDrainTurns(t *testing.T) {
	t.Run("token held", func(t *testing.T) {
		s, peer := newPollSession(t)
		peer.data(t, 3)
		s.cons.token.Store(true)
		if n, closeAhead, err := s.tryDrain(); n != 0 || closeAhead || err != nil {
			t.Errorf("tryDrain while another holds the token: %d %v %v", n, closeAhead, err)
		}
		if s.recvQ.isEmpty() {
			t.Error("an element was taken without the token")
		}
		s.cons.token.Store(false)
		if n, _, err := s.tryDrain(); n != 1 || err != nil || !s.recvQ.isEmpty() {
			t.Errorf("tryDrain with the token free: %d %v", n, err)
		}
	})
	t.Run("close pending", func(t *testing.T) {
		s, peer := newPollSession(t)
		peer.data(t, 3)
		s.closesPending.Store(true)
		if n, closeAhead, err := s.tryDrain(); n != 0 || !closeAhead || err != nil || s.recvQ.isEmpty() {
			t.Errorf("tryDrain behind a pending close: %d %v %v; want 0, close ahead, nothing taken", n, closeAhead, err)
		}
	})
	t.Run("stops before a close", func(t *testing.T) {
		s, peer := newPollSession(t)
		free := peer.buf.freeCounts()[0]
		peer.data(t, 3)
		peer.data(t, 5)
		peer.put(t, queueElem{id: 3, status: statusClosed})
		peer.data(t, 5)
		n, closeAhead, err := s.tryDrain()
		if n != 2 || !closeAhead || err != nil {
			t.Fatalf("tryDrain: %d %v %v; want 2 elements, then the close ahead", n, closeAhead, err)
		}
		if e, ok, _ := s.recvQ.peek(); !ok || e.status != statusClosed || e.id != 3 {
			t.Errorf("next element %+v %v, want the close of stream 3", e, ok)
		}
		if got := peer.buf.freeCounts()[0]; got != free-1 {
			t.Errorf("free count %d, want %d: the two messages for unknown streams are freed, the third waits", got, free-1)
		}
		if s.cons.token.Load() {
			t.Error("tryDrain kept the token")
		}
	})
	t.Run("error", func(t *testing.T) {
		s, peer := newPollSession(t)
		peer.put(t, queueElem{id: 0, status: statusOpened})
		if _, _, err := s.tryDrain(); !errors.Is(err, ErrProtocol) {
			t.Errorf("tryDrain of an element for stream 0: %v, want ErrProtocol", err)
		}
		if s.cons.token.Load() {
			t.Error("tryDrain kept the token after an error")
		}
	})
	t.Run("sealed", func(t *testing.T) {
		s, peer := newPollSession(t)
		s.sealConsumer()
		peer.data(t, 3)
		if n, _, err := s.tryDrain(); n != 0 || err != nil || s.recvQ.isEmpty() {
			t.Errorf("tryDrain after sealConsumer: %d %v", n, err)
		}
	})
}

// TestDrainBeforeIgnoresPendingClose: a frame on the socket is handled only
// after everything published before it, even behind a pending close.
func TestDrainBeforeIgnoresPendingClose(t *testing.T) {
	s, peer := newPollSession(t)
	peer.data(t, 3)
	peer.data(t, 5)
	s.closesPending.Store(true)
	if err := s.drainBefore(); err != nil {
		t.Fatal(err)
	}
	if !s.recvQ.isEmpty() {
		t.Error("drainBefore left elements in the queue behind a pending close")
	}
	if n, paused, err := s.drainAll(); n != 0 || !paused || err != nil {
		t.Errorf("drainAll behind a pending close: %d %v %v; want paused", n, paused, err)
	}
}

// TestTurnDue: readers of a session whose peer is this process take turns
// at polling by stream id, one slice of time each. Alone, a reader may
// always poll; with n waiting, every id in a run of consecutive ids has
// exactly one turn in each cycle of slices, and both ends of a stream,
// which share its id and the clock, agree.
func TestTurnDue(t *testing.T) {
	at := func(slice int) time.Time { return time.Unix(0, int64(slice)*int64(pollTurnSlice)) }
	for _, id := range []uint32{1, 2, 77} {
		for slice := range 5 {
			if !turnDue(id, 1, at(slice)) || !turnDue(id, 0, at(slice)) {
				t.Fatalf("stream %d waiting alone may not poll in slice %d", id, slice)
			}
		}
	}
	for _, tc := range []struct {
		contenders int32
		ids        int // ids 101, 102, …: a run of streams opened one after the other
		groups     int // slices in a cycle
		perSlice   int // most streams due in one slice
	}{
		{2, 2, 2, 1}, {8, 8, 8, 1}, {5, 5, 8, 1}, {64, 64, 64, 1}, {1000, 128, maxTurnGroups, 2},
	} {
		turns := make(map[uint32]int)
		for slice := range tc.groups {
			due := 0
			for i := range tc.ids {
				id := uint32(101 + i)
				if turnDue(id, tc.contenders, at(1000+slice)) {
					due++
					turns[id]++
				}
			}
			if due > tc.perSlice {
				t.Errorf("%d waiting: %d streams due in one slice, want at most %d", tc.contenders, due, tc.perSlice)
			}
		}
		for i := range tc.ids {
			if id := uint32(101 + i); turns[id] != 1 {
				t.Errorf("%d waiting: stream %d had %d turns in a cycle of %d slices, want 1", tc.contenders, id, turns[id], tc.groups)
			}
		}
	}
}

// TestPollTurnCrossProcess: with the peer in another process, a reader
// awaiting a reply polls only while no other reader of its session sleeps;
// once one does, the receive loop harvests for all of them.
func TestPollTurnCrossProcess(t *testing.T) {
	s := &Session{}
	st := &Stream{s: s, id: 3}
	if !st.pollTurn() {
		t.Error("a lone reader may not poll")
	}
	for _, n := range []int32{1, 7, 63} {
		s.sleepers.Store(n)
		if st.pollTurn() {
			t.Errorf("a reader polls while %d others of its session sleep", n)
		}
	}
	s.sleepers.Store(0)
	if !st.pollTurn() {
		t.Error("a reader may not poll once the others are served")
	}
}

// withOneProcessor runs the rest of the test with GOMAXPROCS 1, which the
// spinners know at once.
func withOneProcessor(t *testing.T) {
	prev := runtime.GOMAXPROCS(1)
	procs.read(time.Now())
	t.Cleanup(func() {
		runtime.GOMAXPROCS(prev)
		procs.read(time.Now())
	})
}

// staleProcs makes the cached GOMAXPROCS out of date (2, read long ago),
// so that the next spin must read it again.
func staleProcs() {
	procs.n.Store(2)
	procs.at.Store(0)
}

// TestSpinReaderLetsReadiedGoroutinesRun: in a process with a single
// processor a reader that starts polling first lets the goroutines it has
// just readied run (they are often what it waits for); with more
// processors it does not yield.
func TestSpinReaderLetsReadiedGoroutinesRun(t *testing.T) {
	withOneProcessor(t)
	if !procs.alone(time.Now()) {
		t.Fatal("procs.alone() = false with GOMAXPROCS 1")
	}
	// Gosched lets the goroutines of the processor's queue run first,
	// except when the scheduler's periodic look at the global queue (one
	// schedule in 61) finds the yielding goroutine there first.
	const rounds = 40
	ranFirst := 0
	for range rounds {
		ready := make(chan struct{})
		var ran atomic.Bool
		done := make(chan struct{})
		go func() {
			<-ready
			ran.Store(true)
			close(done)
		}()
		runtime.Gosched() // let it block on ready
		close(ready)      // readies it on this processor, which this goroutine holds
		staleProcs()      // as if the program had set GOMAXPROCS after the last spin
		var w spinWatch
		w.startReader(&Session{}) // a peer in another process
		if ran.Load() {
			ranFirst++
		}
		<-done
	}
	if ranFirst < rounds/2 {
		t.Fatalf("the goroutine readied before the spin had run when the spin began in %d of %d rounds", ranFirst, rounds)
	}

	runtime.GOMAXPROCS(2)
	procs.read(time.Now())
	if procs.alone(time.Now()) {
		t.Fatal("procs.alone() = true with GOMAXPROCS 2")
	}
}

// TestSpinSharesProcessorWithLocalPeer: in a process with a single
// processor, a reader polling a session whose peer is this process lets
// the peer's goroutines run between its looks, so what it waits for comes
// within its spin. Here the peer needs 200 turns on the processor before it
// answers; a spinner that yielded only every yieldEvery (1 ms) ran out of
// its 50 ms budget first.
func TestSpinSharesProcessorWithLocalPeer(t *testing.T) {
	withOneProcessor(t)
	s, _ := newPollSession(t)
	s.localPeer = true
	s.cons.init(50 * time.Millisecond)
	ready := make(chan struct{}, 1)
	go func() {
		for range 200 {
			runtime.Gosched()
		}
		ready <- struct{}{}
	}()
	if got, _, _ := s.spinReader(ready); !got {
		t.Fatal("the spin ended before the peer in this process, which needed the processor 200 times, had answered")
	}
}

// TestPollTurnOneProcessor: with the peer in this process and a single
// processor, a reader polls only while it waits alone; once others wait
// too, all of them sleep and the two sessions' receive loops harvest for
// them. (8 streams took 7.9 µs per round trip with the time slices, 1.75
// µs without; a Unix socket 3.0 µs.)
func TestPollTurnOneProcessor(t *testing.T) {
	withOneProcessor(t)
	staleProcs()
	s := &Session{localPeer: true}
	st := &Stream{s: s, id: 3}
	s.contenders.Store(1)
	if !st.pollTurn() {
		t.Error("a lone reader may not poll")
	}
	for _, n := range []int32{2, 8, 64} {
		s.contenders.Store(n)
		for range 3 { // whatever the time slice
			if st.pollTurn() {
				t.Errorf("a reader polls while %d wait, with one processor", n)
			}
			time.Sleep(pollTurnSlice)
		}
	}
}

// TestSpinParksWhileLocalWakeInFlight: with one processor and the peer in
// this process, a reader spinning while a wake-up between two sessions of
// this process is on its way parks, so that the scheduler polls the network
// and delivers the wake-up (here a byte on a Unix socket, whose reader
// plays the peer's receive loop and then answers). A reader that went on
// yielding kept the goroutine blocked on the socket from running and ran
// out of its 5 ms budget (the runtime's monitor polls the network only
// 10 ms after the scheduler last did).
func TestSpinParksWhileLocalWakeInFlight(t *testing.T) {
	withOneProcessor(t)
	s, _ := newPollSession(t)
	s.localPeer = true
	// Descheduled by a loaded machine for more than preemptedGap, or past
	// localWakeStale, a spinner gives up by design: only a spinner that
	// misses the answer in every one of a few tries fails.
	for try := 1; ; try++ {
		s.cons.init(5 * time.Millisecond)
		a, b := unixPair(t)
		ready := make(chan struct{}, 1)
		go func() {
			buf := make([]byte, 1)
			if _, err := io.ReadFull(b, buf); err != nil {
				return
			}
			localWakes.received()
			ready <- struct{}{}
		}()
		time.Sleep(time.Millisecond) // the reader blocks; the scheduler has just polled the network
		localWakes.sent.Store(time.Now().UnixNano())
		if _, err := a.Write([]byte{1}); err != nil {
			t.Fatal(err)
		}
		if got, _, _ := s.spinReader(ready); got {
			break
		}
		if try == 5 {
			t.Fatal("the spin ended without the answer of the peer whose wake-up was on its way, in 5 tries")
		}
		<-ready // the answer, after the spin
		t.Logf("try %d: the spin ended without the answer", try)
	}
	if localWakes.pending() {
		t.Error("a wake-up is still pending after it arrived")
	}
}

// TestLocalWakeTakenForLost: a wake-up between two sessions of this process
// that has not arrived after localWakeStale (its session ended, or the peer
// is not a Session) no longer holds spinners back.
func TestLocalWakeTakenForLost(t *testing.T) {
	now := time.Now().UnixNano()
	localWakes.got.Store(now - int64(time.Hour))
	localWakes.sent.Store(now)
	if !localWakes.pending() {
		t.Error("a wake-up sent just now is not pending")
	}
	localWakes.sent.Store(now - 2*int64(localWakeStale))
	if localWakes.pending() {
		t.Errorf("a wake-up sent %v ago, never received, still holds spinners back", 2*localWakeStale)
	}
	localWakes.received()
	if localWakes.pending() {
		t.Error("a wake-up is pending after one arrived")
	}
}

// paired runs the rest of the test with sessions of this process paired,
// also in a run that leaves them unpaired (SHMIPC_TEST_UNPAIRED).
func paired(t *testing.T) {
	if !noLocalPairs.Swap(false) {
		return
	}
	t.Cleanup(func() { noLocalPairs.Store(true) })
}

// dialPairedEcho starts an echo listener and dials it with conf, and
// returns the client's session and the server's once the two are paired.
func dialPairedEcho(t *testing.T, conf *Config) (c, srv *Session) {
	t.Helper()
	c, srv = dialListenerSession(t, startEchoListener(t, conf), conf)
	waitUntil(t, "the sessions are paired", peerTimeout, func() bool {
		return c.localPeerSession.Load() == srv && srv.localPeerSession.Load() == c
	})
	return c, srv
}

// Two sessions of this process connected to each other are paired and
// deliver to each other without the socket: nearly every request is handed
// over by the writer (deliverDirect, counted as a wake-up saved), the
// server's socket carries none of them, and nobody polls, spinning allowed
// or not.
func TestLocalPairWakesWithoutSocket(t *testing.T) {
	paired(t)
	for _, spin := range []time.Duration{0, DefaultConfig().ConsumerSpinTime} {
		conf := DefaultConfig()
		conf.ConsumerSpinTime = spin
		c, srv := dialPairedEcho(t, conf)
		st, err := c.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		st.SetDeadline(time.Now().Add(20 * time.Second))
		const rounds = 50
		got := make([]byte, 5)
		saved := c.Stats().WakeupsSaved
		for i := range rounds {
			msg := fmt.Appendf(nil, "m%04d", i)
			if _, err := st.Write(msg); err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadFull(st, got); err != nil || string(got) != string(msg) {
				t.Fatalf("spin %v, round trip %d: %q, %v", spin, i, got, err)
			}
			if i%2 == 0 {
				time.Sleep(200 * time.Microsecond)
			}
		}
		// Not quite every time: the server's receive loop may be draining
		// when a request comes (it applies the close of the stream the
		// pair was checked with), and then the request goes on the queue.
		if n := c.Stats().WakeupsSaved - saved; n < rounds*4/5 {
			t.Fatalf("spin %v: the writer handed %d of %d requests over itself; want nearly every one", spin, n, rounds)
		}
		if n := c.cons.pollers.Load() + srv.cons.pollers.Load(); n != 0 {
			t.Fatalf("spin %v: %d goroutines poll the queues between round trips", spin, n)
		}
		st.Close()
		c.Close()
		<-srv.loopDone // what the receive loop read, now without a race
		if n := srv.ec.read; n >= rounds/2*wire.HeaderSize {
			t.Errorf("spin %v: the server's socket carried %d bytes after the handshake in %d round trips; want fewer than half the wake-ups' frames", spin, n, rounds)
		}
	}
}

// A paired peer that publishes messages and closes its session at once:
// every byte is read, then the session's end.
func TestLocalPairPeerClosesAfterWrites(t *testing.T) {
	paired(t)
	conf := DefaultConfig()
	conf.ConsumerSpinTime = 0
	ln, err := Listen("unix", sockPath(t), conf)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	for round := range 30 {
		c, err := Dial("unix", ln.Addr().String(), conf)
		if err != nil {
			t.Fatal(err)
		}
		st, err := c.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Write([]byte("go")); err != nil {
			t.Fatal(err)
		}
		srv := acceptWithin(t, ln, peerTimeout)
		if _, err := io.ReadFull(srv, make([]byte, 2)); err != nil {
			t.Fatal(err)
		}
		want := make([]byte, 0, 3*1000)
		for i := range 3 {
			msg := bytes.Repeat([]byte{byte('a' + i)}, 1000)
			if _, err := srv.Write(msg); err != nil {
				t.Fatal(err)
			}
			want = append(want, msg...)
		}
		if err := srv.Session().Close(); err != nil {
			t.Fatal(err)
		}
		st.SetReadDeadline(time.Now().Add(peerTimeout))
		got, err := io.ReadAll(st)
		if !bytes.Equal(got, want) {
			t.Fatalf("round %d: read %d of %d bytes before %v", round, len(got), len(want), err)
		}
		c.Close()
	}
}

// A writer of a paired session hands a message over directly only when
// nothing published before is still to take effect. While the peer's
// consumer token is held (a consumer may be handling an element it took),
// messages go on the queue, and the next ones follow them there until
// they have been handled, so the peer gets them in order; once the queue
// is empty again, messages are handed over.
func TestDirectHandOverKeepsOrder(t *testing.T) {
	paired(t)
	c, srv := dialPairedEcho(t, DefaultConfig())
	st, err := c.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	roundTrip := func(msg string) {
		t.Helper()
		st.SetDeadline(time.Now().Add(peerTimeout))
		if _, err := st.Write([]byte(msg)); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(msg))
		if _, err := io.ReadFull(st, got); err != nil || string(got) != msg {
			t.Fatalf("echo of %q: %q, %v", msg, got, err)
		}
	}
	roundTrip("first")

	waitUntil(t, "the server's consumer token is free", peerTimeout, func() bool {
		return srv.cons.token.CompareAndSwap(false, true)
	})
	for _, m := range []string{"m1", "m2"} {
		if _, err := st.Write([]byte(m)); err != nil {
			t.Fatal(err)
		}
	}
	if d := srv.recvQ.depth(); d != 2 {
		t.Fatalf("with the token held, %d messages on the server's queue; want both", d)
	}
	st.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if n, err := st.Read(make([]byte, 4)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("with the token held, a read returned %d bytes, %v; want a timeout", n, err)
	}
	srv.cons.token.Store(false)
	srv.kick()
	st.SetReadDeadline(time.Now().Add(peerTimeout))
	got := make([]byte, 4)
	if _, err := io.ReadFull(st, got); err != nil || string(got) != "m1m2" {
		t.Fatalf("after the token was let go: %q, %v; want \"m1m2\"", got, err)
	}
	// Handed over again (the request's queue does not move): the receive
	// loop, kicked, may still hold the token for a moment, so a few round
	// trips are allowed for it.
	waitUntil(t, "the server's queue is empty", peerTimeout, func() bool { return srv.recvQ.depth() == 0 })
	handed := false
	for i := 0; i < 20 && !handed; i++ {
		tail := atomic.LoadInt64(srv.recvQ.tail) // moves only when a request is published
		roundTrip(fmt.Sprintf("n%02d", i))
		handed = atomic.LoadInt64(srv.recvQ.tail) == tail
	}
	if !handed {
		t.Error("no message was handed over directly in 20 round trips after the queue emptied")
	}
}

package shmipc

import (
	"bytes"
	"fmt"
	"io"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/goshm/shmipc/internal/shm"
)

// Unit tests of consuming (consume.go, spin.go): the spin budget of one
// session, the process-wide spin governor, and the working flag, on a
// client session whose regions live in Go memory and that has no
// connection.

// pollPeer is the far side of a pollSession: it produces into the session's
// receive queue and allocates in the shared buffer region.
type pollPeer struct {
	send *shm.Queue
	buf  *shm.Buffer
	flag *uint32 // the working flag of the session's receive queue
}

// newPollSession returns a client session with only what receiving needs:
// its receive queue and buffer region, and no streams, so that every data
// element it takes is freed (docs/protocol.md §9.2).
func newPollSession(t *testing.T) (*Session, *pollPeer) {
	t.Helper()
	// The regions in Go memory, 8-byte aligned as a mapping is, each
	// mapped twice, as the two processes of a session do.
	mem := unsafe.Slice((*byte)(unsafe.Pointer(&make([]uint64, shm.QueueRegionSize(16)/8)[0])), shm.QueueRegionSize(16))
	shm.InitQueues(mem, 16)
	_, client := mustMapQueues(t, mem)
	_, server := mustMapQueues(t, mem)
	plans := []shm.ListPlan{{SliceCap: 64, Count: 16}}
	bufMem := make([]byte, bufferRegionSize(plans))
	shm.InitBuffer(bufMem, plans)
	buf, peerBuf := mustBuffer(t, bufMem, true), mustBuffer(t, bufMem, false)
	s := &Session{
		conf:     DefaultConfig(),
		isClient: true,
		buf:      buf,
		recvQ:    client,
		streams:  make(map[uint32]*Stream),
		closed:   make(chan struct{}),
	}
	s.cons.init(time.Millisecond)
	half := len(mem) / 2
	return s, &pollPeer{send: server, buf: peerBuf, flag: (*uint32)(unsafe.Pointer(&mem[half+queueFlagOff]))}
}

// data publishes a one-slice message for stream id.
func (p *pollPeer) data(t *testing.T, id uint32) {
	t.Helper()
	li, off, err := p.buf.Alloc(4, false, false)
	if err != nil || li < 0 {
		t.Fatalf("alloc: %d %v", li, err)
	}
	copy(p.buf.SliceData(li, off), "data")
	p.buf.LinkSlice(off, 4, 0)
	p.put(t, shm.Elem{ID: id, Offset: off, Status: shm.StatusOpened})
}

func (p *pollPeer) put(t *testing.T, e shm.Elem) {
	t.Helper()
	if ok, err := p.send.Put(e); !ok || err != nil {
		t.Fatalf("put %+v: %v %v", e, ok, err)
	}
}

func (p *pollPeer) working() bool { return atomic.LoadUint32(p.flag) != 0 }

// TestConsumerSpinBudget: a spin that finds nothing halves the next one,
// down to none under a microsecond; a spin that finds something, or a
// wake-up soon after the loop stopped consuming, restores the full budget.
func TestConsumerSpinBudget(t *testing.T) {
	const full = 100 * time.Microsecond
	var c consumer
	c.init(full)
	budget := func() time.Duration { return time.Duration(c.budget) }
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
	c.slept = time.Now().Add(-10 * full).UnixNano()
	c.woken()
	if budget() != full/2 {
		t.Errorf("budget %v after a wake-up long after the loop slept, want %v", budget(), full/2)
	}
	c.slept = time.Now().UnixNano()
	c.woken()
	if budget() != full {
		t.Errorf("budget %v after a wake-up that spinning would have caught, want %v", budget(), full)
	}
}

// TestSpinGovernorSlots: as many spinners as the governor has slots; a
// slot given back can be taken again.
func TestSpinGovernorSlots(t *testing.T) {
	for _, slots := range []int{0, 1, 2} {
		t.Run(fmt.Sprint(slots, " slots"), func(t *testing.T) {
			g := newSpinGovernor(slots)
			n := 0
			for g.enter() {
				n++
			}
			if n != slots {
				t.Errorf("%d spinners, want %d", n, slots)
			}
			for range n {
				g.exit()
			}
			if slots > 0 && !g.enter() {
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
	g := newSpinGovernor(2)
	now := time.Now()
	off := func() time.Duration { return time.Duration(g.offUntil.Load() - now.UnixNano()) }
	g.pressure(now.Add(-time.Millisecond), now)
	if g.enter() || g.free() {
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

	past := newSpinGovernor(2)
	past.pressure(time.Now().Add(-3*minSpinCooldown), time.Now().Add(-2*minSpinCooldown))
	if !past.free() || !past.enter() {
		t.Error("no spinning after the cool-down ended")
	}

	// A cool-down ends by itself, without a spinner asking for the time.
	live := newSpinGovernor(2)
	start := time.Now()
	live.pressure(start.Add(-time.Millisecond), start)
	if live.free() && time.Since(start) < minSpinCooldown {
		t.Fatal("a slot looked free right after the pressure")
	}
	waitUntil(t, "spinning resumes after the cool-down", 5*time.Second, func() bool { return live.free() })
	if !live.enter() {
		t.Error("no slot once the cool-down ended")
	}
}

// TestConsumeWorkingFlag: consume sets the working flag while it drains
// and clears it when the queue is empty, and the peer can then tell that
// a wake-up is due; an element published while the flag is set is taken
// by the same consume, not left for a wake-up that will not come.
func TestConsumeWorkingFlag(t *testing.T) {
	s, peer := newPollSession(t)
	s.cons.init(0) // no spinning: the flag's rule alone
	peer.data(t, 3)
	if err := s.consume(); err != nil {
		t.Fatal(err)
	}
	if peer.working() || s.cons.consuming {
		t.Fatal("consume left the flag set with an empty queue")
	}
	if !s.recvQ.IsEmpty() {
		t.Fatal("consume left an element in the queue")
	}
	if !peer.send.MarkWorking() {
		t.Fatal("the peer cannot tell that a wake-up is due")
	}
	if err := s.consume(); err != nil { // the flag is set: the loop was woken
		t.Fatal(err)
	}
	if peer.working() {
		t.Fatal("the flag stays set after a consume that found nothing")
	}
}

// TestDrainBeforeIgnoresPendingClose: a frame on the socket is handled only
// after everything published before it, even behind a pending close.
func TestDrainBeforeIgnoresPendingClose(t *testing.T) {
	s, peer := newPollSession(t)
	peer.data(t, 3)
	peer.data(t, 5)
	s.closing = append(s.closing, pendingClose{id: 7, at: 1 << 40})
	if n, paused, err := s.drain(drainInOrder, noDrainLimit); n != 0 || !paused || err != nil {
		t.Errorf("drain behind a pending close: %d %v %v; want paused", n, paused, err)
	}
	if err := s.drainBefore(); err != nil {
		t.Fatal(err)
	}
	if !s.recvQ.IsEmpty() {
		t.Error("drainBefore left elements in the queue behind a pending close")
	}
}

// TestLoopRestsWhileReaderBusy: once its only reader has its reply and is
// busy with it, nothing of the session spins, however long its spin
// budget: neither the loop nor a reader; the reader polls again once it
// waits.
func TestLoopRestsWhileReaderBusy(t *testing.T) {
	conf := DefaultConfig()
	conf.ShareMemoryPathPrefix = shmPrefix(t, "rest")
	s := spinningClient(t, conf)
	st, err := s.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	st.SetDeadline(time.Now().Add(5 * peerTimeout))
	const idle = 0 // spinningClient
	for range 50 {
		if _, err := st.Write([]byte("ping")); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(st, make([]byte, 4)); err != nil {
			t.Fatal(err)
		}
	}
	// The reader is busy (it does not read again): the loop must rest.
	waitUntil(t, "the receive loop stops spinning while its reader is busy", time.Second, func() bool { return spinning.active.Load() == idle })
	time.Sleep(20 * time.Millisecond)
	if n := spinning.active.Load(); n != idle {
		t.Fatalf("%d spinners while the only reader is busy, want %d", n, idle)
	}
	read := readerSpunFor(t, st, idle)
	if _, err := st.Write([]byte("pong")); err != nil {
		t.Fatal(err)
	}
	if err := <-read; err != nil {
		t.Fatal(err)
	}
}

// spinningClient dials an echo server with conf, whose readers poll for
// 10 s (ConsumerSpinTime), and leaves the process's spinning slots to the
// client; it skips the test where nothing spins. It returns once nothing
// of the process spins (sessions of earlier tests may, for their last spin
// budget), so that the caller can tell the client's spin by
// spinning.active; on one processor the client's reader needs the only
// slot.
func spinningClient(t *testing.T, conf *Config) *Session {
	t.Helper()
	if procs.read(time.Now()); spinning.slots.Load() == 0 {
		t.Skip("nothing spins on a single CPU (spinGovernor)")
	}
	conf.ConsumerSpinTime = 10 * time.Second
	srvConf := *conf
	srvConf.ConsumerSpinTime = 0
	ln, err := Listen("unix", sockPath(t), &srvConf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go serveStreams(ln, echoStream)
	s, err := Dial("unix", ln.Addr().String(), conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	waitUntil(t, "the spinners of earlier sessions stop", peerTimeout, func() bool { return spinning.active.Load() == 0 })
	return s
}

// readerSpunFor starts a reader of 4 bytes on st, a stream of a
// spinningClient's session to its echo server, and returns the reader's
// result once it polls the queue (one spinner more than idle). On a loaded machine spinning may be off for a cool-down
// (spinGovernor.pressure, at most maxSpinCooldown): then the reader is
// served with an echo and the attempt repeats.
func readerSpunFor(t *testing.T, st *Stream, idle int32) <-chan error {
	t.Helper()
	deadline := time.Now().Add(4 * peerTimeout)
	for {
		read := make(chan error, 1)
		go func() {
			_, err := io.ReadFull(st, make([]byte, 4))
			read <- err
		}()
		for until := time.Now().Add(maxSpinCooldown + 50*time.Millisecond); time.Now().Before(until); time.Sleep(time.Millisecond) {
			if spinning.active.Load() == idle+1 {
				return read
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the receive loop never spun for its waiting reader within %v", 4*peerTimeout)
		}
		if _, err := st.Write([]byte("ping")); err != nil {
			t.Fatal(err)
		}
		if err := <-read; err != nil {
			t.Fatal(err)
		}
	}
}

// receiveHold stops chosen sessions' receive loops at their next drain or
// frame read (consumeHook) until released.
var receiveHold struct {
	sync.Mutex
	held map[*Session]chan struct{}
}

// holdReceive stops s's receive loop at its next drain or frame read: what
// the peer publishes stays in the queue, and frames stay on the socket. It
// returns the function that lets the loop go on; the test's end calls it
// too.
func holdReceive(t testing.TB, s *Session) (release func()) {
	receiveHold.Lock()
	if receiveHold.held == nil {
		receiveHold.held = make(map[*Session]chan struct{})
		hook := func(s *Session, _ bool) {
			receiveHold.Lock()
			ch := receiveHold.held[s]
			receiveHold.Unlock()
			if ch != nil {
				<-ch
			}
		}
		consumeHook.Store(&hook)
	}
	ch := make(chan struct{})
	receiveHold.held[s] = ch
	receiveHold.Unlock()
	var once sync.Once
	release = func() {
		once.Do(func() {
			receiveHold.Lock()
			delete(receiveHold.held, s)
			receiveHold.Unlock()
			close(ch)
		})
	}
	t.Cleanup(release)
	return release
}

// goroutineID returns the id of the calling goroutine, from its stack's
// first line ("goroutine N [...").
func goroutineID() uint64 {
	var buf [64]byte
	b := buf[:runtime.Stack(buf[:], false)]
	b = bytes.TrimPrefix(b, []byte("goroutine "))
	if i := bytes.IndexByte(b, ' '); i > 0 {
		b = b[:i]
	}
	id, _ := strconv.ParseUint(string(b), 10, 64)
	return id
}

// mustMapQueues maps the queue region mem (shm.MapQueues).
func mustMapQueues(t *testing.T, mem []byte) (c2s, s2c *shm.Queue) {
	t.Helper()
	c2s, s2c, err := shm.MapQueues(mem)
	if err != nil {
		t.Fatal(err)
	}
	return c2s, s2c
}

// mustBuffer returns a manager of the buffer region in mem, the creator's
// view or the peer's.
func mustBuffer(t *testing.T, mem []byte, creator bool) *shm.Buffer {
	t.Helper()
	m, err := shm.NewBuffer(shm.RegionOf(mem), creator)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

package shmipc

// Hostile peers. A raw peer completes a correct handshake with a real
// shmipc Server (hostile client) or a real shmipc Client (hostile server),
// keeps its own mapping of the shared regions, and then corrupts them or
// sends bad frames. The victim must not panic or hang, must close the
// session with an error that wraps ErrProtocol (ErrHandshake for damage seen
// in the handshake) and names the problem, and another session in the same
// process must keep working. Cases where the protocol makes the damage
// harmless (docs/protocol.md §9.2, §9.3; fields the library reads once) assert
// that the session survives instead.

import (
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/shm"
)

// hpReader reads a victim client's stream until it fails.
type hpReader struct {
	data chan string
	err  chan error
}

func hpStartReader(st *Stream) *hpReader {
	r := &hpReader{data: make(chan string, 64), err: make(chan error, 1)}
	go func() {
		buf := make([]byte, 4096)
		for {
			n, err := st.Read(buf)
			if n > 0 {
				select {
				case r.data <- string(buf[:n]):
				default:
				}
			}
			if err != nil {
				r.err <- err
				return
			}
		}
	}()
	return r
}

// ---- cases ----

// hpCtx is what a case works with.
type hpCtx struct {
	t      *testing.T
	p      *rawPeer
	victim *Session
	id     uint32    // a stream open on both sides
	reader bool      // wake the victim as a well-behaved producer would
	armed  bool      // set up done: the damage follows
	st     *Stream   // hostile-server cases: the victim client's stream
	rd     *hpReader // and its reader
}

func (c *hpCtx) isServerVictim() bool { return c.st == nil }

// wake makes the victim look at its receive queue. In polling mode a
// Polling frame is always sent. In reader mode the peer behaves like a
// correct producer: it sends Polling only if it sets the working flag, so
// while a reader of the victim polls the queue the corruption must be found
// by that reader.
func (c *hpCtx) wake() {
	if !c.reader {
		c.p.poll()
		return
	}
	if c.p.send.casFlag() {
		if c.armed {
			c.t.Log("reader mode: the working flag was clear, sent a Polling frame")
		}
		c.p.poll()
	}
}

func (c *hpCtx) publish(id, off, status uint32) {
	c.p.send.put(id, off, status)
	c.wake()
}

// waitPolling waits a little for the victim's receive loop to set the
// working flag (it does while it consumes); if it does not, the case runs
// with the Polling frames a correct producer then sends.
func (c *hpCtx) waitPolling() {
	deadline := time.Now().Add(300 * time.Millisecond)
	for c.p.send.flag() == 0 {
		if time.Now().After(deadline) {
			c.t.Log("reader mode: no consumer polls the victim's queue")
			return
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// roundTrip sends data on the open stream and checks the victim got it: the
// server echoes it back; the client's reader receives it.
func (c *hpCtx) roundTrip(data string, status uint32) error {
	c.publish(c.id, c.p.msg(data), status)
	return c.expectData(c.id, data)
}

func (c *hpCtx) expectData(id uint32, data string) error {
	if c.isServerVictim() {
		e, err := c.p.waitElem()
		if err != nil {
			return err
		}
		if e.ID != id || e.Status != shm.StatusOpened {
			return fmt.Errorf("echo element %+v, want stream %d data", e, id)
		}
		got, err := c.p.readMsg(e.Offset)
		if err != nil {
			return fmt.Errorf("echo message: %w", err)
		}
		if got != data {
			return fmt.Errorf("echo %q, want %q", got, data)
		}
		return nil
	}
	select {
	case got := <-c.rd.data:
		if got != data {
			return fmt.Errorf("victim read %q, want %q", got, data)
		}
		return nil
	case err := <-c.rd.err:
		c.rd.err <- err
		return fmt.Errorf("victim read failed: %w", err)
	case <-time.After(peerTimeout):
		return fmt.Errorf("victim did not receive %q within %v", data, peerTimeout)
	}
}

// openPinged opens a stream of victim, a client whose server is the raw
// peer p, and sends "ping" on it, which p reads and frees.
func openPinged(t *testing.T, p *rawPeer, victim *Session) *Stream {
	t.Helper()
	st, err := victim.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	st.SetDeadline(time.Now().Add(3 * peerTimeout))
	if _, err := st.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	e, err := p.waitElem()
	if err != nil {
		t.Fatal(err)
	}
	if got, err := p.readMsg(e.Offset); err != nil || got != "ping" || e.ID != st.ID() {
		t.Fatalf("raw server got %+v %q %v, want stream %d \"ping\"", e, got, err, st.ID())
	}
	return st
}

// provokeSend makes the victim allocate from the smallest list and publish
// a message; corrupt runs just before the victim allocates. A stream keeps
// one slice it read for its next message (reuse.go), so the provocation
// makes sure the victim has none to use: the server's stream lets go of
// its kept slot before the damage (dropKept, as a closing stream does), and
// the client writes twice with nothing read in between.
func (c *hpCtx) provokeSend(corrupt func()) {
	if c.isServerVictim() {
		st := c.victim.lookup(c.id)
		if st == nil {
			c.t.Fatalf("the victim has no stream %d", c.id)
		}
		st.dropKept()
		off := c.p.msgIn(1, "boom") // allocated before the damage; the echo allocates after
		corrupt()
		c.publish(c.id, off, shm.StatusOpened)
		return
	}
	corrupt()
	for range 2 {
		if _, err := c.st.Write([]byte("boom")); err == nil {
			c.t.Log("victim Write succeeded")
		}
	}
}

// hpCase is one corruption: do damages and wakes the victim. Either the
// session must close with an error wrapping is (ErrProtocol when nil) and
// containing every want string, or survive checks the documented behaviour
// of a session that stays up.
type hpCase struct {
	name    string
	do      func(c *hpCtx)
	want    []string
	is      error
	survive func(c *hpCtx) error
}

func hpSurviveRoundTrip(c *hpCtx) error { return c.roundTrip("after the damage", 0) }

// hpFinish checks the outcome of a case.
func hpFinish(c *hpCtx, tc hpCase) {
	t := c.t
	t.Helper()
	if tc.survive != nil {
		if err := tc.survive(c); err != nil {
			t.Errorf("after the damage: %v", err)
		}
		if c.victim.IsClosed() {
			t.Errorf("the victim session closed: %v", c.victim.Err())
		}
	} else {
		expectClosedWith(t, c.victim, tc.is, tc.want)
		hpCheckReleased(c)
		if c.rd != nil {
			select {
			case err := <-c.rd.err:
				if err == nil {
					t.Error("the reader of the closed session returned no error")
				}
			case <-time.After(peerTimeout):
				t.Errorf("a reader of the closed session still blocks after %v", peerTimeout)
			}
		}
	}
	closeWithin(t, c.victim, peerTimeout)
	hpCheckReleased(c)
}

// hpCheckReleased checks that a closed victim lets go of its queue region
// soon: nothing may still be polling the queue. A goroutine stuck polling a
// corrupt queue is reported, then freed by making the queue look empty
// again, so that it does not spin for the rest of the run.
func hpCheckReleased(c *hpCtx) {
	t := c.t
	t.Helper()
	if !c.victim.IsClosed() {
		return
	}
	released := func(d time.Duration) bool {
		deadline := time.Now().Add(d)
		for refCount(c.victim.queueRegion) > 0 {
			if time.Now().After(deadline) {
				return false
			}
			time.Sleep(time.Millisecond)
		}
		return true
	}
	if released(1500 * time.Millisecond) {
		return
	}
	t.Errorf("BUG: the victim session is closed (%v) but 1.5s later its queue region is still referenced (%d): something still holds it on the corrupt queue", c.victim.Err(), refCount(c.victim.queueRegion))
	c.p.send.setTail(c.p.send.head()) // the victim's head, which it stores as it consumes
	if !released(peerTimeout) {
		t.Errorf("the queue region is still referenced after the queue was repaired")
	}
}

func hpWakeName(reader bool) string {
	if reader {
		return "reader polls"
	}
	return "Polling frame"
}

// ---- hostile client against a real server ----

// hpServerCase sets up a server victim with stream 2 open on both sides.
func hpServerCase(t *testing.T, env *testServer, mode MemMapType, reader bool) *hpCtx {
	t.Helper()
	p, victim := connectRawClient(t, env, mode)
	c := &hpCtx{t: t, p: p, victim: victim, id: 2, reader: reader}
	if err := c.roundTrip("hello", 0); err != nil {
		t.Fatalf("valid echo before the damage: %v", err)
	}
	if reader {
		c.waitPolling()
	}
	c.armed = true
	return c
}

// ---- hostile server against a real client ----

// hpClientCase sets up a client victim with one stream open on both sides
// and a reader blocked on it.
func hpClientCase(t *testing.T, mode MemMapType, reader bool) *hpCtx {
	t.Helper()
	spin := defaultConsumerSpinTime
	if reader {
		spin = readerSpin
	}
	p, victim := acceptRawVictim(t, mode, spin)
	st := openPinged(t, p, victim)
	c := &hpCtx{t: t, p: p, victim: victim, id: st.ID(), reader: reader, st: st}
	c.publish(c.id, p.msg("pong"), shm.StatusOpened)
	got := make([]byte, 4)
	if _, err := io.ReadFull(st, got); err != nil || string(got) != "pong" {
		t.Fatalf("victim read %q, %v; want \"pong\"", got, err)
	}
	c.rd = hpStartReader(st)
	if reader {
		c.waitPolling()
	}
	c.armed = true
	return c
}

// hpAgainstServer runs cases against a real server, woken by Polling frames
// in both modes and by a reader polling its queue.
func hpAgainstServer(t *testing.T, cases []hpCase) {
	for _, reader := range shortOr([]bool{false, true}, []bool{false}) {
		spin := defaultConsumerSpinTime
		if reader {
			spin = readerSpin
		}
		env := startTestServer(t, spin)
		for _, mode := range bothModes {
			if reader && mode != MemMapTypeMemFd {
				continue // the wake-up path does not depend on the mode
			}
			for _, tc := range cases {
				t.Run(modeName(mode)+"/"+hpWakeName(reader)+"/"+tc.name, func(t *testing.T) {
					c := hpServerCase(t, env, mode, reader)
					tc.do(c)
					hpFinish(c, tc)
					env.checkGood(t)
				})
			}
		}
	}
}

// hpAgainstClient runs cases against a real client, woken by Polling frames
// in both modes and by a reader polling its queue.
func hpAgainstClient(t *testing.T, cases []hpCase) {
	env := startTestServer(t, defaultConsumerSpinTime)
	for _, reader := range shortOr([]bool{false, true}, []bool{false}) {
		for _, mode := range bothModes {
			if reader && mode != MemMapTypeMemFd {
				continue // the wake-up path does not depend on the mode
			}
			for _, tc := range cases {
				t.Run(modeName(mode)+"/"+hpWakeName(reader)+"/"+tc.name, func(t *testing.T) {
					c := hpClientCase(t, mode, reader)
					tc.do(c)
					hpFinish(c, tc)
					env.checkGood(t)
				})
			}
		}
	}
}

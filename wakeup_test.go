package shmipc

// Wake-ups (wakeup.go): a Write never waits for its wake-up, and counts a
// message on the queue whatever became of the wake-up.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/shm"
)

// rawVictimOver is acceptRawVictimWith with the client's session made by
// dial on the raw server's socket.
func rawVictimOver(t *testing.T, mode MemMapType, dial func(sock string, conf *Config) (*Session, error), edit func(*Config)) (*rawPeer, *Session) {
	t.Helper()
	conf := peerConfig(t, mode, 0)
	if edit != nil {
		edit(conf)
	}
	ln, sock := listenRaw(t)
	ch := startHandshake(func() (*Session, error) { return dial(sock, conf) })
	c := acceptRaw(t, ln)
	buf, q, v := mapRawClient(t, c, mode)
	res := awaitHandshake(t, ch, peerTimeout)
	if res.err != nil {
		t.Fatalf("handshake: %v", res.err)
	}
	bm, err := shm.NewBuffer(shm.RegionOf(buf), false)
	if err != nil {
		t.Fatal(err)
	}
	half := len(q) / 2
	qcap := uint32((half - queueHeaderSize) / queueElemSize)
	return &rawPeer{
		t: t, conn: c, version: v, buf: buf, bm: bm, lists: rawLists(buf),
		send: rawQueue{mem: q[half:], cap: qcap},
		recv: rawQueue{mem: q[:half], cap: qcap},
	}, res.s
}

// fillSocket writes Polling frames into the session's socket, without
// waiting, until it is full, and returns how many went in.
func fillSocket(t *testing.T, s *Session) int {
	t.Helper()
	frame := rawFrame(8, rawMagic, s.version, 1)
	c := s.ec
	c.wmu.Lock()
	defer c.unlockW()
	n := 0
	for {
		w, err := c.tryWriteErr(frame)
		if err != nil {
			t.Fatal(err)
		}
		if w == 0 {
			return n
		}
		if w != len(frame) {
			t.Fatalf("a write of %d bytes of a Polling frame", w)
		}
		n++
	}
}

// TestWakeupDoesNotWaitForSocket: the peer has not read its socket, which
// is full, and its working flag is clear. A small Write, whose element
// needs a wake-up, returns at once with everything written, rather than
// waiting for room in the socket until ConnectionWriteTimeout; the
// wake-up is not lost: once the peer reads, it finds it after the frames
// before it, and the message on the queue.
func TestWakeupDoesNotWaitForSocket(t *testing.T) {
	const writeTimeout = 3 * time.Second
	p, victim := acceptRawVictimWith(t, MemMapTypeMemFd, 0, func(c *Config) { c.ConnectionWriteTimeout = writeTimeout })
	defer victim.Close()
	st, err := victim.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	before := fillSocket(t, victim)
	if p.recv.flag() != 0 {
		t.Fatal("the peer's working flag is set before the write")
	}
	st.SetWriteDeadline(time.Now().Add(time.Second))
	start := time.Now()
	n, err := st.Write([]byte("hello"))
	took := time.Since(start)
	if n != 5 || err != nil {
		t.Errorf("Write with the socket full: %d, %v, want 5, nil", n, err)
	}
	if took > 500*time.Millisecond {
		t.Errorf("Write took %v with the socket full (ConnectionWriteTimeout %v)", took, writeTimeout)
	}
	// The peer reads: the frames before, then the wake-up.
	p.conn.SetReadDeadline(time.Now().Add(peerTimeout))
	frames := 0
	for frames < before+1 {
		h, err := readN(p.conn, 8)
		if err != nil {
			t.Fatalf("after %d frames (%d filled): %v", frames, before, err)
		}
		if binary.BigEndian.Uint32(h) != 8 || h[7] != 1 {
			t.Fatalf("frame %d: % x, want Polling", frames, h)
		}
		frames++
	}
	e, err := p.waitElem()
	if err != nil {
		t.Fatal(err)
	}
	if got, err := p.readMsg(e.Offset); err != nil || got != "hello" {
		t.Errorf("the message on the queue: %q, %v", got, err)
	}
	if victim.IsClosed() {
		t.Errorf("the session ended: %v", victim.Err())
	}
}

// errWriteFault stands for a write(2) failure that is not the peer's end.
var errWriteFault = errors.New("write fault")

// wakeFaultConn is a Unix connection whose writes fail with errWriteFault
// once fail is set, through the net.Conn and its raw descriptor alike.
type wakeFaultConn struct {
	*net.UnixConn
	fail atomic.Bool
}

func (c *wakeFaultConn) Write(b []byte) (int, error) {
	if c.fail.Load() {
		return 0, errWriteFault
	}
	return c.UnixConn.Write(b)
}

func (c *wakeFaultConn) SyscallConn() (syscall.RawConn, error) {
	rc, err := c.UnixConn.SyscallConn()
	return wakeFaultRaw{RawConn: rc, c: c}, err
}

type wakeFaultRaw struct {
	syscall.RawConn
	c *wakeFaultConn
}

func (r wakeFaultRaw) Write(f func(uintptr) bool) error {
	if r.c.fail.Load() {
		return errWriteFault
	}
	return r.RawConn.Write(f)
}

// TestWriteCountsQueuedMessage: the message is on the IO queue when the
// write of its wake-up fails (not because the peer went: the session ends
// with that error). The peer may read the message, and does here, so
// Write counts it: n is len(p), with the error.
func TestWriteCountsQueuedMessage(t *testing.T) {
	var fc *wakeFaultConn
	p, victim := rawVictimOver(t, MemMapTypeDevShmFile, func(sock string, conf *Config) (*Session, error) {
		c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: sock, Net: "unix"})
		if err != nil {
			return nil, err
		}
		fc = &wakeFaultConn{UnixConn: c}
		return Client(fc, conf)
	}, nil)
	defer victim.Close()
	st, err := victim.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	fc.fail.Store(true)
	n, err := st.Write([]byte("hello"))
	if !errors.Is(err, errWriteFault) {
		t.Errorf("Write: %v, want the write's error", err)
	}
	if n != 5 {
		t.Errorf("Write counted %d bytes of a message on the queue, want 5", n)
	}
	e, werr := p.waitElem()
	if werr != nil {
		t.Fatal(werr)
	}
	if got, err := p.readMsg(e.Offset); err != nil || got != "hello" {
		t.Errorf("the message on the queue: %q, %v", got, err)
	}
}

// A server that stops reading its end of the connection (shutdown of its
// reading side) but keeps it open: the wake-up after a client's write fails,
// and the writes after it fail with an error wrapping ErrSessionClosed and
// ErrPeerClosed. The write whose wake-up failed had put its message on the
// queue, where a polling server could take it: it returns nil, and the
// server finds there exactly the messages of the writes that returned nil.
// What the server publishes afterwards still reaches the client's reader;
// and the session ends with ErrPeerClosed within about peerGoneGrace,
// though the socket never ends.
func TestWriteToPeerThatStoppedReading(t *testing.T) {
	waitsInParallel(t)
	p, sess := acceptRawVictim(t, MemMapTypeMemFd, 0)
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if err := p.conn.CloseRead(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	var (
		werr error
		sent []string
	)
	for i := 0; i < 100 && werr == nil; i++ {
		// The first write sets the server's working flag, which it never
		// clears: clear it, so that each write needs a wake-up.
		atomic.StoreUint32(p.recv.u32(queueFlagOff), 0)
		msg := fmt.Sprintf("request %d", i)
		if _, werr = st.Write([]byte(msg)); werr == nil {
			sent = append(sent, msg)
		}
	}
	if !errors.Is(werr, ErrSessionClosed) || !errors.Is(werr, ErrPeerClosed) {
		t.Fatalf("writes to a server that stopped reading: %v; want an error wrapping ErrSessionClosed and ErrPeerClosed", werr)
	}
	if len(sent) == 0 {
		t.Fatal("the first write failed; its message reached the queue before its wake-up failed, so it counts as written")
	}
	for _, want := range sent {
		e, err := p.waitElem()
		if err != nil {
			t.Fatalf("the message of a write that returned nil (%q): %v", want, err)
		}
		if got, err := p.readMsg(e.Offset); err != nil || got != want {
			t.Fatalf("the server reads %q, %v; want %q", got, err, want)
		}
	}
	if e, ok := p.recv.pop(); ok {
		t.Errorf("a write that failed left element %+v on the queue", e)
	}
	if _, err := st.Write([]byte("more")); !errors.Is(err, ErrPeerClosed) {
		t.Errorf("a write after the failed one: %v; want ErrPeerClosed", err)
	}
	if sess.IsClosed() {
		t.Fatal("the session ended at the failed write; the peer's data still to come would be lost")
	}

	p.publish(st.ID(), p.msg("reply"), shm.StatusOpened)
	st.SetReadDeadline(time.Now().Add(peerTimeout))
	got := make([]byte, 5)
	if _, err := io.ReadFull(st, got); err != nil || string(got) != "reply" {
		t.Fatalf("reading what the server sent after the failed write: %q, %v", got, err)
	}

	err = waitSessionClosed(t, sess, peerGoneGrace+peerTimeout)
	if !errors.Is(err, ErrSessionClosed) || !errors.Is(err, ErrPeerClosed) {
		t.Errorf("the session ended with %v; want an error wrapping ErrSessionClosed and ErrPeerClosed", err)
	}
	if d := time.Since(start); d < peerGoneGrace/2 {
		t.Errorf("the session ended %v after the failed write, before the grace of %v", d, peerGoneGrace)
	}
}

// A client that stops reading its end of the connection while the server
// starts a hot restart: the HotRestart frame's write fails, which does not
// end the server's session at once. A message the client publishes after
// that still reaches the server, another session of the listener is
// unaffected, and the session ends with ErrPeerClosed within about
// peerGoneGrace, though the socket never ends.
func TestHotRestartToPeerThatStoppedReading(t *testing.T) {
	waitsInParallel(t)
	env := startTestServer(t, 0)
	p, victim := connectRawClient(t, env, MemMapTypeMemFd)
	c := &hpCtx{t: t, p: p, victim: victim, id: 2}
	if err := c.roundTrip("before", 0); err != nil {
		t.Fatalf("echo before the client stopped reading: %v", err)
	}
	if err := p.conn.CloseRead(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := env.ln.HotRestart(hrEpoch); err != nil {
		t.Fatalf("HotRestart: %v", err)
	}
	// A Unix socket whose peer has shut down its reading side fails every
	// write at once (EPIPE).
	var sendErr error
	if e := victim.sendErr.Load(); e != nil {
		sendErr = *e
	}
	if sendErr == nil || !strings.Contains(sendErr.Error(), "send HotRestart") {
		t.Fatalf("the HotRestart frame to a client that stopped reading: session %v, send error %v; want the write to have failed", victim.Err(), sendErr)
	}
	if victim.IsClosed() {
		t.Fatalf("the session ended at the failed write (%v): the client's data still to come would be lost", victim.Err())
	}
	// The echo cannot answer (sending to the client has stopped), but it
	// receives.
	in := victim.Stats().BytesIn
	c.publish(c.id, p.msg("after"), 0)
	waitUntil(t, "the server receives a message sent after the failed write", peerTimeout, func() bool {
		return victim.Stats().BytesIn == in+uint64(len("after"))
	})
	if err := echoRoundTrip(env.good, "another session"); err != nil {
		t.Fatalf("another session of the listener: %v", err)
	}
	err := waitSessionClosed(t, victim, peerGoneGrace+peerTimeout)
	if !errors.Is(err, ErrSessionClosed) || !errors.Is(err, ErrPeerClosed) {
		t.Errorf("the session ended with %v; want an error wrapping ErrSessionClosed and ErrPeerClosed", err)
	}
	if d := time.Since(start); d < peerGoneGrace/2 {
		t.Errorf("the session ended %v after the failed write, before the grace of %v", d, peerGoneGrace)
	}
	if env.good.IsClosed() {
		t.Errorf("the other session ended: %v", env.good.Err())
	}
}

// A peer that publishes data and a close on a stream without a wake-up (the
// working flag was up: it counted on our side draining anyway) and then
// closes its end of the connection: the end of the socket does not drop
// them, whether we read the end as EOF or as ECONNRESET (the peer left
// frames of ours unread). The reader gets every byte, then io.EOF, and the
// session ends with ErrPeerClosed. No reader of ours polls here (ConsumerSpinTime 0), so only
// the drain at the end of the socket (drainBefore) can deliver them.
func TestPeerPublishesThenCloses(t *testing.T) {
	for _, tc := range []struct {
		streams int
		reset   bool // leave our frames unread: we read ECONNRESET, not EOF
	}{{1, false}, {8, false}, {1, true}, {8, true}} {
		streams := tc.streams
		t.Run(fmt.Sprintf("streams=%d/reset=%v", streams, tc.reset), func(t *testing.T) {
			p, sess := acceptRawVictim(t, MemMapTypeMemFd, 0)
			sts := make([]*Stream, streams)
			for i := range sts {
				sts[i] = openPinged(t, p, sess)
			}
			type result struct {
				data string
				err  error
			}
			results := make(chan result, streams)
			for _, st := range sts {
				go func() {
					b, err := io.ReadAll(st)
					results <- result{string(b), err}
				}()
			}
			// The working flag up, as a draining consumer leaves it: a
			// correct producer then publishes without a Polling frame.
			atomic.StoreUint32(p.send.u32(queueFlagOff), 1)
			for i, st := range sts {
				p.send.put(st.ID(), p.msg(fmt.Sprintf("last words %d", i)), shm.StatusOpened)
				p.send.put(st.ID(), 0, shm.StatusClosed)
			}
			if !tc.reset {
				// Read what we sent (Polling frames) first: a socket closed
				// with nothing unread ends with EOF on our side.
				p.conn.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
				_, _ = io.Copy(io.Discard, p.conn)
			}
			p.conn.Close()
			for range sts {
				select {
				case r := <-results:
					if r.err != nil || !strings.HasPrefix(r.data, "last words ") {
						t.Errorf("a stream's reader got %q, %v; want its last words, then io.EOF", r.data, r.err)
					}
				case <-time.After(peerTimeout):
					t.Fatal("a reader still waits after the peer closed")
				}
			}
			err := waitSessionClosed(t, sess, peerTimeout)
			if !errors.Is(err, ErrPeerClosed) {
				t.Errorf("the session ended with %v; want ErrPeerClosed", err)
			}
			if want := map[bool]string{false: "EOF", true: "reset"}[tc.reset]; err != nil && !strings.Contains(err.Error(), want) {
				t.Errorf("the session ended with %v; want the end of the socket read as %s", err, want)
			}
		})
	}
}

// TestHandoverMutex: a goroutine that finds the mutex held leaves its work
// to the holder, which sees the debt after it unlocks; with the mutex free
// it takes it. Under contention no debt is lost: every one is paid, by its
// setter or by a holder.
func TestHandoverMutex(t *testing.T) {
	var m handoverMutex
	if !m.tryLockOrLeave() {
		t.Fatal("tryLockOrLeave on a free mutex did not take it")
	}
	m.Unlock()
	m.Lock()
	var debt atomic.Bool
	debt.Store(true)
	if m.tryLockOrLeave() {
		t.Fatal("tryLockOrLeave took a held mutex")
	}
	m.Unlock()
	if !debt.Load() {
		t.Fatal("the holder does not see the debt left to it")
	}

	// Each worker adds debts and pays what it finds, as writePolling and
	// unlockW do; at the end nothing is owed.
	var owed, paid atomic.Int64
	var flag atomic.Bool
	held := 0 // guarded by m
	pay := func() {
		for flag.Load() {
			if !m.tryLockOrLeave() {
				return
			}
			if flag.Swap(false) {
				paid.Store(owed.Load())
			}
			m.Unlock()
		}
	}
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 20000 {
				owed.Add(1)
				flag.Store(true)
				pay()
				m.Lock()
				held++
				m.Unlock()
				pay()
			}
		}()
	}
	wg.Wait()
	if held != 4*20000 {
		t.Errorf("%d critical sections, want %d", held, 4*20000)
	}
	if flag.Load() {
		t.Errorf("a debt was left unpaid: %d owed, paid up to %d", owed.Load(), paid.Load())
	}
}

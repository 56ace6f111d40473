package shmipc

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
	"github.com/goshm/shmipc/internal/shm"
)

// A file-mode client shrinks its buffer or queue file at a random moment
// while its streams exchange messages of many sizes, one of them writing
// without reading. Whatever the moment, every call returns, no echo that
// succeeds is wrong, and once the session has closed both sides have
// unmapped both files and the listener has forgotten it; another session
// goes on.

// truncTargets are the files shrunk and their new sizes.
var truncTargets = []struct {
	file string // the file's suffix
	size int64
}{
	{"_buffer", 0}, {"_buffer", 4096}, {"_buffer", 2 << 20}, {"_queue_0", 0}, {"_queue_0", 4096},
}

// TestTruncateUnderTraffic runs the client in this process.
func TestTruncateUnderTraffic(t *testing.T) {
	rounds := 3
	if testing.Short() {
		rounds = 1
	}
	ln := startEchoListener(t, DefaultConfig())
	good, err := Dial("unix", ln.Addr().String(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer good.Close()
	for round := range rounds {
		for _, tg := range truncTargets {
			t.Run(fmt.Sprintf("file=%s/size=%d/round=%d", tg.file, tg.size, round), func(t *testing.T) {
				prefix := shmPrefix(t, "trunc")
				victim, srv := dialListenerSession(t, ln, truncClientConfig(prefix))
				bufPath, queuePath := prefix, prefix
				wrong := truncTraffic(t, victim, &bufPath, &queuePath, tg.file, tg.size)
				closeWithin(t, victim, peerTimeout)
				if len(wrong) > 0 {
					t.Fatalf("%d echoes came back wrong, first %s", len(wrong), wrong[0])
				}
				truncCheckServer(t, ln, srv, bufPath, queuePath)
				if err := echoRoundTrip(good, "still here"); err != nil {
					t.Fatalf("the other session: %v", err)
				}
			})
		}
	}
}

// TestTruncateUnderTrafficAcrossProcesses runs each client in a child
// process; the server's side is checked here.
func TestTruncateUnderTrafficAcrossProcesses(t *testing.T) {
	ln := startEchoListener(t, DefaultConfig())
	good, err := Dial("unix", ln.Addr().String(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer good.Close()
	for _, tg := range truncTargets {
		t.Run(fmt.Sprintf("file=%s/size=%d", tg.file, tg.size), func(t *testing.T) {
			prefix := shmPrefix(t, "trunc")
			c, _ := startChild(t, proctest.Config{TestName: "TestTruncateChild", Role: "trunc-client", Args: map[string]string{
				"SOCK": ln.Addr().String(), "PREFIX": prefix, "FILE": tg.file, "SIZE": strconv.FormatInt(tg.size, 10),
			}})
			line, err := c.ReadLine(childStartTimeout)
			if err != nil || !strings.HasPrefix(line, "done ") {
				t.Fatalf("child: %q, %v\n%s", line, err, c.Output())
			}
			bufPath, queuePath, _ := strings.Cut(strings.TrimPrefix(line, "done "), " ")
			waitUntil(t, "this side unmaps the child's files and the listener forgets its session", peerTimeout, func() bool {
				return len(listenerSessions(ln)) == 1 && foMappings(t, bufPath) == 0 && foMappings(t, queuePath) == 0
			})
			if err := echoRoundTrip(good, "still here"); err != nil {
				t.Fatalf("the other session: %v", err)
			}
		})
	}
}

// TestTruncateChild is the client of TestTruncateUnderTrafficAcrossProcesses.
func TestTruncateChild(t *testing.T) {
	if proctest.Role() != "trunc-client" {
		t.Skip("runs only as the child process of TestTruncateUnderTrafficAcrossProcesses")
	}
	prefix := proctest.MustArg(t, "PREFIX")
	size, err := strconv.ParseInt(proctest.MustArg(t, "SIZE"), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	sess, err := Dial("unix", proctest.MustArg(t, "SOCK"), truncClientConfig(prefix))
	if err != nil {
		t.Fatal(err)
	}
	proctest.Ready()
	bufPath, queuePath := prefix, prefix
	wrong := truncTraffic(t, sess, &bufPath, &queuePath, proctest.MustArg(t, "FILE"), size)
	closeWithin(t, sess, peerTimeout)
	if len(wrong) > 0 {
		t.Fatalf("%d echoes came back wrong, first %s", len(wrong), wrong[0])
	}
	proctest.Println("done", bufPath, queuePath)
}

func truncClientConfig(prefix string) *Config {
	conf := DefaultConfig()
	conf.MemMapType = MemMapTypeDevShmFile
	conf.ShareMemoryPathPrefix = prefix
	conf.WriteSpaceTimeout = time.Minute // the writer that never reads waits for room until the end
	return conf
}

// dialListenerSession dials ln, an echo listener, with conf, and returns
// the session and the one ln registered for it, once they have done a
// round trip. The session is closed when the test ends.
//
// The server's session is told by the name of the queue region, which is
// new for each session: a session registered after the last look may be
// another client's (one dialled just before, whose server side the
// listener registered late), and taking that one made the test wait for
// the wrong session to end.
func dialListenerSession(t *testing.T, ln *Listener, conf *Config) (c, srv *Session) {
	t.Helper()
	c, err := Dial("unix", ln.Addr().String(), conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if err := echoRoundTrip(c, "first"); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the listener registers the session", peerTimeout, func() bool {
		for s := range listenerSessions(ln) {
			if s.queueRegion != nil && s.queueRegion.Path() == c.queueRegion.Path() {
				srv = s
				return true
			}
		}
		return false
	})
	return c, srv
}

// truncTraffic runs four streams of echoes on sess, whose files begin with
// the prefix *bufPath and *queuePath hold, and shrinks the file ending in
// file to size after a random while; it returns when every stream has
// ended, once sess is closed 50 ms later. It sets the two paths, and
// returns the echoes that came back wrong.
func truncTraffic(t *testing.T, sess *Session, bufPath, queuePath *string, file string, size int64) (wrong []string) {
	t.Helper()
	if err := echoRoundTrip(sess, "first"); err != nil { // both sides have both files mapped
		t.Fatal(err)
	}
	files := shmFiles(*bufPath)
	var path string
	for _, f := range files {
		switch {
		case strings.HasSuffix(f, "_buffer"):
			*bufPath = f
		case strings.HasSuffix(f, "_queue_0"):
			*queuePath = f
		}
		if strings.HasSuffix(f, file) {
			path = f
		}
	}
	if path == "" || !strings.HasSuffix(*bufPath, "_buffer") || !strings.HasSuffix(*queuePath, "_queue_0") {
		t.Fatalf("cannot tell the session's files among %v", files)
	}
	var (
		wg sync.WaitGroup
		mu sync.Mutex
	)
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, err := sess.OpenStream()
			if err != nil {
				return
			}
			defer st.Close()
			rng := rand.New(rand.NewPCG(uint64(i), uint64(time.Now().UnixNano())))
			got := make([]byte, 600<<10)
			for n := 0; ; n++ {
				sz := 1 + rng.IntN(8<<10)
				if n%5 == 4 {
					sz = 64<<10 + rng.IntN(512<<10) // several slices
				}
				msg := bytes.Repeat([]byte{byte('a' + i), byte(n)}, sz/2+1)[:sz]
				if _, err := st.Write(msg); err != nil {
					return
				}
				if i == 3 {
					continue // never reads: the replies pile up
				}
				if _, err := io.ReadFull(st, got[:sz]); err != nil {
					return
				}
				if !bytes.Equal(got[:sz], msg) {
					mu.Lock()
					wrong = append(wrong, fmt.Sprintf("stream %d message %d (%d bytes)", i, n, sz))
					mu.Unlock()
				}
			}
		}()
	}
	time.Sleep(time.Duration(rand.IntN(30)) * time.Millisecond)
	if err := os.Truncate(path, size); err != nil {
		t.Fatal(err)
	}
	// A shrink that leaves the pages in use alone may never fault: the
	// application closes the session after a while (50 ms, 25 ms with
	// -short: the four streams touch the region without pause), which
	// ends it too.
	time.Sleep(shortOr(50*time.Millisecond, 25*time.Millisecond))
	sess.Close()
	finished := make(chan struct{})
	go func() { wg.Wait(); close(finished) }()
	select {
	case <-finished:
	case <-time.After(peerTimeout):
		t.Fatalf("the session's readers and writers did not return within %v of Close", peerTimeout)
	}
	return wrong
}

// truncCheckServer waits until this process has unmapped both files and
// the listener has forgotten srv, which must have closed.
func truncCheckServer(t *testing.T, ln *Listener, srv *Session, bufPath, queuePath string) {
	t.Helper()
	waitUntil(t, "both sides unmap the victim's files and the listener forgets its session", peerTimeout, func() bool {
		return !listenerSessions(ln)[srv] && foMappings(t, bufPath) == 0 && foMappings(t, queuePath) == 0
	})
	if !srv.IsClosed() || !errors.Is(srv.Err(), ErrSessionClosed) {
		t.Fatalf("the server session: closed %v, error %v", srv.IsClosed(), srv.Err())
	}
}

// A stream closed after its peer shrank the queue file: the close element's
// write faults, and the session ends with everything it mapped unmapped
// (the region's reference used to be dropped only after the write).
func TestStreamCloseAfterQueueShrunk(t *testing.T) {
	conf := peerConfig(t, MemMapTypeDevShmFile, 0)
	ln := startEchoListener(t, conf)
	c, srv := dialListenerSession(t, ln, conf)
	st, err := c.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(st, make([]byte, 4)); err != nil {
		t.Fatal(err)
	}
	var queuePath, bufPath string
	for _, f := range shmFiles(conf.ShareMemoryPathPrefix) {
		switch {
		case strings.HasSuffix(f, "_queue_0"):
			queuePath = f
		case strings.HasSuffix(f, "_buffer"):
			bufPath = f
		}
	}
	if err := os.Truncate(queuePath, 0); err != nil {
		t.Fatal(err)
	}
	st.Close() // the close element goes on the shrunk queue
	err = waitSessionClosed(t, c, peerTimeout)
	if !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "memory fault") {
		t.Errorf("session error %v, want a memory fault wrapping ErrProtocol", err)
	}
	closeWithin(t, c, peerTimeout)
	truncCheckServer(t, ln, srv, bufPath, queuePath)
}

// Hostile IO queues and queue elements: head and tail counters that are too
// far apart or run backwards, elements with stream id 0, unknown statuses
// or a close that carries an offset, and elements for streams the victim
// does not know. Both victims face the same cases; what an element for an
// unknown stream means differs between a server and a client.

// hpQueueCases are the IO queue corruptions both victims face.
func hpQueueCases() []hpCase {
	return []hpCase{
		{name: "element for stream id 0", want: []string{"stream id 0"},
			do: func(c *hpCtx) { c.publish(0, c.p.msg("zero"), shm.StatusOpened) }},
		{name: "status 2 (HalfClosed on the wire)", want: []string{"status", "0x2"},
			do: func(c *hpCtx) { c.publish(c.id, c.p.msg("x"), 2) }},
		{name: "status 0x1FF", want: []string{"status", "0x1ff"},
			do: func(c *hpCtx) { c.publish(c.id, c.p.msg("x"), 0x1FF) }},
		{name: "status 0xFFFFFF07", want: []string{"status"},
			do: func(c *hpCtx) { c.publish(c.id, c.p.msg("x"), 0xFFFFFF07) }},
		{name: "close element with an offset", want: []string{"close", "offset"},
			do: func(c *hpCtx) { c.publish(c.id, c.p.msg("x"), shm.StatusClosed) }},
		{name: "receive queue tail 2^32 ahead of head", want: []string{"head", "tail", "apart"},
			do: func(c *hpCtx) { c.p.send.setTail(c.p.send.head() + 1<<32); c.wake() }},
		{name: "receive queue tail just past capacity", want: []string{"apart"},
			do: func(c *hpCtx) { c.p.send.setTail(c.p.send.head() + int64(c.p.send.cap) + 1); c.wake() }},
		{name: "receive queue tail behind head", want: []string{"head", "tail", "apart"},
			do: func(c *hpCtx) { c.p.send.setTail(c.p.send.head() - 1); c.wake() }},
		{name: "receive queue tail negative", want: []string{"apart"},
			do: func(c *hpCtx) { c.p.send.setTail(-1 << 62); c.wake() }},
		{name: "send queue head ahead of tail", want: []string{"IO queue", "head"},
			do: func(c *hpCtx) { c.provokeSend(func() { c.p.recv.setHead(c.p.recv.tail() + 5) }) }},
		{name: "send queue head 2^32 behind tail", want: []string{"IO queue", "apart"},
			do: func(c *hpCtx) { c.provokeSend(func() { c.p.recv.setHead(c.p.recv.tail() - 1<<32) }) }},
		// The library reads these fields once, at mapping time; rewriting
		// them later must change nothing.
		{name: "queue cap fields rewritten to 0", survive: hpSurviveRoundTrip,
			do: func(c *hpCtx) { c.p.send.setCapField(0); c.p.recv.setCapField(0) }},
		{name: "queue cap fields rewritten to 0xFFFFFFFF", survive: hpSurviveRoundTrip,
			do: func(c *hpCtx) { c.p.send.setCapField(0xFFFFFFFF); c.p.recv.setCapField(0xFFFFFFFF) }},
		// The consumer keeps its own head: a rewritten shared head is
		// overwritten by the next pop.
		{name: "receive queue head rewritten past tail", survive: hpSurviveRoundTrip,
			do: func(c *hpCtx) { c.p.send.setHead(c.p.send.tail() + 100) }},
		// Receivers mask the status with 0xFF (docs/protocol.md §9.3).
		{name: "status 0x100 is data", survive: func(c *hpCtx) error { return c.roundTrip("upper bits", 0x100) },
			do: func(c *hpCtx) {}},
	}
}

func TestHostileClientQueue(t *testing.T) {
	cases := append(hpQueueCases(),
		hpCase{name: "data for an unknown stream opens it", do: func(c *hpCtx) {
			c.publish(77, c.p.msg("implicit open"), shm.StatusOpened)
		}, survive: func(c *hpCtx) error { return c.expectData(77, "implicit open") }},
		hpCase{name: "close element for an unknown stream is ignored", do: func(c *hpCtx) {
			c.publish(78, 0, shm.StatusClosed)
		}, survive: hpSurviveRoundTrip},
	)
	hpAgainstServer(t, cases)
}

func TestHostileServerQueue(t *testing.T) {
	cases := append(hpQueueCases(),
		hpCase{name: "data for an unknown stream is dropped", do: func(c *hpCtx) {
			c.publish(99, c.p.msg("stray"), shm.StatusOpened)
		}, survive: hpSurviveRoundTrip},
		hpCase{name: "close element for an unknown stream is ignored", do: func(c *hpCtx) {
			c.publish(98, 0, shm.StatusClosed)
		}, survive: hpSurviveRoundTrip},
	)
	hpAgainstClient(t, cases)
}

// TestHostileServerStrayData: data for a stream the client never opened is
// freed and dropped (docs/protocol.md §9.2).
func TestHostileServerStrayData(t *testing.T) {
	env := startTestServer(t, defaultConsumerSpinTime)
	for _, mode := range bothModes {
		t.Run(modeName(mode), func(t *testing.T) {
			c := hpClientCase(t, mode, false)
			before := freeCounts(c.p.bm)[0]
			c.publish(99, c.p.msg("stray"), shm.StatusOpened)
			waitUntil(t, fmt.Sprintf("the stray slice is freed (free count of list 0 back to %d)", before), peerTimeout, func() bool { return freeCounts(c.p.bm)[0] == before })
			c.p.write(rawFallbackFrame(c.p.version, 0, 97, 0, "stray fallback"))
			if err := hpSurviveRoundTrip(c); err != nil {
				t.Error(err)
			}
			if c.victim.IsClosed() {
				t.Errorf("victim closed: %v", c.victim.Err())
			}
			closeWithin(t, c.victim, peerTimeout)
			env.checkGood(t)
		})
	}
}

package shmipc

// Peer death across real processes: the child (this test binary re-executed
// by internal/proctest, running TestPeerDeathChild) is a shmipc server or
// client, and the parent SIGKILLs it at a chosen point: during the
// handshake, while it streams large messages, while it holds slices it
// read, while the parent is blocked on a full queue or region, and at 100
// random points of a mixed workload. Each time the survivor's blocked calls
// must fail promptly (the target is 100 ms after the socket closes; the
// tests assert 2 s and log the latency), nothing may leak (goroutines, fds,
// mappings, /dev/shm files), and a new session to a new child must work.

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
	"github.com/goshm/shmipc/internal/wire"
	"golang.org/x/sys/unix"
)

var pdKills = flag.Int("peerdeath.kills", 100, "how many times TestPeerDeathKillLoop kills its child")

const (
	pdChildTest = "TestPeerDeathChild"
	// pdBound is the asserted bound on how long a blocked call may take to
	// fail after the peer is killed; the target is 100 ms.
	pdBound = 2 * time.Second
)

// pdConfig returns the configuration kind ("default" or "small") in mode.
// Timeouts are long so that only the peer's death can end a blocked call.
func pdConfig(kind string, mode MemMapType, prefix string) *Config {
	conf := DefaultConfig()
	conf.MemMapType = mode
	conf.ShareMemoryPathPrefix = prefix
	conf.ShareMemoryBufferCap = 16 << 20
	conf.InitializeTimeout = 30 * time.Second
	conf.ConnectionWriteTimeout = 60 * time.Second
	conf.WriteSpaceTimeout = 60 * time.Second
	if strings.HasPrefix(kind, "small") {
		conf.QueueCap = 16
		conf.ShareMemoryBufferCap = 1 << 20
		conf.BufferSliceSizes = ReferenceSliceSizes()
	}
	conf.FallbackWhenFull = kind == "small-fwf"
	return conf
}

var pdHello = []byte("HELO")

// pdOnce prints line once per child process.
var pdOnce sync.Map

func pdPrintOnce(line string) {
	if _, loaded := pdOnce.LoadOrStore(line, true); !loaded {
		proctest.Println(line)
	}
}

// pdBehave runs the child's side of one stream after the hello.
func pdBehave(t *testing.T, st *Stream, behavior string) {
	switch behavior {
	case "echo":
		_ = mpServeEcho(st)
	case "idle":
		_, _ = st.Read(make([]byte, 1))
	case "sink": // read and throw away
		buf := make([]byte, 256<<10)
		for {
			if _, err := st.Read(buf); err != nil {
				return
			}
		}
	case "stream": // send large messages without end, drain what comes
		go func() {
			buf := make([]byte, 64<<10)
			for {
				if _, err := st.Read(buf); err != nil {
					return
				}
			}
		}()
		rng := rand.New(rand.NewPCG(rand.Uint64(), 0))
		for seq := uint32(0); ; seq++ {
			n := 256<<10 + rng.IntN(2<<20)
			if err := skSend(st, seq, skBody(rng, n), 0, skReserveIf(rng.IntN(3) == 0), nil); err != nil {
				return
			}
			if seq == 2 {
				pdPrintOnce("streaming")
			}
		}
	case "hold": // keep every slice read; send back what was read
		r := &skReader{st: st, hold: true, rng: rand.New(rand.NewPCG(1, 2))}
		var held int
		for {
			_, n, err := r.next()
			if err != nil {
				return
			}
			held += n
			if r.seq == 8 {
				rng := rand.New(rand.NewPCG(3, 4))
				for i := range 8 {
					if err := skSend(st, uint32(i), skBody(rng, 100<<10), 0, skViaWriteBytes, nil); err != nil {
						return
					}
				}
				proctest.Println("held " + strconv.Itoa(held))
			}
		}
	case "mixed": // the kill loop's workload
		pdMixed(st, rand.Uint64(), 1<<20, nil)
	default:
		t.Errorf("unknown behavior %q", behavior)
	}
}

// pdMixed runs the full-duplex mixed workload on st until it fails: one
// goroutine sends checksummed messages of 1 B to max bytes, the caller's
// reads and verifies the peer's. It returns the read error and sends the
// write error to werr if not nil.
func pdMixed(st *Stream, seed uint64, max int, werr chan<- error) error {
	go func() {
		rng := rand.New(rand.NewPCG(seed, 7))
		var err error
		for seq := uint32(0); err == nil; seq++ {
			err = skSend(st, seq, skBody(rng, skSize(rng, max)), 0, skReserveIf(rng.IntN(4) == 0), nil)
		}
		if werr != nil {
			werr <- err
		}
	}()
	r := &skReader{st: st, rng: rand.New(rand.NewPCG(seed, 8))}
	for {
		if _, _, err := r.next(); err != nil {
			return err
		}
	}
}

// TestPeerDeathChild is the body of the child processes. Arguments: SOCK,
// PREFIX, MODE, CONF (config kind), SIDE (server: listen on SOCK; client:
// dial SOCK and open NSTREAMS streams), BEHAVIOR (what to do on each
// stream, after the opener sent "HELO"), or SIDE raw-server / raw-client
// with STAGE, a peer that stalls in the handshake.
func TestPeerDeathChild(t *testing.T) {
	if proctest.Role() == "" {
		t.Skip("runs only as the child process of the peer-death tests")
	}
	sock := proctest.MustArg(t, "SOCK")
	prefix := proctest.MustArg(t, "PREFIX")
	mode := mpParseMode(t, proctest.MustArg(t, "MODE"))
	conf := pdConfig(proctest.MustArg(t, "CONF"), mode, prefix)
	behavior := proctest.Arg("BEHAVIOR")
	switch side := proctest.MustArg(t, "SIDE"); side {
	case "server":
		ln, err := Listen("unix", sock, conf)
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		go serveStreams(ln, func(st *Stream) {
			defer st.Close()
			hello := make([]byte, len(pdHello))
			if _, err := io.ReadFull(st, hello); err != nil {
				return
			}
			pdBehave(t, st, behavior)
		})
		proctest.Ready()
		<-proctest.StdinClosed()

	case "client":
		sess, err := Dial("unix", sock, conf)
		if err != nil {
			t.Fatal(err)
		}
		defer sess.Close()
		n, _ := strconv.Atoi(proctest.MustArg(t, "NSTREAMS"))
		for range n {
			st, err := sess.OpenStream()
			if err != nil {
				t.Fatal(err)
			}
			if _, err := st.Write(pdHello); err != nil {
				t.Fatal(err)
			}
			go func() {
				defer st.Close()
				pdBehave(t, st, behavior)
			}()
		}
		proctest.Ready()
		<-proctest.StdinClosed()

	case "raw-server":
		pdRawServer(t, sock, proctest.MustArg(t, "STAGE"))
	case "raw-client":
		pdRawClient(t, sock, prefix, proctest.MustArg(t, "STAGE"))
	default:
		t.Fatalf("unknown SIDE %q", side)
	}
}

// pdRawServer accepts one connection and stalls at stage: "accept" (never
// answers), "exchange" (answers the version exchange), "ackfd" (also takes
// the region fds).
func pdRawServer(t *testing.T, sock, stage string) {
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	proctest.Ready()
	c, err := ln.AcceptUnix()
	if err != nil {
		t.Fatal(err)
	}
	h := make(wire.Header, wire.HeaderSize)
	if stage != "accept" {
		if _, err := io.ReadFull(c, h); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Write(wire.AppendEvent(nil, wire.VersionMemfd, wire.TypeExchangeProtoVersion)); err != nil {
			t.Fatal(err)
		}
	}
	if stage == "ackfd" {
		if _, err := io.ReadFull(c, h); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, make([]byte, h.Length()-wire.HeaderSize)); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Write(wire.AppendEvent(nil, wire.VersionMemfd, wire.TypeAckReadyRecvFD)); err != nil {
			t.Fatal(err)
		}
		oob := make([]byte, unix.CmsgSpace(16))
		if _, _, _, _, err := c.ReadMsgUnix(make([]byte, 1), oob); err != nil {
			t.Fatal(err)
		}
	}
	proctest.Println("stalled")
	<-proctest.StdinClosed()
	c.Close()
	ln.Close()
}

// pdRawClient connects and stalls at stage: "exchange" (sent
// ExchangeProtoVersion only), "paths" (got AckReadyRecvFD, sends no fds),
// "partial" (a version 2 path message cut short), "mapped" (completed a
// memfd handshake with its own regions, then does nothing).
func pdRawClient(t *testing.T, sock, prefix, stage string) {
	raw, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	c := raw.(*net.UnixConn)
	qpath, bpath := prefix+"_raw_queue_0", prefix+"_raw_buffer"
	switch stage {
	case "exchange":
		if _, err := c.Write(wire.AppendEvent(nil, wire.VersionMemfd, wire.TypeExchangeProtoVersion)); err != nil {
			t.Fatal(err)
		}
	case "paths":
		if err := clExchange(c); err != nil {
			t.Fatal(err)
		}
		f, _ := wire.AppendPaths(nil, wire.VersionMemfd, wire.TypeShareMemoryByMemfd, qpath, bpath)
		if _, err := c.Write(f); err != nil {
			t.Fatal(err)
		}
		if err := clExpectFrame(c, wire.TypeAckReadyRecvFD); err != nil {
			t.Fatal(err)
		}
	case "partial":
		f, _ := wire.AppendPaths(nil, wire.VersionFilePath, wire.TypeShareMemoryByFilePath, qpath, bpath)
		if _, err := c.Write(f[:len(f)-5]); err != nil {
			t.Fatal(err)
		}
	case "mapped":
		bufFd, err := clMemfd(bpath, 1<<20, true)
		if err != nil {
			t.Fatal(err)
		}
		qsize := queueRegionSize(16)
		qFd, err := clMemfd(qpath, qsize, false)
		if err != nil {
			t.Fatal(err)
		}
		mem, err := unix.Mmap(qFd, 0, qsize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err != nil {
			t.Fatal(err)
		}
		initQueueRegion(mem, 16)
		if err := clSendMemfds(c, qpath, bpath, bufFd, qFd); err != nil {
			t.Fatal(err)
		}
		if err := clExpectFrame(c, wire.TypeAckShareMemory); err != nil {
			t.Fatal(err)
		}
	default:
		t.Fatalf("unknown STAGE %q", stage)
	}
	proctest.Println("stalled")
	<-proctest.StdinClosed()
	c.Close()
}

// ---------------------------------------------------------------------------
// Parent side

// pdStart starts a child.
func pdStart(t testing.TB, args map[string]string) *proctest.Child {
	t.Helper()
	c, _ := startChild(t, proctest.Config{TestName: pdChildTest, Role: "peerdeath", Args: args})
	return c
}

// pdExpectLine waits for the child to print want (or a line starting with
// want followed by a space).
func pdExpectLine(t testing.TB, c *proctest.Child, want string) string {
	t.Helper()
	for {
		line, err := c.ReadLine(30 * time.Second)
		if err != nil {
			t.Fatalf("waiting for %q: %v\n%s", want, err, c.Output())
		}
		if line == want || strings.HasPrefix(line, want+" ") {
			return line
		}
	}
}

// pdCall is a call running in its own goroutine.
type pdCall struct {
	name string
	done chan struct{}
	err  error
	at   time.Time
}

func pdGo(name string, fn func() error) *pdCall {
	c := &pdCall{name: name, done: make(chan struct{})}
	go func() {
		c.err = fn()
		c.at = time.Now()
		close(c.done)
	}()
	return c
}

// pdLatencies collects error latencies of all tests, for the summary.
var pdLatencies struct {
	sync.Mutex
	d []time.Duration
}

// pdKill kills c while the calls are blocked (checking they are), then
// checks that each fails within pdBound with an error for which ok holds,
// and returns the largest latency, measured from the kill.
func pdKill(t testing.TB, c *proctest.Child, ok func(error) bool, calls ...*pdCall) time.Duration {
	t.Helper()
	for _, call := range calls {
		select {
		case <-call.done:
			t.Fatalf("%s returned before the peer was killed: %v", call.name, call.err)
		default:
		}
	}
	killed := time.Now()
	if err := c.Kill(); err != nil {
		t.Fatal(err)
	}
	var worst time.Duration
	for _, call := range calls {
		select {
		case <-call.done:
		case <-time.After(pdBound + 8*time.Second):
			t.Fatalf("%s still blocked %v after the peer was killed", call.name, pdBound+8*time.Second)
		}
		lat := call.at.Sub(killed)
		worst = max(worst, lat)
		if lat > pdBound {
			t.Errorf("%s failed %v after the peer was killed, want <= %v", call.name, lat, pdBound)
		}
		if call.err == nil || !ok(call.err) {
			t.Errorf("%s after the peer was killed: %v", call.name, call.err)
		}
	}
	<-c.Done()
	t.Logf("blocked calls failed at most %v after SIGKILL (%d calls)", worst.Round(10*time.Microsecond), len(calls))
	pdLatencies.Lock()
	pdLatencies.d = append(pdLatencies.d, worst)
	pdLatencies.Unlock()
	return worst
}

func pdSessionGone(err error) bool { return errors.Is(err, ErrSessionClosed) }

func pdHandshakeFailed(err error) bool { return errors.Is(err, ErrHandshake) }

// pdGoroutines waits until no more goroutines run than base, and reports
// the shmipc ones otherwise.
func pdGoroutines(t testing.TB, base int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		n := runtime.NumGoroutine()
		if n <= base {
			return
		}
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			var ours []string
			for _, g := range strings.Split(string(buf), "\n\n") {
				if strings.Contains(g, "shmipc.(*") || strings.Contains(g, "shmipc.pd") {
					ours = append(ours, g)
				}
			}
			t.Errorf("%d goroutines 5s after the test, %d before; shmipc ones:\n%s", n, base, strings.Join(ours, "\n\n"))
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// pdLeakCheck takes the baseline and returns the check to run at the end.
func pdLeakCheck(t *testing.T, prefix string) func(what string) {
	base := clBaseline(t, prefix)
	g := runtime.NumGoroutine()
	return func(what string) {
		t.Helper()
		clCheckBack(t, what, base, prefix)
		pdGoroutines(t, g)
	}
}

// pdArgs builds the child's arguments.
func pdArgs(sock, prefix string, mode MemMapType, side, behavior, conf string, kv ...string) map[string]string {
	m := map[string]string{"SOCK": sock, "PREFIX": prefix, "MODE": mode.String(), "SIDE": side, "BEHAVIOR": behavior, "CONF": conf, "NSTREAMS": "1"}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return m
}

// pdPeer is the parent's end of a session with a child.
type pdPeer struct {
	c       *proctest.Child
	sess    *Session
	streams []*Stream
	raw     net.Listener // the parent's listener when the child is the client
}

// pdConnect starts a child on side ("server": the parent dials it;
// "client": it dials the parent) running behavior on nstreams streams, and
// sets up the parent's session and streams (hello sent or read).
func pdConnect(t *testing.T, side, behavior, conf string, mode MemMapType, prefix string, nstreams int) *pdPeer {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "s.sock")
	p := &pdPeer{}
	args := pdArgs(sock, prefix, mode, side, behavior, conf, "NSTREAMS", strconv.Itoa(nstreams))
	if side == "server" {
		p.c = pdStart(t, args)
		sess, err := Dial("unix", sock, pdConfig(conf, mode, prefix))
		if err != nil {
			t.Fatalf("dial the child: %v\n%s", err, p.c.Output())
		}
		p.sess = sess
		for range nstreams {
			st, err := sess.OpenStream()
			if err != nil {
				t.Fatal(err)
			}
			if _, err := st.Write(pdHello); err != nil {
				t.Fatal(err)
			}
			p.streams = append(p.streams, st)
		}
		return p
	}
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	p.raw = ln
	p.c = proctest.Start(t, proctest.Config{TestName: pdChildTest, Role: "peerdeath", Args: args})
	ln.(*net.UnixListener).SetDeadline(time.Now().Add(childStartTimeout)) // a child that fails never dials
	conn, err := ln.Accept()
	if err != nil {
		t.Fatalf("the child did not dial: %v\n%s", err, p.c.Output())
	}
	if p.sess, err = Server(conn, pdConfig(conf, mode, prefix)); err != nil {
		t.Fatalf("server handshake: %v\n%s", err, p.c.Output())
	}
	for range nstreams {
		st, err := p.sess.AcceptStream()
		if err != nil {
			t.Fatal(err)
		}
		st.SetReadDeadline(time.Now().Add(30 * time.Second))
		hello := make([]byte, len(pdHello))
		if _, err := io.ReadFull(st, hello); err != nil {
			t.Fatal(err)
		}
		st.SetReadDeadline(time.Time{})
		p.streams = append(p.streams, st)
	}
	if _, err := p.c.WaitReady(childStartTimeout); err != nil {
		t.Fatalf("%v\n%s", err, p.c.Output())
	}
	return p
}

// close closes the parent's streams, session and listener.
func (p *pdPeer) close() {
	for _, st := range p.streams {
		st.Close()
	}
	p.sess.Close()
	if p.raw != nil {
		p.raw.Close()
	}
}

// pdFresh checks that a new session to a new child works: the parent dials
// a new echo server child and runs two round trips.
func pdFresh(t *testing.T, mode MemMapType, prefix string) {
	t.Helper()
	p := pdConnect(t, "server", "echo", "default", mode, prefix, 1)
	st := p.streams[0]
	st.SetDeadline(time.Now().Add(30 * time.Second))
	for i, n := range []int{64, 300000} {
		if err := mpRoundTrip(st, mpPayload(n, uint64(i)), i == 1); err != nil {
			t.Errorf("fresh session after the peer's death: %v", err)
		}
	}
	p.close()
	if err := p.c.Stop(30 * time.Second); err != nil {
		t.Errorf("fresh child: %v\n%s", err, p.c.Output())
	}
}

// pdFreshAfter registers, at the start of a top-level test, a check that
// runs after its subtests: a new session to a new child works, in each
// mode, and nothing leaked.
func pdFreshAfter(t *testing.T, modes ...MemMapType) {
	prefix := shmPrefix(t, "pdf")
	check := pdLeakCheck(t, prefix)
	t.Cleanup(func() {
		if t.Failed() {
			return
		}
		for _, mode := range modes {
			pdFresh(t, mode, prefix)
		}
		check("after the fresh sessions")
	})
}

// pdBlockedRead is a Read on st as a pdCall.
func pdBlockedRead(st *Stream) *pdCall {
	return pdGo(fmt.Sprintf("Read on stream %d", st.ID()), func() error {
		_, err := st.Read(make([]byte, 64))
		return err
	})
}

// TestPeerDeathHandshake kills a child stalled in the handshake, as a raw
// server or client, and checks the parent's Dial, Server or Listener.
func TestPeerDeathHandshake(t *testing.T) {
	if proctest.IsChild() {
		t.Skip()
	}
	pdFreshAfter(t, MemMapTypeMemFd, MemMapTypeDevShmFile)
	for _, stage := range []string{"accept", "exchange", "ackfd"} {
		t.Run("child-server/"+stage, func(t *testing.T) {
			prefix := shmPrefix(t, "pd")
			check := pdLeakCheck(t, prefix)
			sock := filepath.Join(t.TempDir(), "s.sock")
			c := pdStart(t, pdArgs(sock, prefix, MemMapTypeMemFd, "raw-server", "", "default", "STAGE", stage))
			dial := pdGo("Dial", func() error {
				s, err := Dial("unix", sock, pdConfig("default", MemMapTypeMemFd, prefix))
				if err == nil {
					s.Close()
				}
				return err
			})
			pdExpectLine(t, c, "stalled")
			waitBlocked(t, "(*Session).runHandshake", 1) // Dial waits for the server
			pdKill(t, c, pdHandshakeFailed, dial)
			check("after the killed handshake")
		})
	}
	// File mode has no answer to wait for: the session is up at once, and
	// the dead server's death ends it.
	t.Run("child-server/accept/file", func(t *testing.T) {
		prefix := shmPrefix(t, "pd")
		check := pdLeakCheck(t, prefix)
		sock := filepath.Join(t.TempDir(), "s.sock")
		c := pdStart(t, pdArgs(sock, prefix, MemMapTypeDevShmFile, "raw-server", "", "default", "STAGE", "accept"))
		sess, err := Dial("unix", sock, pdConfig("default", MemMapTypeDevShmFile, prefix))
		if err != nil {
			t.Fatal(err)
		}
		st, err := sess.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Write([]byte("hello")); err != nil {
			t.Fatal(err)
		}
		pdExpectLine(t, c, "stalled")
		read := pdBlockedRead(st)
		waitBlocked(t, "(*Stream).awaitReadable", 1)
		pdKill(t, c, pdSessionGone, read)
		st.Close()
		sess.Close()
		check("after the killed file-mode server")
	})
	for _, stage := range []string{"exchange", "paths", "partial", "mapped"} {
		t.Run("child-client/"+stage, func(t *testing.T) {
			prefix := shmPrefix(t, "pd")
			check := pdLeakCheck(t, prefix)
			sock := filepath.Join(t.TempDir(), "s.sock")
			raw, err := net.Listen("unix", sock)
			if err != nil {
				t.Fatal(err)
			}
			defer raw.Close()
			conf := pdConfig("default", MemMapTypeMemFd, prefix)
			sessCh := make(chan *Session, 1)
			call := pdGo("Server", func() error {
				conn, err := raw.Accept()
				if err != nil {
					return err
				}
				s, err := Server(conn, conf)
				if err != nil {
					return err
				}
				sessCh <- s
				return nil
			})
			c := proctest.Start(t, proctest.Config{TestName: pdChildTest, Role: "peerdeath",
				Args: pdArgs(sock, prefix, MemMapTypeMemFd, "raw-client", "", "default", "STAGE", stage)})
			pdExpectLine(t, c, "stalled")
			if stage == "mapped" {
				<-call.done
				if call.err != nil {
					t.Fatalf("handshake with the raw client: %v", call.err)
				}
				s := <-sessCh
				acc := pdGo("AcceptStream", func() error { _, err := s.AcceptStream(); return err })
				waitBlocked(t, "(*streamQueue).pop", 1)
				pdKill(t, c, pdSessionGone, acc)
				s.Close()
			} else {
				waitBlocked(t, "(*Session).runHandshake", 1) // Server waits for the client
				pdKill(t, c, pdHandshakeFailed, call)
			}
			raw.Close()
			check("after the killed client handshake")
		})
	}
	// A Listener runs handshakes on its own goroutines: the one of a killed
	// client must end, and the listener must keep serving.
	t.Run("listener/exchange", func(t *testing.T) {
		prefix := shmPrefix(t, "pd")
		check := pdLeakCheck(t, prefix)
		sock := filepath.Join(t.TempDir(), "s.sock")
		ln, err := Listen("unix", sock, pdConfig("default", MemMapTypeMemFd, prefix))
		if err != nil {
			t.Fatal(err)
		}
		c := proctest.Start(t, proctest.Config{TestName: pdChildTest, Role: "peerdeath",
			Args: pdArgs(sock, prefix, MemMapTypeMemFd, "raw-client", "", "default", "STAGE", "exchange")})
		pdExpectLine(t, c, "stalled")
		var pending int
		for range 100 {
			ln.mu.Lock()
			pending = len(ln.pending)
			ln.mu.Unlock()
			if pending > 0 {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		if pending != 1 {
			t.Fatalf("listener has %d pending handshakes, want 1", pending)
		}
		killed := time.Now()
		c.Kill()
		for {
			ln.mu.Lock()
			pending = len(ln.pending)
			ln.mu.Unlock()
			if pending == 0 {
				break
			}
			if time.Since(killed) > pdBound {
				t.Fatalf("listener still has %d pending handshakes %v after the client was killed", pending, pdBound)
			}
			time.Sleep(time.Millisecond)
		}
		t.Logf("pending handshake dropped %v after SIGKILL", time.Since(killed).Round(10*time.Microsecond))
		<-c.Done()
		// The same listener serves a new client.
		c2 := proctest.Start(t, proctest.Config{TestName: pdChildTest, Role: "peerdeath",
			Args: pdArgs(sock, prefix, MemMapTypeMemFd, "client", "echo", "default")})
		st := acceptWithin(t, ln, 10*time.Second)
		st.SetDeadline(time.Now().Add(30 * time.Second))
		hello := make([]byte, len(pdHello))
		if _, err := io.ReadFull(st, hello); err != nil {
			t.Fatal(err)
		}
		// The child serves the echo on the stream it opened.
		if err := mpRoundTrip(st, mpPayload(1000, 5), false); err != nil {
			t.Errorf("fresh client on the listener: %v", err)
		}
		st.Close()
		if err := c2.Stop(30 * time.Second); err != nil {
			t.Errorf("fresh child: %v\n%s", err, c2.Output())
		}
		ln.Close()
		check("after the killed client handshake on a listener")
	})
}

// TestPeerDeathMidWrite kills a child that streams large messages on four
// streams while the parent reads and verifies them.
func TestPeerDeathMidWrite(t *testing.T) {
	if proctest.IsChild() {
		t.Skip()
	}
	pdFreshAfter(t, MemMapTypeMemFd, MemMapTypeDevShmFile)
	for _, tc := range []struct {
		side string
		mode MemMapType
	}{{"server", MemMapTypeMemFd}, {"server", MemMapTypeDevShmFile}, {"client", MemMapTypeMemFd}, {"client", MemMapTypeDevShmFile}} {
		t.Run("child-"+tc.side+"/"+tc.mode.String(), func(t *testing.T) {
			prefix := shmPrefix(t, "pd")
			check := pdLeakCheck(t, prefix)
			p := pdConnect(t, tc.side, "stream", "default", tc.mode, prefix, 4)
			var calls []*pdCall
			var verified sync.Map
			for _, st := range p.streams {
				calls = append(calls, pdGo(fmt.Sprintf("reader of stream %d", st.ID()), func() error {
					r := &skReader{st: st, rng: rand.New(rand.NewPCG(uint64(st.ID()), 0))}
					for {
						if _, _, err := r.next(); err != nil {
							verified.Store(st.ID(), r.seq)
							if errors.Is(err, errSkCorrupt) {
								t.Errorf("%v", err)
							}
							return err
						}
					}
				}))
			}
			pdExpectLine(t, p.c, "streaming")
			// Killed at a random moment of the streaming: 20-100 ms in,
			// 10-40 ms with -short.
			time.Sleep(shortOr(time.Duration(20+rand.IntN(80)), time.Duration(10+rand.IntN(30))) * time.Millisecond)
			pdKill(t, p.c, pdSessionGone, calls...)
			var msgs []string
			verified.Range(func(k, v any) bool { msgs = append(msgs, fmt.Sprintf("stream %v: %v", k, v)); return true })
			t.Logf("messages verified before the death: %s", strings.Join(msgs, ", "))
			// Writes on the dead session fail at once.
			if _, err := p.streams[0].Write([]byte("x")); !errors.Is(err, ErrSessionClosed) {
				t.Errorf("Write after the peer died: %v, want ErrSessionClosed", err)
			}
			p.close()
			check("after killing a streaming child")
		})
	}
}

// TestPeerDeathHoldingSlices: the child reads 8 messages with ReadBytes and
// never releases them, sends 8 back, and is killed while the parent holds
// those (read with ReadBytes) and is blocked in a read. The bytes the parent
// holds must stay intact after the death, until it closes the stream.
func TestPeerDeathHoldingSlices(t *testing.T) {
	if proctest.IsChild() {
		t.Skip()
	}
	pdFreshAfter(t, MemMapTypeMemFd, MemMapTypeDevShmFile)
	for _, tc := range []struct {
		side string
		mode MemMapType
	}{{"server", MemMapTypeMemFd}, {"client", MemMapTypeMemFd}, {"client", MemMapTypeDevShmFile}} {
		t.Run("child-"+tc.side+"/"+tc.mode.String(), func(t *testing.T) {
			prefix := shmPrefix(t, "pd")
			check := pdLeakCheck(t, prefix)
			p := pdConnect(t, tc.side, "hold", "default", tc.mode, prefix, 1)
			st := p.streams[0]
			rng := rand.New(rand.NewPCG(1, 2))
			for i := range 8 {
				if err := skSend(st, uint32(i), skBody(rng, 100<<10), 0, skViaWriteBytes, nil); err != nil {
					t.Fatal(err)
				}
			}
			line := pdExpectLine(t, p.c, "held")
			r := &skReader{st: st, hold: true, rng: rand.New(rand.NewPCG(5, 6))}
			for range 8 {
				if _, _, err := r.next(); err != nil {
					t.Fatal(err)
				}
			}
			// The held slices, as the reader sees them: re-read through the
			// zero-copy segments before and after the death.
			snapshot := func() [][]byte {
				st.mu.Lock()
				defer st.mu.Unlock()
				var out [][]byte
				for _, seg := range st.reader.segs[:st.reader.done] {
					out = append(out, seg.data)
				}
				return out
			}
			before := snapshot()
			var beforeCopy [][]byte
			for _, b := range before {
				beforeCopy = append(beforeCopy, slices.Clone(b))
			}
			t.Logf("child: %s; parent holds %d segments", line, len(before))
			read := pdGo("ReadBytes", func() error { _, err := st.BufferReader().ReadBytes(1); return err })
			waitBlocked(t, "(*Stream).awaitReadable", 1)
			pdKill(t, p.c, pdSessionGone, read)
			for i, b := range before {
				if string(b) != string(beforeCopy[i]) {
					t.Errorf("held segment %d changed after the peer's death", i)
				}
			}
			if _, ours, _ := clMaps("self", prefix); len(ours) == 0 && tc.mode == MemMapTypeDevShmFile {
				t.Errorf("the region is unmapped while the stream still holds slices")
			}
			p.close()
			check("after killing a child holding slices")
		})
	}
}

// TestPeerDeathBlockedWriter stops the child (SIGSTOP: it reads nothing any
// more, not even its queue) while the parent writes with a small
// configuration (16-element queue, 1 MiB region), so the parent's writes
// block: on the full queue (small messages) or on the full region and then
// the full socket (large messages, as fallback data). Then the child is
// killed.
func TestPeerDeathBlockedWriter(t *testing.T) {
	if proctest.IsChild() {
		t.Skip()
	}
	if testing.Short() {
		t.Skip("-short: waits out write timeouts")
	}
	pdFreshAfter(t, MemMapTypeMemFd)
	for _, tc := range []struct {
		side, what string
		size       int
		fallback   bool
	}{
		{"server", "queue-full", 64, false},
		{"client", "queue-full", 64, false},
		{"server", "region-full", 100 << 10, false},
		{"server", "socket-full", 100 << 10, true},
		{"client", "socket-full", 100 << 10, true},
	} {
		t.Run("child-"+tc.side+"/"+tc.what, func(t *testing.T) {
			prefix := shmPrefix(t, "pd")
			check := pdLeakCheck(t, prefix)
			// With FallbackWhenFull a full region sends fallback data, so
			// the writer ends up blocked on the socket.
			kind := "small"
			if tc.fallback {
				kind = "small-fwf"
			}
			p := pdConnect(t, tc.side, "sink", kind, MemMapTypeMemFd, prefix, 2)
			if err := p.c.Signal(syscall.SIGSTOP); err != nil {
				t.Fatal(err)
			}
			defer p.c.Signal(syscall.SIGCONT)
			time.Sleep(20 * time.Millisecond)
			var calls []*pdCall
			var mu sync.Mutex
			sent := map[uint32]int{}
			for _, st := range p.streams {
				calls = append(calls, pdGo(fmt.Sprintf("writer on stream %d", st.ID()), func() error {
					rng := rand.New(rand.NewPCG(uint64(st.ID()), 1))
					for seq := uint32(0); ; seq++ {
						err := skSend(st, seq, skBody(rng, tc.size), 0, skViaWriteBytes, nil)
						if err != nil {
							return err
						}
						mu.Lock()
						sent[st.ID()]++
						mu.Unlock()
					}
				}))
				calls = append(calls, pdBlockedRead(st))
			}
			// Wait until the writers are stuck: nothing sent for 300 ms.
			last, stuckSince := -1, time.Now()
			for time.Since(stuckSince) < 300*time.Millisecond {
				time.Sleep(20 * time.Millisecond)
				mu.Lock()
				n := 0
				for _, v := range sent {
					n += v
				}
				mu.Unlock()
				if n != last {
					last, stuckSince = n, time.Now()
				}
			}
			t.Logf("writers stuck after %d messages of %d bytes", last, tc.size)
			pdKill(t, p.c, pdSessionGone, calls...)
			p.close()
			check("after killing a stopped child")
		})
	}
}

// TestPeerDeathKillLoop kills the child -peerdeath.kills times (100 by
// default) at a random point 0-50 ms into a workload of 1-6 streams each
// sending checksummed messages of 1 B to 1 MiB in both directions. The
// child is the server in even iterations and the client in odd ones, in
// memfd or file mode by turns.
func TestPeerDeathKillLoop(t *testing.T) {
	if proctest.IsChild() {
		t.Skip()
	}
	prefix := shmPrefix(t, "pdl")
	check := pdLeakCheck(t, prefix)
	start := time.Now()
	var lats, afterClose []time.Duration
	survived := 0
	// With -short, 8 kills: each side in each mode still killed twice.
	kills := shortOr(*pdKills, min(*pdKills, 8))
	for i := range kills {
		side := "server"
		if i%2 == 1 {
			side = "client"
		}
		mode := bothModes[(i/2)%2]
		ok := t.Run(fmt.Sprintf("%d", i), func(t *testing.T) {
			nstreams := 1 + rand.IntN(6)
			p := pdConnect(t, side, "mixed", "default", mode, prefix, nstreams)
			var calls []*pdCall
			for _, st := range p.streams {
				werr := make(chan error, 1)
				calls = append(calls, pdGo(fmt.Sprintf("reader of stream %d", st.ID()), func() error {
					err := pdMixed(st, rand.Uint64(), 1<<20, werr)
					if errors.Is(err, errSkCorrupt) {
						t.Errorf("%v", err)
					}
					return err
				}))
				calls = append(calls, pdGo(fmt.Sprintf("writer of stream %d", st.ID()), func() error { return <-werr }))
			}
			if side == "client" {
				calls = append(calls, pdGo("AcceptStream", func() error { _, err := p.sess.AcceptStream(); return err }))
			}
			time.Sleep(time.Duration(rand.IntN(51)) * time.Millisecond)
			// Note when the session sees the death (the socket closed and
			// the receive loop read EOF): the kill-to-error latency also
			// holds the kernel's teardown of the child, which for a -race
			// binary under load is most of it.
			seen := make(chan time.Time, 1)
			stop := make(chan struct{})
			go func() {
				for !p.sess.IsClosed() {
					select {
					case <-stop:
						return
					default:
					}
					time.Sleep(100 * time.Microsecond)
				}
				seen <- time.Now()
			}()
			lat := pdKillQuiet(t, p.c, calls...)
			close(stop)
			var last time.Time
			for _, call := range calls {
				if call.at.After(last) {
					last = call.at
				}
			}
			select {
			case at := <-seen:
				afterClose = append(afterClose, max(last.Sub(at), 0))
			case <-time.After(pdBound):
				t.Errorf("session not closed %v after the peer was killed", pdBound)
			}
			lats = append(lats, lat)
			p.close()
		})
		if !ok {
			break
		}
		survived++
	}
	pdFresh(t, MemMapTypeMemFd, prefix)
	pdFresh(t, MemMapTypeDevShmFile, prefix)
	check("after the kill loop")
	slices.Sort(lats)
	slices.Sort(afterClose)
	if len(afterClose) > 0 {
		t.Logf("kill loop: last blocked call failed after the session saw the closed socket: median %v, max %v",
			afterClose[len(afterClose)/2].Round(10*time.Microsecond), afterClose[len(afterClose)-1].Round(10*time.Microsecond))
	}
	if len(lats) > 0 {
		t.Logf("kill loop: %d/%d kills survived in %v; error latency after SIGKILL: median %v, p90 %v, max %v",
			survived, kills, time.Since(start).Round(time.Millisecond), lats[len(lats)/2].Round(10*time.Microsecond),
			lats[len(lats)*9/10].Round(10*time.Microsecond), lats[len(lats)-1].Round(10*time.Microsecond))
	}
}

// pdKillQuiet is pdKill without the per-call blocking check (the workload's
// calls are busy, not blocked) and without logging.
func pdKillQuiet(t *testing.T, c *proctest.Child, calls ...*pdCall) time.Duration {
	t.Helper()
	killed := time.Now()
	if err := c.Kill(); err != nil {
		t.Fatal(err)
	}
	var worst time.Duration
	for _, call := range calls {
		select {
		case <-call.done:
		case <-time.After(pdBound + 8*time.Second):
			t.Fatalf("%s still running %v after the peer was killed", call.name, pdBound+8*time.Second)
		}
		lat := max(call.at.Sub(killed), 0)
		worst = max(worst, lat)
		if lat > pdBound {
			t.Errorf("%s failed %v after the peer was killed, want <= %v", call.name, lat, pdBound)
		}
		if !pdSessionGone(call.err) {
			t.Errorf("%s: %v, want an error wrapping ErrSessionClosed", call.name, call.err)
		}
	}
	<-c.Done()
	return worst
}

package shmipc

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	shm "github.com/goshm/shmipc"
	"github.com/goshm/shmipc/internal/proctest"
)

// countingMonitor sums the reports a Monitor receives.
type countingMonitor struct {
	mu                  sync.Mutex
	reports, flushes    int
	inBytes, outBytes   uint64
	maxActive           uint64
	capacity            uint64
	restarts, restartKO uint64
	sessions            map[string]bool
}

func (m *countingMonitor) OnEmitSessionMetrics(p PerformanceMetrics, s StabilityMetrics, sh ShareMemoryMetrics, sess *Session) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.reports++
	m.inBytes += p.InFlowBytes
	m.outBytes += p.OutFlowBytes
	m.maxActive = max(m.maxActive, s.ActiveStreamCount)
	m.capacity = max(m.capacity, sh.CapacityOfShareMemoryInBytes)
	m.restarts += s.HotRestartSuccessCount
	m.restartKO += s.HotRestartErrorCount
	if m.sessions == nil {
		m.sessions = map[string]bool{}
	}
	m.sessions[sess.ID()] = true
}

func (m *countingMonitor) Flush() error {
	m.mu.Lock()
	m.flushes++
	m.mu.Unlock()
	return nil
}

func (m *countingMonitor) String() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return fmt.Sprintf("reports=%d flushes=%d in=%d out=%d maxactive=%d capacity=%d sessions=%d",
		m.reports, m.flushes, m.inBytes, m.outBytes, m.maxActive, m.capacity, len(m.sessions))
}

// cbServer is a ListenCallback whose streams answer requests in OnData.
type cbServer struct {
	newStreams, remote, local, requests atomic.Int64
	problems                            chan string
	shutdown                            chan string
}

func newCBServer() *cbServer {
	return &cbServer{problems: make(chan string, 16), shutdown: make(chan string, 1)}
}

func (l *cbServer) OnNewStream(s *Stream) {
	l.newStreams.Add(1)
	if err := s.SetCallbacks(&cbStream{l: l, st: s}); err != nil {
		l.problems <- "SetCallbacks: " + err.Error()
		return
	}
	if err := s.SetCallbacks(&cbStream{l: l, st: s}); err != ErrStreamCallbackHadExisted {
		l.problems <- fmt.Sprintf("second SetCallbacks: %v", err)
	}
}

func (l *cbServer) OnShutdown(reason string) { l.shutdown <- reason }

// cbStream answers each complete request it finds, leaving an incomplete
// one for the next call.
type cbStream struct {
	l  *cbServer
	st *Stream
}

func (c *cbStream) OnData(r BufferReader) {
	for r.Len() >= 4 {
		h, err := r.Peek(4)
		if err != nil {
			c.l.problems <- "Peek: " + err.Error()
			return
		}
		n := int(binary.BigEndian.Uint32(h))
		if r.Len() < 4+n {
			return // the rest comes later
		}
		if _, err := r.Discard(4); err != nil {
			c.l.problems <- "Discard: " + err.Error()
			return
		}
		body, err := r.ReadBytes(n)
		if err != nil {
			c.l.problems <- "ReadBytes: " + err.Error()
			return
		}
		if err := reply(c.st, body); err != nil {
			c.l.problems <- "reply: " + err.Error()
			return
		}
		c.l.requests.Add(1)
	}
}

func (c *cbStream) OnLocalClose()  { c.l.local.Add(1) }
func (c *cbStream) OnRemoteClose() { c.l.remote.Add(1) }

// TestCompatChild is the body of the child processes; in a normal run it
// skips itself.
func TestCompatChild(t *testing.T) {
	switch proctest.Role() {
	case "":
		t.Skip("runs only as a child process of this package's tests")
	case "sync-server":
		childSyncServer(t)
	case "callback-server":
		childCallbackServer(t)
	case "root-server":
		conf, err := rootConfig(testConfig(proctest.MustArg(t, "PREFIX")))
		if err != nil {
			t.Fatal(err)
		}
		ln, err := shm.Listen("unix", proctest.MustArg(t, "SOCK"), conf)
		if err != nil {
			t.Fatal(err)
		}
		go ln.Serve(rootServe)
		proctest.Ready()
		<-proctest.StdinClosed()
		ln.CloseAll()
	case "hr-server":
		childHotRestartServer(t)
	default:
		t.Fatalf("unknown role %q", proctest.Role())
	}
}

// childSyncServer serves requests the shmipc-go synchronous way: Server on
// each accepted connection, AcceptStream in a loop, a goroutine per
// stream. When stdin closes it waits for its sessions to end and prints
// "served <requests> <bytes> <monitor>".
func childSyncServer(t *testing.T) {
	monitorInterval.Store(int64(50 * time.Millisecond))
	conf := testConfig(proctest.MustArg(t, "PREFIX"))
	mon := &countingMonitor{}
	conf.Monitor = mon
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: proctest.MustArg(t, "SOCK"), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	var requests, bytes atomic.Int64
	var mu sync.Mutex
	var sessions []*Session
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			sess, err := Server(conn, conf)
			if err != nil {
				t.Errorf("Server: %v", err)
				continue
			}
			if sess.IsClient() {
				t.Errorf("a server session says IsClient")
			}
			mu.Lock()
			sessions = append(sessions, sess)
			mu.Unlock()
			go func() {
				for {
					st, err := sess.AcceptStream()
					if err != nil {
						return
					}
					if st.Session() != sess {
						t.Errorf("Stream.Session is not the session that accepted it")
					}
					go func() {
						defer st.Close()
						for {
							n, err := serveRequest(st, st.BufferReader())
							if err != nil {
								if err != ErrEndOfStream && err != ErrSessionShutdown {
									t.Errorf("serving: %v", err)
								}
								if st.IsOpen() {
									t.Errorf("IsOpen after the stream ended (%v)", err)
								}
								return
							}
							requests.Add(1)
							bytes.Add(int64(n))
						}
					}()
				}
			}()
		}
	}()
	proctest.Ready()
	<-proctest.StdinClosed()
	ln.Close()
	mu.Lock()
	defer mu.Unlock()
	for _, s := range sessions {
		select {
		case <-s.CloseChan():
		case <-time.After(10 * time.Second):
			t.Errorf("session %s still open", s.ID())
		}
	}
	proctest.Println(fmt.Sprintf("served %d %d %s", requests.Load(), bytes.Load(), mon))
}

// childCallbackServer serves requests the shmipc-go callback way:
// NewListener, Run, SetCallbacks. When stdin closes it closes the listener
// and prints "callbacks new=... remote=... local=... requests=...
// shutdown=...", after any problems its callbacks saw.
func childCallbackServer(t *testing.T) {
	conf := NewDefaultListenerConfig(proctest.MustArg(t, "SOCK"), "unix")
	conf.Config = testConfig(proctest.MustArg(t, "PREFIX"))
	cb := newCBServer()
	ln, err := NewListener(cb, conf)
	if err != nil {
		t.Fatal(err)
	}
	ran := make(chan error, 1)
	go func() { ran <- ln.Run() }()
	proctest.Ready()
	<-proctest.StdinClosed()
	if err := ln.Close(); err != nil {
		t.Error(err)
	}
	if err := <-ran; err != nil {
		t.Errorf("Run: %v", err)
	}
	close(cb.problems)
	for p := range cb.problems {
		t.Error(p)
	}
	proctest.Println(fmt.Sprintf("callbacks new=%d remote=%d local=%d requests=%d shutdown=%q",
		cb.newStreams.Load(), cb.remote.Load(), cb.local.Load(), cb.requests.Load(), <-cb.shutdown))
}

// childHotRestartServer is a callback server that, on SIGUSR1, runs
// HotRestart(EPOCH), waits for IsHotRestartDone and prints "hotrestart
// done" (or why not), closes its listener and prints "closed". When stdin
// closes it prints "served <requests>".
func childHotRestartServer(t *testing.T) {
	epoch, err := strconv.ParseUint(proctest.MustArg(t, "EPOCH"), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	usr1 := make(chan os.Signal, 1)
	signal.Notify(usr1, syscall.SIGUSR1)
	defer signal.Stop(usr1)
	conf := NewDefaultListenerConfig(proctest.MustArg(t, "SOCK"), "unix")
	conf.Config = testConfig(proctest.MustArg(t, "PREFIX"))
	cb := newCBServer()
	ln, err := NewListener(cb, conf)
	if err != nil {
		t.Fatal(err)
	}
	go ln.Run()
	if ln.IsHotRestartDone() {
		t.Error("IsHotRestartDone before any HotRestart")
	}
	proctest.Ready()
	for {
		select {
		case <-usr1:
			err := ln.HotRestart(epoch)
			for try := 0; errors.Is(err, ErrInHandshakeStage) && try < 50; try++ {
				time.Sleep(20 * time.Millisecond)
				err = ln.HotRestart(epoch)
			}
			deadline := time.Now().Add(5 * time.Second)
			for err == nil && !ln.IsHotRestartDone() && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
			switch {
			case err != nil:
				proctest.Println("hotrestart failed: " + err.Error())
			case !ln.IsHotRestartDone():
				proctest.Println("hotrestart not done after 5 s")
			default:
				proctest.Println("hotrestart done")
			}
			ln.Close()
			proctest.Println("closed")
		case <-proctest.StdinClosed():
			ln.Close()
			proctest.Println(fmt.Sprintf("served %d", cb.requests.Load()))
			return
		}
	}
}

package shmipc

import (
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	shm "github.com/goshm/shmipc"
)

// runRequests runs workers goroutines that each send n requests of
// varied sizes through sm (GetStream, request, PutBack). It returns the
// request bytes sent (with their length fields) and the distinct stream
// ids used.
func runRequests(t *testing.T, sm *SessionManager, workers, n int) (sent int, ids map[uint32]bool) {
	t.Helper()
	var mu sync.Mutex
	ids = map[uint32]bool{}
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range n {
				size := []int{1, 100, 4000, 20000, 70000, 200000}[(w+i)%6]
				st, err := sm.GetStream()
				if err != nil {
					t.Errorf("GetStream: %v", err)
					return
				}
				st.SetDeadline(time.Now().Add(10 * time.Second))
				if err := request(st, payload(size, uint64(w*1000+i))); err != nil {
					t.Errorf("request of %d bytes: %v", size, err)
					st.Close()
					return
				}
				mu.Lock()
				ids[st.StreamID()] = true
				sent += 4 + size
				mu.Unlock()
				sm.PutBack(st)
			}
		})
	}
	wg.Wait()
	return sent, ids
}

// TestSyncServerProcess: a SessionManager client with a Monitor against a
// synchronous server (Server, AcceptStream) in another process; the
// streams are pooled, every request is answered, and the monitors of both
// sides see every byte.
func TestSyncServerProcess(t *testing.T) {
	monitorInterval.Store(int64(50 * time.Millisecond))
	defer monitorInterval.Store(int64(30 * time.Second))
	prefix := testPrefix(t)
	sock := filepath.Join(t.TempDir(), "s.sock")
	child, _ := startChild(t, "sync-server", map[string]string{"SOCK": sock, "PREFIX": prefix})

	conf := DefaultSessionManagerConfig()
	conf.Config = testConfig(prefix)
	mon := &countingMonitor{}
	conf.Monitor = mon
	conf.Address = sock
	conf.SessionNum = 2
	sm, err := NewSessionManager(conf)
	if err != nil {
		t.Fatal(err)
	}
	const workers, n = 4, 60
	sent, ids := runRequests(t, sm, workers, n)
	if len(ids) > 2*workers {
		t.Errorf("%d streams for %d requests from %d goroutines: PutBack did not pool them", len(ids), workers*n, workers)
	}
	st, err := sm.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	if !st.Session().IsClient() || !st.Session().IsHealthy() || !st.IsOpen() {
		t.Errorf("a new stream: IsClient %v, IsHealthy %v, IsOpen %v", st.Session().IsClient(), st.Session().IsHealthy(), st.IsOpen())
	}
	if n := st.Session().GetActiveStreamCount(); n < 1 {
		t.Errorf("GetActiveStreamCount = %d with a stream open", n)
	}
	sm.PutBack(st)
	if err := sm.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := sm.GetStream(); err != ErrSessionShutdown {
		t.Errorf("GetStream after Close: %v, want ErrSessionShutdown", err)
	}
	select {
	case <-st.Session().CloseChan():
	case <-time.After(5 * time.Second):
		t.Fatal("CloseChan of a closed manager's session still open")
	}
	// The last reports come before CloseChan closes.
	mon.mu.Lock()
	ok := mon.outBytes == uint64(sent) && mon.reports > 0 && mon.flushes == mon.reports && mon.capacity == shm.ReferenceBufferCap
	mon.mu.Unlock()
	if !ok {
		t.Errorf("client monitor: %s; want out=%d, capacity %d, a Flush per report", mon, sent, shm.ReferenceBufferCap)
	}

	if err := child.CloseStdin(); err != nil {
		t.Fatal(err)
	}
	line := readLine(t, child, "served ")
	want := fmt.Sprintf("served %d %d ", workers*n+0, sent-4*workers*n)
	if !strings.HasPrefix(line, want) || !strings.Contains(line, fmt.Sprintf(" in=%d ", sent)) {
		t.Errorf("server: %q, want %q... with in=%d", line, want, sent)
	}
	if err := child.Wait(20 * time.Second); err != nil {
		t.Fatalf("server: %v\n%s", err, child.Output())
	}
}

// TestCallbackServerProcess: the global SessionManager against a callback
// server (NewListener, Run, SetCallbacks) in another process. Requests are
// answered from OnData, also with a client that reads its replies with
// callbacks, and the server sees each stream end through OnRemoteClose.
func TestCallbackServerProcess(t *testing.T) {
	prefix := testPrefix(t)
	sock := filepath.Join(t.TempDir(), "s.sock")
	child, _ := startChild(t, "callback-server", map[string]string{"SOCK": sock, "PREFIX": prefix})

	if GlobalSessionManager() != nil {
		t.Fatal("GlobalSessionManager before InitGlobalSessionManager")
	}
	conf := DefaultSessionManagerConfig()
	conf.Config = testConfig(prefix)
	conf.UnixPath = sock // the deprecated field
	conf.Network = ""
	sm, err := InitGlobalSessionManager(conf)
	if err != nil {
		t.Fatal(err)
	}
	// The global manager lives as long as the process; a later run of this
	// test (-count) starts without one.
	t.Cleanup(func() {
		sm.Close()
		global.sm.Store(nil)
	})
	if again, err := InitGlobalSessionManager(conf); again != sm || err != nil || GlobalSessionManager() != sm {
		t.Fatalf("a second InitGlobalSessionManager gave %p, %v; GlobalSessionManager %p; want %p", again, err, GlobalSessionManager(), sm)
	}
	const workers, n = 3, 40
	runRequests(t, GlobalSessionManager(), workers, n)

	// A client stream whose replies arrive through callbacks.
	st, err := GlobalSessionManager().GetStream()
	if err != nil {
		t.Fatal(err)
	}
	cc := &clientCallbacks{replies: make(chan string, 16), closed: make(chan string, 2)}
	if err := st.SetCallbacks(cc); err != nil {
		t.Fatal(err)
	}
	const async = 10
	for i := range async {
		msg := fmt.Sprintf("async %d", i)
		if err := st.BufferWriter().WriteString(string([]byte{0, 0, 0, byte(len(msg))}) + msg); err != nil {
			t.Fatal(err)
		}
		if err := st.Flush(false); err != nil {
			t.Fatal(err)
		}
		select {
		case got := <-cc.replies:
			if got != replyPrefix+msg {
				t.Fatalf("reply %q to %q", got, msg)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("no reply to %q", msg)
		}
	}
	st.Close()
	select {
	case how := <-cc.closed:
		if how != "local" {
			t.Errorf("client callbacks ended with %s close, want local", how)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no OnLocalClose after Close")
	}
	GlobalSessionManager().PutBack(st) // closed: not pooled

	if err := sm.Close(); err != nil {
		t.Fatal(err)
	}
	// Let the server see the sessions end before it closes its listener.
	time.Sleep(200 * time.Millisecond)
	if err := child.CloseStdin(); err != nil {
		t.Fatal(err)
	}
	line := readLine(t, child, "callbacks ")
	var streams, remote, local, requests int
	var reason string
	if _, err := fmt.Sscanf(line, "callbacks new=%d remote=%d local=%d requests=%d shutdown=%q", &streams, &remote, &local, &requests, &reason); err != nil {
		t.Fatalf("%q: %v", line, err)
	}
	if streams < 2 || remote != streams || local != 0 || requests != workers*n+async || reason == "" {
		t.Errorf("server: %q; want every stream (at least 2) closed remotely, %d requests, a shutdown reason", line, workers*n+async)
	}
	if err := child.Wait(20 * time.Second); err != nil {
		t.Fatalf("server: %v\n%s", err, child.Output())
	}
}

// clientCallbacks collects the replies a stream receives.
type clientCallbacks struct {
	replies chan string
	closed  chan string
}

func (c *clientCallbacks) OnData(r BufferReader) {
	for r.Len() >= 4 {
		h, _ := r.Peek(4)
		n := int(h[0])<<24 | int(h[1])<<16 | int(h[2])<<8 | int(h[3])
		if r.Len() < 4+n {
			return
		}
		r.Discard(4)
		s, err := r.ReadString(n)
		if err != nil {
			c.replies <- err.Error()
			return
		}
		c.replies <- s
	}
}

func (c *clientCallbacks) OnLocalClose()  { c.closed <- "local" }
func (c *clientCallbacks) OnRemoteClose() { c.closed <- "remote" }

// TestCompatClientRootServer: a SessionManager of this package against a
// server of the root package in another process.
func TestCompatClientRootServer(t *testing.T) {
	prefix := testPrefix(t)
	sock := filepath.Join(t.TempDir(), "s.sock")
	child, _ := startChild(t, "root-server", map[string]string{"SOCK": sock, "PREFIX": prefix})
	conf := DefaultSessionManagerConfig()
	conf.Config = testConfig(prefix)
	conf.Address = sock
	sm, err := NewSessionManager(conf)
	if err != nil {
		t.Fatal(err)
	}
	defer sm.Close()
	runRequests(t, sm, 2, 30)
	if err := sm.Close(); err != nil {
		t.Fatal(err)
	}
	if err := child.Stop(20 * time.Second); err != nil {
		t.Fatalf("server: %v\n%s", err, child.Output())
	}
}

// TestRootClientCompatServer: a client of the root package against the
// synchronous server of this package in another process, in both mapping
// modes.
func TestRootClientCompatServer(t *testing.T) {
	for _, mode := range []shm.MemMapType{shm.MemMapTypeMemFd, shm.MemMapTypeDevShmFile} {
		t.Run(mode.String(), func(t *testing.T) {
			prefix := testPrefix(t)
			sock := filepath.Join(t.TempDir(), "s.sock")
			child, _ := startChild(t, "sync-server", map[string]string{"SOCK": sock, "PREFIX": prefix})
			rc, err := rootConfig(testConfig(prefix))
			if err != nil {
				t.Fatal(err)
			}
			rc.MemMapType = mode
			sess, err := shm.Dial("unix", sock, rc)
			if err != nil {
				t.Fatal(err)
			}
			sent := 0
			for i := range 3 {
				st, err := sess.OpenStream()
				if err != nil {
					t.Fatal(err)
				}
				for j := range 20 {
					p := payload(1+(i*20+j)*997%150000, uint64(j))
					if err := rootRequest(st, p); err != nil {
						t.Fatal(err)
					}
					sent += len(p)
				}
				st.Close()
			}
			sess.Close()
			if err := child.CloseStdin(); err != nil {
				t.Fatal(err)
			}
			if line := readLine(t, child, "served "); !strings.HasPrefix(line, fmt.Sprintf("served 60 %d ", sent)) {
				t.Errorf("server: %q, want 60 requests of %d bytes", line, sent)
			}
			if err := child.Wait(20 * time.Second); err != nil {
				t.Fatalf("server: %v\n%s", err, child.Output())
			}
		})
	}
}

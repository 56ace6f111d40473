package shmipc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
	"golang.org/x/sys/unix"
)

// ---------------------------------------------------------------------------
// Across processes: old server, new server and client in three processes.

const (
	hrChildTest    = "TestHotRestartChild"
	hrRoleServer   = "hr-server"
	hrChildTimeout = 60 * time.Second
)

// TestHotRestartChild is the body of the server processes: it takes over
// SOCK, serves the echo, and on SIGUSR1 runs HotRestart(EPOCH), prints
// "hotrestart <epoch> ok" or "hotrestart <epoch> <error>", closes its
// listener and prints "closed". It ends when stdin closes.
func TestHotRestartChild(t *testing.T) {
	if proctest.Role() != hrRoleServer {
		t.Skip("runs only as the child process of the hot restart tests")
	}
	conf := smTestConfig()
	conf.ShareMemoryPathPrefix = proctest.MustArg(t, "PREFIX")
	epoch, err := strconv.ParseUint(proctest.MustArg(t, "EPOCH"), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	usr1 := make(chan os.Signal, 1)
	signal.Notify(usr1, syscall.SIGUSR1)
	defer signal.Stop(usr1)
	ln, err := ListenTakeover(proctest.MustArg(t, "SOCK"), conf)
	if err != nil {
		t.Fatal(err)
	}
	e := &smEchoServer{ln: ln, served: make(chan error, 1)}
	go func() { e.served <- ln.Serve(e.handle) }()
	proctest.Ready()
	for {
		select {
		case <-usr1:
			var err error
			for try := 0; try < 50; try++ { // a handshake may be running
				if err = ln.HotRestart(epoch); !errors.Is(err, ErrHotRestartHandshaking) {
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			if err == nil {
				err = ln.WaitHotRestart(context.Background())
			}
			res := "ok"
			if err != nil {
				res = err.Error()
			}
			proctest.Println(fmt.Sprintf("hotrestart %d %s", epoch, res))
			e.close(t)
			proctest.Println("closed")
		case <-proctest.StdinClosed():
			e.ln.Close()
			return
		}
	}
}

// hrPeerPid returns the process id of the server end of a client session.
func hrPeerPid(t *testing.T, s *Session) int {
	t.Helper()
	raw, err := s.ec.unix.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var cred *unix.Ucred
	var cerr error
	raw.Control(func(fd uintptr) { cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) })
	if cerr != nil {
		t.Fatal(cerr)
	}
	return int(cred.Pid)
}

// TestHotRestartCrossProcess: server v1 (a child) serves a SessionManager
// that runs echo requests without pause; server v2 (another child) takes
// over the socket path; v1 runs HotRestart and must see every session
// acknowledge; the client must move every session to v2, and no request
// may fail, before, during or after the switch.
func TestHotRestartCrossProcess(t *testing.T) {
	waitsInParallel(t)
	prefix := shmPrefix(t, "hr")
	sock := filepath.Join(t.TempDir(), "s.sock")
	const epoch = 7
	start := func() *proctest.Child {
		c, _ := startChild(t, proctest.Config{
			TestName: hrChildTest, Role: hrRoleServer, Timeout: hrChildTimeout,
			Args: map[string]string{"SOCK": sock, "PREFIX": prefix, "EPOCH": strconv.Itoa(epoch)},
		})
		return c
	}
	v1 := start()
	conf := smTestConfig()
	conf.ShareMemoryPathPrefix = prefix
	m, err := NewSessionManager(SessionManagerConfig{Config: conf, Network: "unix", Address: sock, SessionNum: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	for _, s := range m.Sessions() {
		if pid := hrPeerPid(t, s); pid != v1.Pid() {
			t.Fatalf("session peer pid %d, want v1 %d", pid, v1.Pid())
		}
	}

	var (
		stop     atomic.Bool
		requests atomic.Int64
		mu       sync.Mutex
		failures []string
		wg       sync.WaitGroup
	)
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; !stop.Load(); i++ {
				err := func() error {
					ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
					defer cancel()
					st, err := m.GetStreamContext(ctx)
					if err != nil {
						return err
					}
					st.SetDeadline(time.Now().Add(5 * time.Second))
					if err := smRoundTrip(st, mpPayload(64+i%4096, uint64(w<<32|i))); err != nil {
						st.Close()
						return err
					}
					m.PutBack(st)
					return nil
				}()
				requests.Add(1)
				if err != nil {
					mu.Lock()
					failures = append(failures, fmt.Sprintf("%s: %v", time.Now().Format("15:04:05.000"), err))
					mu.Unlock()
				}
				time.Sleep(200 * time.Microsecond)
			}
		}()
	}
	// Traffic runs for 200 ms before the restart and 500 ms after it
	// (100 and 250 ms with -short: still thousands of requests each).
	time.Sleep(shortOr(200*time.Millisecond, 100*time.Millisecond))

	v2 := start()
	before := requests.Load()
	if err := v1.Signal(syscall.SIGUSR1); err != nil {
		t.Fatal(err)
	}
	line, err := v1.ReadLine(10 * time.Second)
	if err != nil {
		t.Fatalf("v1: %v\n%s", err, v1.Output())
	}
	if want := fmt.Sprintf("hotrestart %d ok", epoch); line != want {
		t.Fatalf("v1 printed %q, want %q", line, want)
	}
	if line, err := v1.ReadLine(10 * time.Second); err != nil || line != "closed" {
		t.Fatalf("v1 after the restart: %q, %v", line, err)
	}
	settled := requests.Load()
	time.Sleep(shortOr(500*time.Millisecond, 250*time.Millisecond))
	stop.Store(true)
	wg.Wait()
	after := requests.Load()

	if c, f := m.HotRestarts(); c != 1 || f != 0 {
		t.Errorf("HotRestarts() = %d, %d, want 1, 0", c, f)
	}
	sessions := m.Sessions()
	if len(sessions) != 2 {
		t.Errorf("%d sessions, want 2", len(sessions))
	}
	for _, s := range sessions {
		if s.IsClosed() {
			t.Errorf("session closed: %v", s.Err())
			continue
		}
		if pid := hrPeerPid(t, s); pid != v2.Pid() {
			t.Errorf("session peer pid %d after the restart, want v2 %d", pid, v2.Pid())
		}
	}
	t.Logf("requests: %d before the restart, %d until v1 closed, %d after", before, settled-before, after-settled)
	if after-settled < 10 {
		t.Errorf("only %d requests after v1 closed", after-settled)
	}
	if len(failures) > 0 {
		t.Errorf("%d of %d requests failed:\n%s", len(failures), after, strings.Join(failures[:min(len(failures), 20)], "\n"))
	}
	if err := v1.Stop(20 * time.Second); err != nil {
		t.Errorf("v1: %v\n%s", err, v1.Output())
	}
	if err := m.Close(); err != nil {
		t.Error(err)
	}
	if err := v2.Stop(20 * time.Second); err != nil {
		t.Errorf("v2: %v\n%s", err, v2.Output())
	}
	if _, err := os.Stat(sock); err == nil {
		t.Errorf("socket file %s left after v2 closed", sock)
	}
}

// TestHotRestartDuringHandshake: connections in their handshake do not
// hold HotRestart up (a client that keeps opening them, and never finishes
// a handshake, would block restarts for ever); a session whose handshake
// ends while the restart runs is told as it starts, and waited for.
func TestHotRestartDuringHandshake(t *testing.T) {
	env := startTestServer(t, 0)
	env.good.Close()
	waitUntil(t, "server forgets the plain client", 5*time.Second, func() bool { return hrSessionCount(env.ln) == 0 })
	dial := func() *net.UnixConn {
		c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: env.addr, Net: "unix"})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	dial() // never handshakes
	late := dial()
	waitUntil(t, "two connections in their handshake", 5*time.Second, func() bool {
		env.ln.mu.Lock()
		defer env.ln.mu.Unlock()
		return len(env.ln.pending) == 2
	})
	if err := env.ln.HotRestart(hrEpoch); err != nil {
		t.Fatalf("HotRestart with connections in their handshake: %v", err)
	}
	conf := peerConfig(t, MemMapTypeMemFd, 0)
	r := createRawRegions(t, conf, MemMapTypeMemFd, rawLayout{})
	v, err := r.handshake(late, MemMapTypeMemFd)
	if err != nil {
		t.Fatalf("handshake during the restart: %v", err)
	}
	p := rawPeerOf(t, late, v, r, conf)
	got, err := p.readFrame()
	if err != nil {
		t.Fatalf("no HotRestart frame for the session that joined: %v", err)
	}
	if want := hrFrame(8, hrEpoch); !bytes.Equal(got, want) {
		t.Fatalf("frame % x, want the HotRestart frame % x", got, want)
	}
	if restartDone(env.ln) {
		t.Error("the restart ended before the session that joined acknowledged")
	}
	p.write(hrFrame(9, hrEpoch))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := env.ln.WaitHotRestart(ctx); err != nil {
		t.Errorf("WaitHotRestart: %v", err)
	}
}

// ListenTakeover without a hot restart: the old server's Close, and socket
// paths too long for the temporary name.

// TestTakeoverSurvivesOldClose: a server started with Listen whose path a
// new server took over with ListenTakeover closes without a hot restart
// (stopping gracefully, or giving up on HotRestart). Its Close must leave
// the new server's socket file, and Close of the new one removes it.
func TestTakeoverSurvivesOldClose(t *testing.T) {
	sock := sockPath(t)
	conf := smTestConfig()
	conf.ShareMemoryPathPrefix = shmPrefix(t, "takeover")
	v1, err := Listen("unix", sock, conf)
	if err != nil {
		t.Fatal(err)
	}
	defer v1.CloseAll()
	go serveStreams(v1, echoStream)
	v2, err := ListenTakeover(sock, conf)
	if err != nil {
		t.Fatal(err)
	}
	defer v2.CloseAll()
	go serveStreams(v2, echoStream)
	if err := v1.Close(); err != nil {
		t.Fatal(err)
	}
	s, err := Dial("unix", sock, conf)
	if err != nil {
		t.Fatalf("dial after the old server's Close: %v", err)
	}
	mustEcho(t, s)
	s.Close()
	if got := v2.Addr().String(); got != sock {
		t.Errorf("the new listener's address is %q, want %q", got, sock)
	}
	if err := v2.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the socket file after the last server's Close: %v; want it removed", err)
	}
}

// TestTakeoverLongPath takes over a socket path with room left for its
// own name but not for ListenTakeover's longer temporary one.
func TestTakeoverLongPath(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s.sock")
	if room := 100 - len(sock); room > 0 {
		dir := filepath.Join(filepath.Dir(sock), strings.Repeat("d", room))
		if err := os.Mkdir(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		sock = filepath.Join(dir, "s.sock")
	}
	conf := smTestConfig()
	conf.ShareMemoryPathPrefix = shmPrefix(t, "takeover")
	v1, err := Listen("unix", sock, conf)
	if err != nil {
		t.Fatalf("Listen on a path of %d bytes: %v", len(sock), err)
	}
	defer v1.CloseAll()
	v2, err := ListenTakeover(sock, conf)
	if err != nil {
		t.Fatalf("ListenTakeover of the same %d-byte path: %v", len(sock), err)
	}
	defer v2.CloseAll()
	go serveStreams(v2, echoStream)
	if got := v2.Addr().String(); got != sock {
		t.Errorf("the new listener's address is %q, want %q", got, sock)
	}
	s, err := Dial("unix", sock, conf)
	if err != nil {
		t.Fatalf("dial the new server: %v", err)
	}
	defer s.Close()
	mustEcho(t, s)
	if fi, err := os.Stat(sock); err != nil || fi.Mode().Perm() != conf.SocketFileMode {
		t.Errorf("the socket file: %v, %v; want mode %v", fi.Mode(), err, conf.SocketFileMode)
	}
}

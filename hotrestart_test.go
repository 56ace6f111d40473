package shmipc

// Hot restart (PROTOCOL.md §7, hotrestart.go).

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
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

const hrEpoch = 0x0102030405060708

// hrFrame is the exact 16-byte frame of type typ with hrEpoch, version 3.
func hrFrame(typ byte, epoch uint64) []byte {
	return rawFrame(16, rawMagic, 3, typ, binary.BigEndian.AppendUint64(nil, epoch)...)
}

// hrSessionCount returns the number of sessions of l.
func hrSessionCount(l *Listener) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.sessions)
}

// TestHotRestartServerFrames: the server sends the exact HotRestart frame on
// every session; a plain Dial client ignores it and stays up; a second
// restart is refused while one runs; an ack with another epoch does not
// count; without every ack WaitHotRestart fails after about 2 s and the
// sessions stay up; then a restart whose sessions all ack succeeds.
func TestHotRestartServerFrames(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: waits out the hot restart timeout")
	}
	env := startTestServer(t, 0)
	p, victim := connectRawClient(t, env, MemMapTypeMemFd)

	start := time.Now()
	if err := env.ln.HotRestart(hrEpoch); err != nil {
		t.Fatal(err)
	}
	if err := env.ln.HotRestart(hrEpoch + 1); !errors.Is(err, ErrHotRestartRunning) {
		t.Errorf("second HotRestart while one runs: %v, want ErrHotRestartRunning", err)
	}
	got, err := p.readFrame()
	if err != nil {
		t.Fatal(err)
	}
	want := []byte{0, 0, 0, 0x10, 0x77, 0x58, 0x03, 0x08, 1, 2, 3, 4, 5, 6, 7, 8}
	if !bytes.Equal(got, want) {
		t.Fatalf("HotRestart frame % x, want % x", got, want)
	}
	// An ack with another epoch is ignored; the right one counts.
	p.write(hrFrame(9, hrEpoch+1))
	p.write(hrFrame(9, hrEpoch))

	// env.good is a plain Dial client: it ignores HotRestart and never acks.
	err = env.ln.WaitHotRestart(context.Background())
	elapsed := time.Since(start)
	if !errors.Is(err, ErrHotRestartTimeout) {
		t.Fatalf("WaitHotRestart: %v, want ErrHotRestartTimeout", err)
	}
	if !strings.Contains(err.Error(), "1 of 2 sessions") {
		t.Errorf("WaitHotRestart: %v, want 1 of 2 sessions unacknowledged", err)
	}
	if elapsed < hotRestartTimeout-50*time.Millisecond || elapsed > hotRestartTimeout+10*time.Second { // the upper bound catches a hang, not a loaded machine
		t.Errorf("WaitHotRestart failed after %v, want about %v", elapsed, hotRestartTimeout)
	}
	if restartDone(env.ln) {
		t.Error("hot restart counted as done after a timeout")
	}
	if env.good.IsClosed() || victim.IsClosed() {
		t.Fatalf("sessions closed by the timeout: client %v, server %v", env.good.Err(), victim.Err())
	}
	if err := echoRoundTrip(env.good, "after the hot restart timeout"); err != nil {
		t.Fatalf("plain client after ignoring HotRestart: %v", err)
	}

	// Once the plain client is gone, the raw peer's ack finishes a restart.
	env.good.Close()
	waitUntil(t, "server forgets the plain client", 5*time.Second, func() bool { return hrSessionCount(env.ln) == 1 })
	if err := env.ln.HotRestart(hrEpoch + 2); err != nil {
		t.Fatalf("HotRestart after a timed-out one: %v", err)
	}
	got, err = p.readFrame()
	if err != nil {
		t.Fatal(err)
	}
	if want := hrFrame(8, hrEpoch+2); !bytes.Equal(got, want) {
		t.Fatalf("HotRestart frame % x, want % x", got, want)
	}
	p.write(hrFrame(9, hrEpoch+2))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := env.ln.WaitHotRestart(ctx); err != nil {
		t.Fatalf("WaitHotRestart with every session acked: %v", err)
	}
	if !restartDone(env.ln) {
		t.Error("hot restart not done after success")
	}
	if victim.IsClosed() {
		t.Errorf("server session closed by the restart: %v", victim.Err())
	}
}

// TestHotRestartPlainClientIgnores: a session from Dial stays up after a
// HotRestart frame and sends nothing back.
func TestHotRestartPlainClientIgnores(t *testing.T) {
	waitsInParallel(t)
	p, sess := acceptRawVictim(t, MemMapTypeMemFd, 0)
	p.write(hrFrame(8, hrEpoch))
	// No answer for 300 ms, 100 ms with -short: an answer would follow the
	// frame within a round of the receive loop.
	p.conn.SetReadDeadline(time.Now().Add(shortOr(300*time.Millisecond, 100*time.Millisecond)))
	n, err := p.conn.Read(make([]byte, 64))
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Errorf("plain client answered HotRestart: %d bytes, %v", n, err)
	}
	if sess.IsClosed() {
		t.Errorf("plain client session closed on HotRestart: %v", sess.Err())
	}
}

// TestHotRestartManagerAck: a SessionManager receiving HotRestart from a raw
// server dials a new session and then sends the exact HotRestartAck on the
// old one, and closes it.
func TestHotRestartManagerAck(t *testing.T) {
	conf := peerConfig(t, MemMapTypeMemFd, 0)
	ln, sock := listenRaw(t)
	type mres struct {
		m   *SessionManager
		err error
	}
	ch := make(chan mres, 1)
	go func() {
		m, err := NewSessionManager(SessionManagerConfig{Config: conf, Network: "unix", Address: sock})
		ch <- mres{m, err}
	}()
	accept := func() *net.UnixConn {
		t.Helper()
		c := acceptRaw(t, ln)
		mapRawClient(t, c, MemMapTypeMemFd)
		return c
	}
	c1 := accept()
	r := <-ch
	if r.err != nil {
		t.Fatal(r.err)
	}
	m := r.m
	defer m.Close()
	old := m.Sessions()[0]

	p1 := &rawPeer{t: t, conn: c1, version: 3}
	p1.write(hrFrame(8, hrEpoch))
	p1.write(hrFrame(8, hrEpoch)) // a duplicate is ignored
	accept()
	got, err := p1.readFrame()
	if err != nil {
		t.Fatal(err)
	}
	want := []byte{0, 0, 0, 0x10, 0x77, 0x58, 0x03, 0x09, 1, 2, 3, 4, 5, 6, 7, 8}
	if !bytes.Equal(got, want) {
		t.Fatalf("HotRestartAck frame % x, want % x", got, want)
	}
	waitUntil(t, "old session closed", 5*time.Second, old.IsClosed)
	if s := m.Sessions(); len(s) != 1 || s[0] == old || s[0].IsClosed() {
		t.Errorf("sessions after the restart: %v", s)
	}
	if c, f := m.HotRestarts(); c != 1 || f != 0 {
		t.Errorf("HotRestarts() = %d, %d, want 1, 0", c, f)
	}
	// Nothing but the old connection's end follows the ack.
	c1.SetReadDeadline(time.Now().Add(2 * time.Second))
	if n, err := c1.Read(make([]byte, 64)); n != 0 {
		t.Errorf("after the ack the client sent %d more bytes (%v)", n, err)
	}
}

// TestHotRestartManagerTimeout: a manager of two sessions gets its first new
// session but the second handshake stalls. After 2 s it gives up: the parked
// old session of the first slot is closed without an acknowledgement, the
// second slot keeps its old session, and nothing is sent on either.
func TestHotRestartManagerTimeout(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: waits out the hot restart timeout")
	}
	conf := peerConfig(t, MemMapTypeMemFd, 0)
	ln, sock := listenRaw(t)
	ch := make(chan *SessionManager, 1)
	go func() {
		m, err := NewSessionManager(SessionManagerConfig{Config: conf, Network: "unix", Address: sock, SessionNum: 2,
			MinReconnectBackoff: 50 * time.Millisecond, MaxReconnectBackoff: 100 * time.Millisecond})
		if err != nil {
			t.Error(err)
		}
		ch <- m
	}()
	accept := func(handshake bool) *net.UnixConn {
		t.Helper()
		c := acceptRaw(t, ln)
		if handshake {
			mapRawClient(t, c, MemMapTypeMemFd)
		}
		return c
	}
	c1, c2 := accept(true), accept(true)
	m := <-ch
	if m == nil {
		t.FailNow()
	}
	defer m.Close()
	olds := m.Sessions()

	start := time.Now()
	p1 := &rawPeer{t: t, conn: c1, version: 3}
	p1.write(hrFrame(8, hrEpoch))
	accept(true)  // the new session of slot 0
	accept(false) // slot 1: never answered
	go func() {   // and no more
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { c.Close() })
		}
	}()
	c1.SetReadDeadline(time.Now().Add(5 * time.Second))
	var got []byte
	buf := make([]byte, 64)
	for {
		n, err := c1.Read(buf)
		got = append(got, buf[:n]...)
		if err != nil {
			break
		}
	}
	elapsed := time.Since(start)
	if len(got) != 0 {
		t.Errorf("client sent % x on the parked session, want nothing (no ack on timeout)", got)
	}
	if elapsed < hotRestartTimeout-100*time.Millisecond || elapsed > hotRestartTimeout+10*time.Second { // the upper bound catches a hang, not a loaded machine
		t.Errorf("parked session closed after %v, want about %v", elapsed, hotRestartTimeout)
	}
	waitUntil(t, "parked session closed", 5*time.Second, olds[0].IsClosed)
	if c, f := m.HotRestarts(); c != 0 || f != 1 {
		t.Errorf("HotRestarts() = %d, %d, want 0, 1", c, f)
	}
	if olds[1].IsClosed() {
		t.Errorf("unreplaced old session closed: %v", olds[1].Err())
	}
	c2.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	if n, _ := c2.Read(buf); n != 0 {
		t.Errorf("client sent % x on the unreplaced session", buf[:n])
	}
	cur := m.Sessions()
	if len(cur) != 2 || cur[0] == olds[0] || cur[1] != olds[1] {
		t.Errorf("sessions after the timeout: %v, old %v", cur, olds)
	}
}

// TestHotRestartFileModeNames: in file mode the sessions dialed for a hot
// restart name their regions <prefix>_epoch_<e>_<randID>_...; the server's
// WaitHotRestart succeeds once the manager has switched.
func TestHotRestartFileModeNames(t *testing.T) {
	prefix := shmPrefix(t, "hrf")
	sconf := smTestConfig()
	sconf.MemMapType = MemMapTypeDevShmFile
	sconf.ShareMemoryPathPrefix = prefix
	sock := filepath.Join(t.TempDir(), "s.sock")
	srv := smStartEchoConf(t, sock, sconf)
	defer srv.close(t)
	cconf := *sconf
	m, err := NewSessionManager(SessionManagerConfig{Config: &cconf, Network: "unix", Address: sock, SessionNum: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	st, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	if err := smRoundTrip(st, []byte("before")); err != nil {
		t.Fatal(err)
	}
	m.PutBack(st)
	oldSessions := m.Sessions()

	const epoch = 42
	// In file mode the client is done before the server has mapped the
	// regions: wait for the server's handshakes to finish.
	waitUntil(t, "server handshakes", 5*time.Second, func() bool { return hrSessionCount(srv.ln) == 2 })
	if err := srv.ln.HotRestart(epoch); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.ln.WaitHotRestart(ctx); err != nil {
		t.Fatalf("WaitHotRestart: %v", err)
	}
	var epochFiles []string
	for _, f := range shmFiles(prefix) {
		if strings.HasPrefix(filepath.Base(f), filepath.Base(prefix)+"_epoch_42_") {
			epochFiles = append(epochFiles, f)
		}
	}
	if len(epochFiles) != 4 { // 2 sessions × buffer and queue
		t.Errorf("region files of the new sessions: %q (all: %q), want 4 named %s_epoch_42_<randID>_...", epochFiles, shmFiles(prefix), prefix)
	}
	for _, s := range oldSessions {
		waitUntil(t, "old session closed", 5*time.Second, s.IsClosed)
	}
	st, err = m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	if err := smRoundTrip(st, []byte("after")); err != nil {
		t.Fatal(err)
	}
	m.PutBack(st)
}

// smStartEchoConf is smStartEcho with a configuration.
func smStartEchoConf(t testing.TB, sock string, conf *Config) *smEchoServer {
	t.Helper()
	ln, err := Listen("unix", sock, conf)
	if err != nil {
		t.Fatal(err)
	}
	e := &smEchoServer{ln: ln, served: make(chan error, 1)}
	go func() { e.served <- ln.Serve(e.handle) }()
	return e
}

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

// restartDone reports whether the latest hot restart of l has finished with
// every session acknowledged.
func restartDone(l *Listener) bool {
	hr := l.restart.Load()
	return hr != nil && hr.finished() && hr.err == nil
}

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

// TestHotRestartRepeatedByServer: a server that sends HotRestart over and
// over, on every session and so on the new ones too, must not make a
// SessionManager dial new sessions (and create new regions) in a loop: a
// restart starts at most once a second.
func TestHotRestartRepeatedByServer(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: hot restarts a second apart")
	}
	ln, sock := listenRaw(t)
	var accepted atomic.Int64
	stop := make(chan struct{})
	var conns sync.WaitGroup
	acceptDone := make(chan struct{})
	go func() {
		defer close(acceptDone)
		for {
			c, err := ln.AcceptUnix()
			if err != nil {
				return
			}
			accepted.Add(1)
			conns.Add(1)
			go func() {
				defer conns.Done()
				defer c.Close()
				buf, q, _, err := serveRawHandshake(c, MemMapTypeMemFd)
				if err != nil {
					return
				}
				defer unix.Munmap(buf)
				defer unix.Munmap(q)
				go io.Copy(io.Discard, c)
				for epoch := uint64(1); ; epoch++ {
					select {
					case <-stop:
						return
					case <-time.After(5 * time.Millisecond):
					}
					c.SetWriteDeadline(time.Now().Add(time.Second))
					if _, err := c.Write(hrFrame(8, epoch)); err != nil {
						return
					}
				}
			}()
		}
	}()
	conf := smTestConfig()
	conf.ShareMemoryPathPrefix = shmPrefix(t, "hrstorm")
	m, err := NewSessionManager(SessionManagerConfig{Config: conf, Network: "unix", Address: sock})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond)
	n := accepted.Load()
	m.Close()
	close(stop)
	ln.Close()
	<-acceptDone
	conns.Wait()
	// The first session, and one for each restart: at 0 s and at 1 s.
	if n > 4 {
		t.Errorf("HotRestart every 5 ms for 1.5 s made the manager dial %d sessions; want at most 4", n-1)
	}
}

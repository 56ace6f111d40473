package shmipc

// Hot restart (docs/protocol.md §10, hotrestart.go).

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

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

// restartDone reports whether the latest hot restart of l has finished with
// every session acknowledged.
func restartDone(l *Listener) bool {
	hr := l.restart.Load()
	return hr != nil && hr.finished() && hr.err == nil
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

package shmipc

import (
	"bufio"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

// fpEchoListener starts an in-process echo server and returns its address.
func fpEchoListener(t *testing.T, conf *Config) *Listener {
	t.Helper()
	ln, err := Listen("unix", filepath.Join(t.TempDir(), "fp.sock"), conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			st, err := ln.AcceptStream()
			if err != nil {
				return
			}
			go func() { defer st.Close(); io.Copy(st, st) }()
		}
	}()
	return ln
}

// fpEcho sends msg on a new stream of sess and reads it back.
func fpEcho(t testing.TB, sess *Session, msg []byte) *Stream {
	t.Helper()
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	st.SetDeadline(time.Now().Add(20 * time.Second))
	if _, err := st.Write(msg); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(st, got); err != nil {
		t.Fatal(err)
	}
	if string(got) != string(msg) {
		t.Fatal("echo differs")
	}
	return st
}

// TestRegionCommittedOnUse checks that a new session commits only the pages
// it writes, not its whole buffer region, and that Stats reports the region's
// committed and in-use bytes.
func TestRegionCommittedOnUse(t *testing.T) {
	conf := DefaultConfig()
	ln := fpEchoListener(t, conf)
	sess, err := Dial("unix", ln.Addr().String(), conf)
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	st := fpEcho(t, sess, []byte("hello"))
	defer st.Close()

	s := sess.Stats()
	if s.Buffer.Size != uint64(conf.ShareMemoryBufferCap) {
		t.Errorf("Buffer.Size %d, want %d", s.Buffer.Size, conf.ShareMemoryBufferCap)
	}
	// The slice headers of a fresh region and the pages of one small echo:
	// about 11 MiB for the default layout, far from the 64 MiB reserved up
	// front before.
	if s.Buffer.Committed == 0 || s.Buffer.Committed > s.Buffer.Size/4 {
		t.Errorf("Buffer.Committed %d of %d bytes after one small echo; want a small part of it", s.Buffer.Committed, s.Buffer.Size)
	}
	if s.Queue.Committed == 0 || s.Queue.Committed >= s.Queue.Size {
		t.Errorf("Queue.Committed %d of %d bytes after one small echo; want a small part of it", s.Queue.Committed, s.Queue.Size)
	}
	if s.Buffer.InUse != 0 || s.Buffer.Sessions < 1 {
		t.Errorf("Buffer.InUse %d, Sessions %d at rest; want 0 and at least 1", s.Buffer.InUse, s.Buffer.Sessions)
	}

	// A reserved slice is in use, and its pages are committed before the
	// application gets them.
	before := s.Buffer.Committed
	const n = 1 << 20
	if _, err := st.BufferWriter().Reserve(n); err != nil {
		t.Fatal(err)
	}
	s = sess.Stats()
	if s.Buffer.InUse < n {
		t.Errorf("Buffer.InUse %d with a %d-byte reservation held; want at least that", s.Buffer.InUse, n)
	}
	if s.Buffer.Committed < before+n {
		t.Errorf("Buffer.Committed %d after reserving %d bytes on top of %d; want the reservation committed", s.Buffer.Committed, n, before)
	}
	if err := st.Flush(false); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(st, make([]byte, n)); err != nil {
		t.Fatal(err)
	}
	st.BufferReader().ReleasePreviousRead()
	agg := AggregateStats()
	if agg.Buffer.Committed == 0 || agg.Queue.Committed == 0 {
		t.Errorf("AggregateStats reports no committed memory: %+v %+v", agg.Buffer, agg.Queue)
	}
}

// meminfo returns a field of /proc/meminfo in bytes.
func meminfo(t testing.TB, field string) uint64 {
	t.Helper()
	return procField(t, "/proc/meminfo", field)
}

// procField reads "Field:  N kB" from a /proc file, in bytes.
func procField(t testing.TB, path, field string) uint64 {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		name, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok || name != field {
			continue
		}
		num, _, _ := strings.Cut(strings.TrimSpace(rest), " ")
		v, err := strconv.ParseUint(num, 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		return v << 10
	}
	t.Fatalf("%s has no %s", path, field)
	return 0
}

// TestSessionsShareRegion checks that two sessions of one process to one
// server use one buffer region (one memfd, mapped once by the server), each
// with its own queue region, and that ending one returns everything it held
// while the other goes on.
func TestSessionsShareRegion(t *testing.T) {
	conf := DefaultConfig()
	ln := fpEchoListener(t, conf)
	a, err := Dial("unix", ln.Addr().String(), conf)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := Dial("unix", ln.Addr().String(), conf)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if a.buf != b.buf || a.buf.region.path != b.buf.region.path {
		t.Fatalf("sessions use buffer regions %q and %q; want one shared region", a.buf.region.path, b.buf.region.path)
	}
	if a.queueRegion == b.queueRegion || a.queueRegion.path == b.queueRegion.path {
		t.Fatalf("sessions share the queue region %q", a.queueRegion.path)
	}
	sa := fpEcho(t, a, []byte("from a"))
	fpEcho(t, b, []byte("from b")).Close()
	if got := a.Stats().Buffer.Sessions; got != 2 {
		t.Errorf("Buffer.Sessions %d, want 2", got)
	}
	// The server mapped the region once, for both sessions.
	var servers []*Session
	registry.Lock()
	for s := range registry.live {
		if !s.isClient {
			servers = append(servers, s)
		}
	}
	registry.Unlock()
	if len(servers) != 2 || servers[0].buf != servers[1].buf {
		t.Fatalf("server has %d sessions on distinct mappings; want 2 sessions on one mapping", len(servers))
	}

	// b ends while a stream of its holds received data and messages sit on
	// its queues; a goes on, and every slice b held comes back.
	held := fpEcho(t, b, make([]byte, 100<<10))
	if _, err := held.Write(make([]byte, 300<<10)); err != nil {
		t.Fatal(err)
	}
	b.Close()
	fpEcho(t, a, make([]byte, 1<<20))
	sa.Close()
	fpWaitFull(t, a)
}

// fpWaitFull waits until every list of sess's buffer region has all its
// slices free, and fails if that does not happen within a few seconds.
func fpWaitFull(t testing.TB, sess *Session) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		st := sess.Stats()
		full := len(st.Lists) > 0
		for _, l := range st.Lists {
			full = full && l.Free == int32(l.Slices)
		}
		if full {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("buffer region lists not back to full: %+v", st.Lists)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestFootprintChild is the server process of the footprint tests: an echo
// server with DefaultConfig on SOCK. A stream whose first message is
// fpKillSession makes it close its whole session at once.
func TestFootprintChild(t *testing.T) {
	if proctest.Role() == "" {
		t.Skip("runs only as the child process of the footprint tests")
	}
	ln, err := Listen("unix", proctest.MustArg(t, "SOCK"), DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			st, err := ln.AcceptStream()
			if err != nil {
				return
			}
			go fpServe(st)
		}
	}()
	proctest.Ready()
	<-proctest.StdinClosed()
}

// fpKillSession asks the footprint echo server to close the session.
const fpKillSession = "KILL"

func fpServe(st *Stream) {
	defer st.Close()
	buf := make([]byte, 64<<10)
	first := true
	for {
		n, err := st.Read(buf)
		if first && string(buf[:n]) == fpKillSession {
			st.Session().Close()
			return
		}
		first = false
		if n > 0 {
			if _, err := st.Write(buf[:n]); err != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// fpStartServer starts a footprint echo server process on a new socket.
func fpStartServer(t *testing.T) (*proctest.Child, string) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "fp.sock")
	c := proctest.Start(t, proctest.Config{TestName: "TestFootprintChild", Role: "echo", Args: map[string]string{"SOCK": sock}})
	if _, err := c.WaitReady(30 * time.Second); err != nil {
		t.Fatalf("server process did not start: %v\n%s", err, c.Output())
	}
	return c, sock
}

// TestThousandIdleSessions dials 1,000 sessions from this process to a
// server process, each doing one small echo and then staying idle, and
// checks what they cost: shared memory committed (Shmem in /proc/meminfo)
// at most 128 MiB, this process's RSS growth at most 64 MiB (without the
// race detector), and shared memory back near where it was after Close. The
// dial time is logged.
func TestThousandIdleSessions(t *testing.T) {
	n := 1000
	if testing.Short() {
		n = 200
	}
	srv, sock := fpStartServer(t)
	defer srv.Stop(10 * time.Second)
	const limit = 128 << 20
	base := meminfo(t, "Shmem")
	rss0 := procField(t, "/proc/self/status", "VmRSS")
	sessions := make([]*Session, 0, n)
	defer func() {
		for _, s := range sessions {
			s.Close()
		}
	}()
	start := time.Now()
	var dial time.Duration
	for i := range n {
		t0 := time.Now()
		s, err := Dial("unix", sock, DefaultConfig())
		if err != nil {
			t.Fatalf("session %d: %v", i, err)
		}
		dial += time.Since(t0)
		sessions = append(sessions, s)
		fpEcho(t, s, []byte("ping")).Close()
		if grown := int64(meminfo(t, "Shmem") - base); grown > limit {
			t.Fatalf("after %d sessions %d MiB of shared memory are committed, more than %d MiB", i+1, grown>>20, limit>>20)
		}
	}
	total := time.Since(start)
	time.Sleep(200 * time.Millisecond) // late queue sweeps, closes of the echo streams
	shmem := int64(meminfo(t, "Shmem") - base)
	rss := int64(procField(t, "/proc/self/status", "VmRSS") - rss0)
	agg := AggregateStats()
	t.Logf("%d sessions: dial %v in all (%v with the echoes); Shmem +%.1f MiB; client RSS +%.1f MiB; buffer regions %d (%.1f MiB committed), queue regions %d (%.1f MiB committed)",
		n, dial.Round(time.Millisecond), total.Round(time.Millisecond), float64(shmem)/(1<<20), float64(rss)/(1<<20),
		agg.Buffer.Sessions, float64(agg.Buffer.Committed)/(1<<20), agg.Queue.Sessions, float64(agg.Queue.Committed)/(1<<20))
	if shmem > limit {
		t.Errorf("%d idle sessions commit %d MiB of shared memory; want at most %d MiB", n, shmem>>20, limit>>20)
	}
	// The race detector multiplies this process's memory (shadow memory for
	// every goroutine and heap object), so the bound holds for normal builds.
	if rss > 64<<20 && !raceEnabled {
		t.Errorf("%d idle sessions grow this process's RSS by %d MiB; want at most 64 MiB", n, rss>>20)
	}
	if agg.Buffer.Sessions != 1 {
		t.Errorf("%d sessions to one server use %d buffer regions; want 1", n, agg.Buffer.Sessions)
	}

	for _, s := range sessions {
		s.Close()
	}
	sessions = nil
	deadline := time.Now().Add(10 * time.Second)
	for {
		left := int64(meminfo(t, "Shmem") - base)
		if left < 4<<20 {
			t.Logf("Shmem %+.1f MiB from the start after Close", float64(left)/(1<<20))
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("10 s after Close, %.1f MiB more shared memory is committed than before the sessions", float64(left)/(1<<20))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

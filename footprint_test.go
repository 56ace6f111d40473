package shmipc

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

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
	sess := dialEchoSession(t, conf)
	st := fpEcho(t, sess, []byte("hello"))
	defer st.Close()

	s := sess.Stats()
	if s.Buffer.Size != uint64(conf.ShareMemoryBufferCap) {
		t.Errorf("Buffer.Size %d, want %d", s.Buffer.Size, conf.ShareMemoryBufferCap)
	}
	// The slice headers of a fresh region and the pages of one small echo:
	// about 11 MiB for the default layout, far from the 128 MiB reserved up
	// front before.
	if s.Buffer.Committed == 0 || s.Buffer.Committed > s.Buffer.Size/4 {
		t.Errorf("Buffer.Committed %d of %d bytes after one small echo; want a small part of it", s.Buffer.Committed, s.Buffer.Size)
	}
	if s.Queue.Committed == 0 || s.Queue.Committed >= s.Queue.Size {
		t.Errorf("Queue.Committed %d of %d bytes after one small echo; want a small part of it", s.Queue.Committed, s.Queue.Size)
	}
	// At rest the open stream may keep the slice of the echo it read, for
	// its next message (reuse.go); nothing else is in use.
	small := uint64(sess.buf.lists[sess.buf.bySize[0]].sliceCap)
	if s.Buffer.InUse > small || s.Buffer.Sessions < 1 {
		t.Errorf("Buffer.InUse %d, Sessions %d at rest with one stream open; want at most %d and at least 1", s.Buffer.InUse, s.Buffer.Sessions, small)
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

	// Closing the stream gives back what it kept.
	st.Close()
	waitUntil(t, "the closed stream's slices are free", 5*time.Second, func() bool { return sess.Stats().Buffer.InUse == 0 })
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
	ln := startEchoListener(t, conf)
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
	// The server mapped the region once, for both sessions. (The listener's
	// own sessions: other tests' server sessions may still be ending.)
	var servers []*Session
	for s := range listenerSessions(ln) {
		servers = append(servers, s)
	}
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
	fpEcho(t, a, make([]byte, 1<<20)).Close() // open, it could keep a slice (reuse.go)
	sa.Close()
	fpWaitFull(t, a)
}

// fpWaitFull waits until every list of sess's buffer region has all its
// slices free, and fails if that does not happen within a few seconds.
func fpWaitFull(t testing.TB, sess *Session) {
	t.Helper()
	deadline := time.Now().Add(time.Minute) // a bound for a loaded machine; done in milliseconds otherwise
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
	go serveStreams(ln, fpServe)
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
	c, _ := startChild(t, proctest.Config{TestName: "TestFootprintChild", Role: "echo", Args: map[string]string{"SOCK": sock}})
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
		time.Sleep(10 * time.Millisecond)
	}
}

// fpLoad is one client session of the kill test with its echo workers.
type fpLoad struct {
	sess   *Session
	server int // index of its server process
	killed atomic.Bool
	errs   chan error
	rounds atomic.Int64
	wg     sync.WaitGroup
}

// run echoes random messages on fresh streams until stop is closed or the
// session fails.
func (l *fpLoad) run(stop <-chan struct{}, seed uint64) {
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		rng := rand.New(rand.NewPCG(seed, 11))
		for {
			select {
			case <-stop:
				return
			default:
			}
			if err := l.round(rng); err != nil {
				if !l.killed.Load() {
					l.errs <- err
				}
				return
			}
			l.rounds.Add(1)
		}
	}()
}

func (l *fpLoad) round(rng *rand.Rand) error {
	st, err := l.sess.OpenStream()
	if err != nil {
		return err
	}
	defer st.Close()
	st.SetDeadline(time.Now().Add(30 * time.Second))
	msg := make([]byte, 1+rng.IntN(300<<10))
	for i := range msg {
		msg[i] = byte(i * 7)
	}
	if _, err := st.Write(msg); err != nil {
		return err
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(st, got); err != nil {
		return err
	}
	if !bytes.Equal(got, msg) {
		return fmt.Errorf("echo of %d bytes differs", len(msg))
	}
	return nil
}

// TestSharedRegionKills runs echo traffic on several sessions per server
// process, all sessions to one server sharing one buffer region, and kills
// 100 times at random points: a session closed by this side, a session
// closed by the server, or a whole server process (SIGKILL, then a new
// one). Sessions not killed must see no error, and once traffic stops every
// slice of every shared region must be free again. Regions of killed servers
// must be gone.
func TestSharedRegionKills(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: multi-process churn: sessions and server processes killed at random")
	}
	const servers, perServer, workers, kills = 2, 3, 2, 100
	// Regions mapped before this test (an earlier test's, still going away)
	// are not this test's to account for.
	baseline := fpMappedRegions(t)
	t.Logf("shmipc regions mapped in this process before the test: %d", baseline)
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 5))
	stop := make(chan struct{})
	procs := make([]*proctest.Child, servers)
	socks := make([]string, servers)
	for i := range procs {
		procs[i], socks[i] = fpStartServer(t)
	}
	var loads, all []*fpLoad
	dial := func(server int) {
		sess, err := Dial("unix", socks[server], DefaultConfig())
		if err != nil {
			t.Fatalf("dial server %d: %v", server, err)
		}
		l := &fpLoad{sess: sess, server: server, errs: make(chan error, workers)}
		for range workers {
			l.run(stop, rng.Uint64())
		}
		loads = append(loads, l)
		all = append(all, l)
	}
	for i := range servers {
		for range perServer {
			dial(i)
		}
	}
	var byClient, byServer, procKills int
	for range kills {
		time.Sleep(time.Duration(rng.IntN(20)) * time.Millisecond)
		live := loads[:0]
		for _, l := range loads {
			if !l.killed.Load() {
				live = append(live, l)
			}
		}
		loads = live
		victim := loads[rng.IntN(len(loads))]
		switch r := rng.IntN(10); {
		case r < 6:
			byClient++
			victim.killed.Store(true)
			victim.sess.Close()
			dial(victim.server)
		case r < 9:
			byServer++
			victim.killed.Store(true)
			st, err := victim.sess.OpenStream()
			if err == nil {
				st.Write([]byte(fpKillSession))
			}
			dial(victim.server)
		default:
			procKills++
			srv := victim.server
			for _, l := range loads {
				if l.server == srv {
					l.killed.Store(true)
				}
			}
			procs[srv].Kill()
			procs[srv], socks[srv] = fpStartServer(t)
			for range perServer {
				dial(srv)
			}
		}
	}
	close(stop)
	var rounds int64
	for _, l := range loads {
		l.wg.Wait()
		rounds += l.rounds.Load()
		close(l.errs)
		for err := range l.errs {
			t.Errorf("a session that was not killed failed: %v", err)
		}
	}
	t.Logf("%d kills (%d sessions closed here, %d by the server, %d server processes killed); %d echoes on the surviving sessions", kills, byClient, byServer, procKills, rounds)

	// Every slice of each server's shared region is free again, seen from a
	// surviving session on it.
	seen := make(map[*bufferManager]bool)
	for _, l := range loads {
		if l.killed.Load() || seen[l.sess.buf] {
			continue
		}
		seen[l.sess.buf] = true
		fpWaitFull(t, l.sess)
	}
	if len(seen) != servers {
		t.Errorf("surviving sessions use %d buffer regions; want one per server process (%d)", len(seen), servers)
	}
	// Close every session this test dialled (Close is idempotent): the
	// surviving ones, and any the server was asked to end that has not
	// ended yet, which is reported.
	stillOpen := 0
	for _, l := range all {
		if l.killed.Load() && !l.sess.IsClosed() {
			stillOpen++
		}
		l.sess.Close()
	}
	if stillOpen > 0 {
		t.Logf("%d sessions marked killed were still open at the end", stillOpen)
	}
	// Regions of killed server processes are unmapped once their sessions
	// have ended: no region is left mapped in this process.
	deadline := time.Now().Add(30 * time.Second)
	for n := fpMappedRegions(t); n > baseline; n = fpMappedRegions(t) {
		if time.Now().After(deadline) {
			for _, l := range all {
				if b, q := l.sess.buf.region.refs.Load(), l.sess.queueRegion.refs.Load(); b != 0 || q != 0 {
					t.Logf("session (killed %v, %v) still holds: buffer region %d references, queue region %d", l.killed.Load(), l.sess.Err(), b, q)
				}
			}
			t.Fatalf("%d shared regions still mapped 30 s after every session closed (%d before the test)", n, baseline)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// fpMappedRegions counts the memfd regions this process has mapped.
func fpMappedRegions(t testing.TB) int {
	maps, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(maps), "memfd:"+memfdNamePrefix)
}

// TestGiveBackAfterQuiet checks that the data pages of large messages are
// given back once traffic stops, and that the region works as before after
// that (pages fault back in, zero-filled, and carry the data).
//
// Nothing here depends on how fast the machine is: the region is the
// test's own (no other session's traffic or idle pages in it), the pages
// the traffic committed are seen by sampling while it runs (a give-back
// between two echoes, on a machine that paused the test, does not hide
// them), and the give-back is awaited with a bound of a minute.
func TestGiveBackAfterQuiet(t *testing.T) {
	old := giveBackPeriod
	giveBackPeriod = 200 * time.Millisecond
	defer func() { giveBackPeriod = old }()
	conf := DefaultConfig()
	conf.ShareMemoryPathPrefix = shmPrefix(t, "giveback")
	sess := dialEchoSession(t, conf)
	fpEcho(t, sess, []byte("hello")).Close()
	idle := sess.Stats().Buffer.Committed
	msg := make([]byte, 6<<20)
	for i := range msg {
		msg[i] = byte(i>>12) + 1
	}
	var busy atomic.Uint64
	sample := func() {
		c := sess.Stats().Buffer.Committed
		for b := busy.Load(); c > b && !busy.CompareAndSwap(b, c); b = busy.Load() {
		}
	}
	stop := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			select {
			case <-stop:
				return
			case <-time.After(time.Millisecond):
				sample()
			}
		}
	}()
	for range 4 {
		fpEcho(t, sess, msg).Close()
		sample()
	}
	close(stop)
	<-sampled
	if b := busy.Load(); b < idle+uint64(len(msg)) {
		t.Fatalf("Committed at most %d while echoing %d bytes, from %d idle: the traffic did not commit its pages", b, len(msg), idle)
	}
	stopped := time.Now()
	for {
		now := sess.Stats().Buffer.Committed
		if now <= idle+(256<<10) {
			t.Logf("committed: %.1f MiB idle, at most %.1f MiB with the traffic, %.1f MiB %v after it", float64(idle)/(1<<20), float64(busy.Load())/(1<<20), float64(now)/(1<<20), time.Since(stopped).Round(time.Millisecond))
			break
		}
		if time.Since(stopped) > time.Minute {
			t.Fatalf("Committed %d bytes a minute after traffic stopped; %d when idle", now, idle)
		}
		time.Sleep(20 * time.Millisecond)
	}
	fpEcho(t, sess, msg).Close()
	fpWaitFull(t, sess)
}

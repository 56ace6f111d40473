package shmipc

// Shared buffer regions under sessions and server processes killed at
// random points: the survivors see no error and every slice comes back.

import (
	"bytes"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
	"github.com/goshm/shmipc/internal/shm"
)

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
	seen := make(map[*shm.Buffer]bool)
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
				if b, q := refCount(l.sess.buf.Region()), refCount(l.sess.queueRegion); b != 0 || q != 0 {
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

// The footprint of many idle sessions to a server process, and the echo
// server process that the footprint tests start.

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

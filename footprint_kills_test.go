package shmipc

// Shared buffer regions under sessions and server processes killed at
// random points: the survivors see no error and every slice comes back.

import (
	"bytes"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
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

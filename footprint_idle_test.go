package shmipc

// The footprint of many idle sessions to a server process, and the echo
// server process that the footprint tests start.

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

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

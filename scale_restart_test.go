package shmipc

// A client process with a SessionManager against server processes that are
// SIGKILLed and restarted on the same socket path: the client's resources
// must not grow with the restarts.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

// scStartServer starts an echo server child on sock.
func scStartServer(t *testing.T, sock, prefix string, mode MemMapType, extra map[string]string) *proctest.Child {
	t.Helper()
	args := map[string]string{"SOCK": sock, "PREFIX": prefix, "MODE": mode.String()}
	for k, v := range extra {
		args[k] = v
	}
	c, _ := startChild(t, proctest.Config{TestName: scChildTest, Role: "echo-server", Args: args, Timeout: 10 * time.Minute})
	return c
}

// scChildStats asks an echo-server child for its stats line.
func scChildStats(t *testing.T, c *proctest.Child) string {
	t.Helper()
	if err := c.Signal(syscall.SIGUSR1); err != nil {
		t.Fatal(err)
	}
	for {
		line, err := c.ReadLine(20 * time.Second)
		if err != nil {
			t.Fatalf("stats of child: %v", err)
		}
		if s, ok := strings.CutPrefix(line, "stats "); ok {
			return s
		}
	}
}

// scManagerEcho gets a stream from m (waiting for a re-dial) and runs a
// round trip on it.
func scManagerEcho(m *SessionManager, seed uint64, putBack bool) error {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	st, err := m.GetStreamContext(ctx)
	if err != nil {
		return fmt.Errorf("GetStream: %w", err)
	}
	st.SetDeadline(time.Now().Add(10 * time.Second))
	if err := mpRoundTrip(st, mpPayload(int(seed%200000)+1, seed), seed%2 == 0); err != nil {
		st.Close()
		return err
	}
	st.SetDeadline(time.Time{})
	if putBack {
		m.PutBack(st)
	} else {
		st.Close()
	}
	return nil
}

// scManagerEchoServed is scManagerEcho for the first round trips after a
// server was killed and another started. A session to the killed server can
// still be the manager's until its receive loop reads the end of the
// connection (on one processor that may come after the next GetStream), and
// a stream of it fails with an error wrapping ErrPeerClosed, as documented:
// such a round trip is tried again, for up to 10 s. Any other error fails.
func scManagerEchoServed(m *SessionManager, seed uint64, putBack bool) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := scManagerEcho(m, seed, putBack)
		if err == nil || !errors.Is(err, ErrPeerClosed) || time.Now().After(deadline) {
			return err
		}
		time.Sleep(time.Millisecond)
	}
}

func TestScaleManagerServerRestarts(t *testing.T) {
	if proctest.IsChild() {
		t.Skip()
	}
	if testing.Short() {
		t.Skip("-short: multi-process churn: server processes restarted")
	}
	restarts := 24
	if testing.Short() {
		restarts = 8
	}
	for _, mode := range bothModes {
		t.Run(mode.String(), func(t *testing.T) {
			prefix := shmPrefix(t, "screst")
			conf := scConfig(mode, prefix)
			sock := scSock(t)
			srv := scStartServer(t, sock, prefix, mode, nil)
			m, err := NewSessionManager(SessionManagerConfig{
				Config: conf, Network: "unix", Address: sock, SessionNum: 4, MaxIdleStreams: 8,
				MinReconnectBackoff: 5 * time.Millisecond, MaxReconnectBackoff: 200 * time.Millisecond,
			})
			if err != nil {
				// The manager may need a server to start; start one first.
				t.Fatalf("NewSessionManager: %v", err)
			}
			defer m.Close()

			var base scState
			for r := range restarts {
				// Traffic: some streams put back to the pool, some closed,
				// and some in flight when the server is killed.
				for i := range 16 {
					if err := scManagerEchoServed(m, uint64(r*100+i), i%2 == 0); err != nil {
						t.Fatalf("restart %d: echo %d: %v", r, i, err)
					}
				}
				stop := make(chan struct{})
				var wg sync.WaitGroup
				for g := range 4 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						for i := 0; ; i++ {
							select {
							case <-stop:
								return
							default:
							}
							_ = scManagerEcho(m, uint64(g*7+i), i%3 != 0) // errors expected at the kill
						}
					}()
				}
				time.Sleep(20 * time.Millisecond)
				srv.Kill()
				srv.Wait(10 * time.Second)
				close(stop)
				// The next server comes up at once; the workers' waits
				// end on its sessions.
				srv = scStartServer(t, sock, prefix, mode, nil)
				if !clWaitGroup(&wg, 90*time.Second) {
					t.Fatalf("restart %d: stream users still blocked 90s after the server was restarted:\n%s", r, scStacks(make([]byte, 4<<20)))
				}
				if r == 2 {
					// Baseline once the steady state is reached: a server
					// running again and served.
					for i := range 16 {
						if err := scManagerEchoServed(m, uint64(i), i%2 == 0); err != nil {
							t.Fatalf("baseline echo: %v", err)
						}
					}
					// The manager re-dials its sessions one by one: the
					// baseline is its full set of SessionNum sessions.
					var full bool
					base, full = scSettle(20*time.Second, func() scState { return scTakeSelf(prefix) }, func(s scState) bool { return s.live >= 4 })
					if !full {
						t.Fatalf("restart %d: the manager has %d live sessions 20 s after the restart, want its SessionNum (4)", r, base.live)
					}
					t.Logf("baseline (server up, restart %d): %v", r, base)
				}
			}
			for i := range 16 {
				if err := scManagerEchoServed(m, uint64(i), i%2 == 0); err != nil {
					t.Fatalf("final echo: %v", err)
				}
			}
			after, ok := scSettle(20*time.Second, func() scState { return scTakeSelf(prefix) }, func(s scState) bool {
				return s.goroutines <= base.goroutines+4 && s.fds <= base.fds+2 && s.prefixMaps <= base.prefixMaps &&
					s.memfdMaps <= base.memfdMaps && s.files <= base.files && s.live <= base.live && s.cliBufs <= base.cliBufs
			})
			t.Logf("after %d restarts (server up): %v", restarts, after)
			if !ok {
				t.Errorf("client resources grew across %d server restarts:\n base  %v\n after %v", restarts-3, base, after)
				fds, _ := clFds("self")
				t.Logf("fds: %v", fds)
			}
			if !raceEnabled && after.rss > base.rss+32<<20 { // the race detector keeps its shadow memory
				t.Errorf("RSS grew from %d KiB to %d KiB", base.rss>>10, after.rss>>10)
			}
			srv.Kill()
			srv.Wait(10 * time.Second)
		})
	}
}

// Shared helpers of the scale_* tests: many real client and server
// processes coming and going, some crashing, against one process whose
// resources must come back to a baseline.

// scSock returns a unique socket path (pid + random) in the test's temp dir.
func scSock(t testing.TB) string {
	return filepath.Join(t.TempDir(), fmt.Sprintf("sc_%d_%08x.sock", os.Getpid(), rand.Uint32()))
}

// scConfig is the configuration of both sides of the scale tests: a small
// region so that dozens of sessions at once stay cheap.
func scConfig(mode MemMapType, prefix string) *Config {
	conf := DefaultConfig()
	conf.MemMapType = mode
	conf.ShareMemoryPathPrefix = prefix
	conf.ShareMemoryBufferCap = 4 << 20
	conf.BufferSliceSizes = ReferenceSliceSizes()
	return conf
}

// scState is a snapshot of a process's resources.
type scState struct {
	goroutines int
	fds        int
	memfdMaps  int // mappings of any shmipc memfd
	prefixMaps int // mappings naming the prefix
	files      int // files under the prefix
	rss        uint64
	rssShmem   uint64
	live       int // registry.live (sessions of this package alive)
	srvBufs    int // serverBuffers cache entries
	cliBufs    int // clientBuffers pool entries
}

func (s scState) String() string {
	return fmt.Sprintf("goroutines=%d fds=%d memfdMaps=%d prefixMaps=%d files=%d rss=%dKiB rssShmem=%dKiB liveSessions=%d serverBufCache=%d clientBufPool=%d",
		s.goroutines, s.fds, s.memfdMaps, s.prefixMaps, s.files, s.rss>>10, s.rssShmem>>10, s.live, s.srvBufs, s.cliBufs)
}

// scProcStatus reads "Field: N kB" from /proc/<pid>/status, in bytes.
func scProcStatus(pid, field string) uint64 {
	b, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		name, rest, ok := strings.Cut(line, ":")
		if !ok || name != field {
			continue
		}
		num, _, _ := strings.Cut(strings.TrimSpace(rest), " ")
		v, _ := strconv.ParseUint(num, 10, 64)
		return v << 10
	}
	return 0
}

// scTakeSelf snapshots this process.
func scTakeSelf(prefix string) scState {
	runtime.GC()
	debug.FreeOSMemory()
	var s scState
	s.goroutines = runtime.NumGoroutine()
	fds, _ := clFds("self")
	s.fds = len(fds)
	memfd, ours, _ := clMaps("self", prefix)
	s.memfdMaps, s.prefixMaps = len(memfd), len(ours)
	if prefix != "" {
		s.files = len(shmFiles(prefix))
	}
	s.rss = scProcStatus("self", "VmRSS")
	s.rssShmem = scProcStatus("self", "RssShmem")
	registry.Lock()
	s.live = len(registry.live)
	registry.Unlock()
	serverBuffers.Lock()
	s.srvBufs = len(serverBuffers.m)
	serverBuffers.Unlock()
	clientBuffers.Lock()
	s.cliBufs = len(clientBuffers.m)
	clientBuffers.Unlock()
	return s
}

// scSettle polls take until ok holds or within passes; it returns the last
// snapshot and whether ok held.
func scSettle(within time.Duration, take func() scState, ok func(scState) bool) (scState, bool) {
	deadline := time.Now().Add(within)
	for {
		s := take()
		if ok(s) {
			return s, true
		}
		if time.Now().After(deadline) {
			return s, false
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// scCPUTicks returns utime+stime of process pid, in clock ticks.
func scCPUTicks(pid int) uint64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	f := strings.Fields(s[i+2:])
	// f[0] is state (field 3); utime is field 14, stime 15.
	u, _ := strconv.ParseUint(f[11], 10, 64)
	st, _ := strconv.ParseUint(f[12], 10, 64)
	return u + st
}

// scFrame builds an echo frame (mpServeEcho protocol) with payload p.
func scFrame(p []byte) []byte {
	msg := make([]byte, 4+len(p))
	binary.BigEndian.PutUint32(msg, uint32(len(p)))
	copy(msg[4:], p)
	return msg
}

// scEchoCheck opens a stream on sess, runs echo round trips of several
// sizes, and closes the stream.
func scEchoCheck(sess *Session, seed uint64) error {
	st, err := sess.OpenStream()
	if err != nil {
		return fmt.Errorf("OpenStream: %w", err)
	}
	defer st.Close()
	st.SetDeadline(time.Now().Add(20 * time.Second))
	for i, n := range []int{1, 64, 8 << 10, 100 << 10, 300 << 10} {
		if err := mpRoundTrip(st, mpPayload(n, seed+uint64(i)), i%2 == 0); err != nil {
			return err
		}
	}
	return nil
}

// scStacks returns the stacks of every goroutine, grouped crudely.
func scStacks(buf []byte) string {
	n := runtime.Stack(buf, true)
	return string(buf[:n])
}

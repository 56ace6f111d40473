package shmipc

// Many sessions from this process to one server process, then all closed:
// both processes must come back to their baselines.

import (
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

// scParseStats parses the fields of an scState line back (the ones we need).
func scParseStats(s string) map[string]int {
	out := make(map[string]int)
	for _, f := range strings.Fields(s) {
		k, v, ok := strings.Cut(f, "=")
		if !ok {
			continue
		}
		v = strings.TrimSuffix(v, "KiB")
		n, err := strconv.Atoi(v)
		if err == nil {
			out[k] = n
		}
	}
	return out
}

func TestScaleManySessions(t *testing.T) {
	if proctest.IsChild() {
		t.Skip()
	}
	n := 300
	if testing.Short() {
		n = 60
	}
	for _, mode := range bothModes {
		t.Run(mode.String(), func(t *testing.T) {
			prefix := shmPrefix(t, "scmany")
			conf := scConfig(mode, prefix)
			sock := scSock(t)
			srv := scStartServer(t, sock, prefix, mode, nil)
			// Warm up both sides with one session.
			s0, err := Dial("unix", sock, conf)
			if err != nil {
				t.Fatal(err)
			}
			if err := scEchoCheck(s0, 1); err != nil {
				t.Fatal(err)
			}
			s0.Close()
			childOK := func(m map[string]int) bool { return m["liveSessions"] == 0 }
			var childBase map[string]int
			deadline := time.Now().Add(20 * time.Second)
			for {
				childBase = scParseStats(scChildStats(t, srv))
				if childOK(childBase) || time.Now().After(deadline) {
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			base, _ := scSettle(10*time.Second, func() scState { return scTakeSelf(prefix) }, func(s scState) bool { return s.live == 0 })
			t.Logf("client baseline: %v", base)
			t.Logf("server baseline: %v", childBase)

			sessions := make([]*Session, n)
			var wg sync.WaitGroup
			errs := make(chan error, n)
			sem := make(chan struct{}, 16)
			for i := range n {
				wg.Add(1)
				sem <- struct{}{}
				go func() {
					defer wg.Done()
					defer func() { <-sem }()
					s, err := Dial("unix", sock, conf)
					if err != nil {
						errs <- err
						return
					}
					sessions[i] = s
					st, err := s.OpenStream()
					if err != nil {
						errs <- err
						return
					}
					st.SetDeadline(time.Now().Add(30 * time.Second))
					if err := mpRoundTrip(st, mpPayload(1000+i, uint64(i)), i%2 == 0 && i%3 != 0); err != nil {
						errs <- err
					}
					if i%3 != 0 {
						st.Close() // others left open, holding no slice: closed with the session (see TestScaleSessionCloseWithHeldReadSlice)
					}
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Errorf("session: %v", err)
			}
			peak := scTakeSelf(prefix)
			t.Logf("client with %d sessions: %v", n, peak)
			t.Logf("server with %d sessions: %s", n, scChildStats(t, srv))
			for _, s := range sessions {
				if s != nil {
					s.Close()
				}
			}
			after, ok := scSettle(30*time.Second, func() scState { return scTakeSelf(prefix) }, func(s scState) bool {
				return s.live == 0 && s.goroutines <= base.goroutines+2 && s.fds <= base.fds && s.prefixMaps <= base.prefixMaps &&
					s.memfdMaps <= base.memfdMaps && s.files <= base.files && s.cliBufs <= base.cliBufs
			})
			t.Logf("client after closing: %v", after)
			if !ok {
				t.Errorf("client resources not back after closing %d sessions:\n base  %v\n after %v", n, base, after)
			}
			var childAfter map[string]int
			var line string
			deadline = time.Now().Add(30 * time.Second)
			for {
				line = scChildStats(t, srv)
				childAfter = scParseStats(line)
				good := childAfter["liveSessions"] == 0 && childAfter["goroutines"] <= childBase["goroutines"]+2 &&
					childAfter["fds"] <= childBase["fds"] && childAfter["memfdMaps"] <= childBase["memfdMaps"] &&
					childAfter["prefixMaps"] <= childBase["prefixMaps"] && childAfter["serverBufCache"] <= childBase["serverBufCache"]
				if good {
					break
				}
				if time.Now().After(deadline) {
					t.Errorf("server resources not back after %d sessions closed:\n base  %v\n after %s", n, childBase, line)
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			t.Logf("server after closing: %s", line)
			if !raceEnabled && childAfter["rss"] > childBase["rss"]+64<<10 { // the race detector keeps its shadow memory
				t.Errorf("server RSS grew from %d KiB to %d KiB", childBase["rss"], childAfter["rss"])
			}
			// Still served.
			s1, err := Dial("unix", sock, conf)
			if err != nil {
				t.Fatal(err)
			}
			if err := scEchoCheck(s1, 77); err != nil {
				t.Error(err)
			}
			s1.Close()
			srv.Stop(20 * time.Second)
		})
	}
}

// A server in this process facing many client processes that come and go:
// some close cleanly, some exit without closing, some are SIGKILLed in the
// middle of a write, a read, a frame or a handshake. Afterwards the server's
// resources must be back near the baseline and a new client served.

var scBehaviors = []string{"clean", "exit", "killwrite", "killread", "killmidframe", "handshake-killer"}

// scRunClient starts one client child with behavior and sees it to its end.
func scRunClient(t *testing.T, sock string, mode MemMapType, prefix, behavior string, rng *rand.Rand, pids chan<- int) error {
	role, args := "churn-client", map[string]string{"SOCK": sock, "PREFIX": prefix, "MODE": mode.String(), "BEHAVIOR": behavior}
	if behavior == "handshake-killer" {
		role = "handshake-killer"
	}
	c := proctest.Start(t, proctest.Config{TestName: scChildTest, Role: role, Args: args})
	if pids != nil {
		pids <- c.Pid()
	}
	line, err := c.ReadLine(60 * time.Second)
	if err != nil {
		return err
	}
	switch line {
	case "done":
		if err := c.Wait(30 * time.Second); err != nil {
			return err
		}
		return nil
	case "busy":
		time.Sleep(time.Duration(rng.IntN(40)) * time.Millisecond)
		c.Kill()
		c.Wait(30 * time.Second)
		return nil
	}
	return nil
}

func TestScaleClientChurn(t *testing.T) {
	if proctest.IsChild() {
		t.Skip()
	}
	if testing.Short() {
		t.Skip("-short: a scale test: dozens of client processes")
	}
	total, concurrent := 96, 16
	if testing.Short() {
		total, concurrent = 12, 6
	}
	for _, mode := range testModes() {
		t.Run(mode.String(), func(t *testing.T) {
			prefix := shmPrefix(t, "scchurn")
			conf := scConfig(mode, prefix)
			sock := scSock(t)
			srv := clStartEcho(t, sock, conf)
			defer srv.close(t)

			// Warm up: one clean client, so what is created once exists.
			rng := rand.New(rand.NewPCG(uint64(os.Getpid()), 1))
			if err := scRunClient(t, sock, mode, prefix, "clean", rng, nil); err != nil {
				t.Fatalf("warm-up client: %v", err)
			}
			base, _ := scSettle(10*time.Second, func() scState { return scTakeSelf(prefix) }, func(s scState) bool { return s.live == 0 })
			t.Logf("baseline: %v", base)

			var wg sync.WaitGroup
			sem := make(chan struct{}, concurrent)
			var mu sync.Mutex
			var errs []string
			hkPids := make(chan int, total)
			for i := range total {
				b := scBehaviors[i%len(scBehaviors)]
				sem <- struct{}{}
				wg.Add(1)
				go func() {
					defer wg.Done()
					defer func() { <-sem }()
					r := rand.New(rand.NewPCG(uint64(i), 2))
					var pids chan int
					if b == "handshake-killer" {
						pids = hkPids
					}
					if err := scRunClient(t, sock, mode, prefix, b, r, pids); err != nil {
						mu.Lock()
						errs = append(errs, b+": "+err.Error())
						mu.Unlock()
					}
				}()
			}
			wg.Wait()
			for _, e := range errs {
				t.Errorf("client: %s", e)
			}
			// Files of a client killed in its handshake, before it named
			// them to the server, cannot be removed by the server (file
			// mode "leaves" things behind by design): count them apart.
			close(hkPids)
			var hkLeft []string
			for pid := range hkPids {
				for _, f := range shmFiles(fmt.Sprintf("%s_%d_", prefix, pid)) {
					hkLeft = append(hkLeft, f)
					os.Remove(f)
				}
			}
			if len(hkLeft) > 0 {
				t.Logf("files left by clients killed mid-handshake (removed): %d", len(hkLeft))
			}

			// A handshake-killer may leave files of a handshake the server
			// never heard of; count separately what files are left.
			after, ok := scSettle(30*time.Second, func() scState { return scTakeSelf(prefix) }, func(s scState) bool {
				return s.live == 0 && s.goroutines <= base.goroutines+2 && s.fds <= base.fds &&
					s.prefixMaps == 0 && s.memfdMaps <= base.memfdMaps && s.files == 0 && s.srvBufs <= base.srvBufs
			})
			t.Logf("after %d clients: %v", total, after)
			if !ok {
				t.Errorf("server resources not back to baseline 30s after %d clients:\n base  %v\n after %v", total, base, after)
				if after.files > 0 {
					t.Logf("files left: %s", strings.Join(shmFiles(prefix), " "))
				}
				if after.goroutines > base.goroutines+2 {
					buf := make([]byte, 1<<20)
					t.Logf("goroutines:\n%s", scStacks(buf))
				}
			}
			if !raceEnabled && after.rss > base.rss+64<<20 { // the race detector keeps its shadow memory
				t.Errorf("RSS grew from %d KiB to %d KiB", base.rss>>10, after.rss>>10)
			}
			// A new client is still served, with correct data.
			sess, err := Dial("unix", sock, conf)
			if err != nil {
				t.Fatalf("Dial after the churn: %v", err)
			}
			defer sess.Close()
			for i := range 4 {
				if err := scEchoCheck(sess, uint64(1000+i)); err != nil {
					t.Errorf("echo after the churn: %v", err)
				}
			}
		})
	}
}

package shmipc

// A client that never reads its replies (its buffer region full, the
// server's writers waiting for room) must not slow down or break other
// clients of the same server; fd exhaustion in a server process must not
// stop it for good nor make it spin.

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

// scRTT starts rtt-clients, lets them run for d and returns their results.
func scRTT(t *testing.T, sock, prefix string, mode MemMapType, n int, d time.Duration) []string {
	var cs []*proctest.Child
	for range n {
		c, _ := startChild(t, proctest.Config{TestName: scChildTest, Role: "rtt-client", Args: map[string]string{"SOCK": sock, "PREFIX": prefix, "MODE": mode.String()}})
		cs = append(cs, c)
	}
	time.Sleep(d)
	var out []string
	for _, c := range cs {
		c.CloseStdin()
		var res string
		for {
			line, err := c.ReadLine(60 * time.Second)
			if err != nil {
				t.Fatalf("rtt client: %v\n%s", err, c.Output())
			}
			if r, ok := strings.CutPrefix(line, "result "); ok {
				res = r
				break
			}
		}
		c.Wait(30 * time.Second)
		out = append(out, res)
	}
	return out
}

func TestScaleSlowReaderIsolation(t *testing.T) {
	if proctest.IsChild() {
		t.Skip()
	}
	if testing.Short() {
		t.Skip("-short: a scale test of several processes for several seconds")
	}
	for _, mode := range bothModes {
		t.Run(mode.String(), func(t *testing.T) {
			prefix := shmPrefix(t, "scslow")
			conf := scConfig(mode, prefix)
			sock := scSock(t)
			srv := clStartEcho(t, sock, conf)
			defer srv.close(t)

			alone := scRTT(t, sock, prefix, mode, 2, 2*time.Second)
			t.Logf("round trips without a slow reader (count maxms errs): %v", alone)

			var slows []*proctest.Child
			for range 3 {
				c, _ := startChild(t, proctest.Config{TestName: scChildTest, Role: "slow-reader", Args: map[string]string{"SOCK": sock, "PREFIX": prefix, "MODE": mode.String(), "STREAMS": "8"}})
				slows = append(slows, c)
			}
			time.Sleep(time.Second) // their regions fill, the server's writers wait
			with := scRTT(t, sock, prefix, mode, 2, 5*time.Second)
			t.Logf("round trips with 3 slow readers (count maxms errs): %v", with)
			for _, r := range with {
				var count, maxms, errs int
				fmt.Sscanf(r, "%d %d %d", &count, &maxms, &errs)
				// Bounds for a slow machine: what they catch is a client
				// stalled or failing, not a slower one.
				if errs > 0 || count < 10 || maxms > 10000 {
					t.Errorf("a client's round trips suffered from slow readers of the same server: count=%d max=%dms errors=%d (%s); alone: %v", count, maxms, errs, r, alone)
				}
			}
			for _, c := range slows {
				c.Kill()
				c.Wait(10 * time.Second)
			}
		})
	}
}

func TestScaleFdExhaustion(t *testing.T) {
	if proctest.IsChild() {
		t.Skip()
	}
	if testing.Short() {
		t.Skip("-short: a scale test: a server process run out of descriptors")
	}
	for _, mode := range testModes() {
		t.Run(mode.String(), func(t *testing.T) {
			prefix := shmPrefix(t, "scfd")
			conf := scConfig(mode, prefix)
			sock := scSock(t)
			srv := scStartServer(t, sock, prefix, mode, map[string]string{"NOFILE": "48"})
			defer srv.Stop(20 * time.Second)

			base := scParseStats(scChildStats(t, srv))
			// Connect until the server cannot take more.
			var mu sync.Mutex
			var sessions []*Session
			failed := 0
			var firstErr error
			var wg sync.WaitGroup
			sem := make(chan struct{}, 8)
			for i := range 80 {
				wg.Add(1)
				sem <- struct{}{}
				go func() {
					defer wg.Done()
					defer func() { <-sem }()
					s, err := Dial("unix", sock, conf)
					if err == nil {
						err = scEchoCheck(s, uint64(i))
						if err != nil {
							s.Close()
						}
					}
					mu.Lock()
					defer mu.Unlock()
					if err != nil {
						failed++
						if firstErr == nil {
							firstErr = err
						}
						return
					}
					sessions = append(sessions, s)
				}()
			}
			wg.Wait()
			t.Logf("%d sessions served, %d failed (first: %v)", len(sessions), failed, firstErr)
			if failed == 0 {
				t.Fatalf("the fd limit was not reached")
			}
			// At the limit, with a connection waiting in the backlog: CPU use.
			pending := make(chan error, 1)
			go func() {
				s, err := Dial("unix", sock, conf)
				if err == nil {
					s.Close()
				}
				pending <- err
			}()
			time.Sleep(300 * time.Millisecond)
			c0 := scCPUTicks(srv.Pid())
			time.Sleep(3 * time.Second)
			ticks := scCPUTicks(srv.Pid()) - c0
			t.Logf("server CPU at the fd limit: %d ticks in 3s (100 ticks = 1 CPU-second)", ticks)
			if ticks > 60 {
				t.Errorf("server uses %d%% of a CPU at the fd limit", ticks/3)
			}
			<-pending
			for _, s := range sessions {
				s.Close()
			}
			// Served again once clients have left.
			var err error
			deadline := time.Now().Add(30 * time.Second)
			for {
				var s *Session
				s, err = Dial("unix", sock, conf)
				if err == nil {
					err = scEchoCheck(s, 99)
					s.Close()
				}
				if err == nil || time.Now().After(deadline) {
					break
				}
				time.Sleep(200 * time.Millisecond)
			}
			if err != nil {
				t.Errorf("server not serving 30s after the clients left: %v\n%s", err, scChildStats(t, srv))
			}
			var line string
			deadline = time.Now().Add(30 * time.Second)
			for {
				line = scChildStats(t, srv)
				m := scParseStats(line)
				if m["liveSessions"] == 0 && m["memfdMaps"] == 0 && m["prefixMaps"] == 0 && m["serverBufCache"] == 0 && m["fds"] <= base["fds"] {
					break
				}
				if time.Now().After(deadline) {
					t.Errorf("server resources not released 30s after every client left (fd limit was hit):\n base  %v\n after %s", base, line)
					break
				}
				time.Sleep(300 * time.Millisecond)
			}
			t.Logf("server after: %s", line)
		})
	}
}

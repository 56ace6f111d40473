package shmipc

// Many sessions from this process to one server process, then all closed:
// both processes must come back to their baselines.

import (
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

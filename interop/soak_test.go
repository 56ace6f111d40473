package interop

import (
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/goshm/shmipc/interop/internal/cells"
)

// soakDuration is the length of each soak: SHMIPC_INTEROP_SOAK seconds,
// 20 by default, at least 15 (the RSS is compared with its value after
// 10 s).
func soakDuration(t *testing.T) time.Duration {
	secs := 20
	if v := os.Getenv("SHMIPC_INTEROP_SOAK"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 15 {
			t.Fatalf("SHMIPC_INTEROP_SOAK=%q: want a number of seconds, at least 15", v)
		}
		secs = n
	}
	return time.Duration(secs) * time.Second
}

// rssWatch samples the RSS of a reference process every 250 ms of a soak
// and keeps its peak over seconds 5-10 and over the last 5 s: the second at
// most 1.5 times the first (once, this library's fallback frames set off
// unbounded heap growth in the Rust reference). Peaks over a window, not
// single samples: a garbage-collected heap (the Go reference's) swings
// between collections.
type rssWatch struct {
	early, late int64
	err         error
	done        chan struct{}
}

func watchRSS(p *refProc, d time.Duration) *rssWatch {
	w := &rssWatch{done: make(chan struct{})}
	go func() {
		defer close(w.done)
		start := time.Now()
		for at := 5 * time.Second; at < d-500*time.Millisecond; at += 250 * time.Millisecond {
			time.Sleep(time.Until(start.Add(at)))
			rss, err := p.rss()
			if err != nil {
				w.err = err
				return
			}
			switch {
			case at <= 10*time.Second:
				w.early = max(w.early, rss)
			case at >= d-5*time.Second:
				w.late = max(w.late, rss)
			}
		}
	}()
	return w
}

func (w *rssWatch) check(t *testing.T, who string) {
	t.Helper()
	<-w.done
	if w.err != nil {
		t.Fatalf("RSS of the %s: %v", who, w.err)
	}
	t.Logf("RSS of the %s: peak %d KiB over seconds 5-10, %d KiB over the last 5 s", who, w.early>>10, w.late>>10)
	if float64(w.late) > 1.5*float64(w.early) {
		t.Errorf("RSS of the %s grew from a peak of %d KiB over seconds 5-10 to %d KiB over the last 5 s: more than 1.5 times", who, w.early>>10, w.late>>10)
	}
}

// TestSoak runs traffic with fallback data in both directions (a 1 MiB
// client region and 1.5 MiB frames on every other stream, small frames
// through shared memory on the others) for soakDuration: no error, no
// byte wrong, and the reference's RSS bounded. The soaks of one reference
// run at once.
func TestSoak(t *testing.T) {
	d := soakDuration(t)
	for _, ref := range []*reference{goRef, rustRef} {
		t.Run(ref.name, func(t *testing.T) {
			ref.need(t)
			for _, tr := range transports {
				if !(ref == rustRef && tr.tcp) { // rustServerTCP
					t.Run("our-client/"+tr.name, func(t *testing.T) {
						t.Parallel()
						soakOurClient(t, ref, tr, d)
					})
				}
				t.Run("our-server/"+tr.name, func(t *testing.T) {
					t.Parallel()
					soakOurServer(t, ref, tr, d)
				})
			}
		})
	}
}

func soakOurClient(t *testing.T, ref *reference, tr transport, d time.Duration) {
	n := newNames(t)
	t.Cleanup(func() { n.expectNoShm(t) })
	addr := tr.addr(t, n)
	srv := ref.startServer(t, addr)
	s, lib := dialOurs(t, addr, ourConfig(tr, n, regionSmall))
	rss := watchRSS(srv, d)
	var counts cells.SoakCounts
	if err := cells.Soak(lib, 4, cells.StopAfter(d), &counts); err != nil {
		t.Fatalf("after %d round trips: %v", counts.RoundTrips.Load(), err)
	}
	t.Logf("%d streams, %d round trips", counts.Streams.Load(), counts.RoundTrips.Load())
	expectFallbackBothWays(t, s)
	rss.check(t, ref.name+" server")
}

func soakOurServer(t *testing.T, ref *reference, tr transport, d time.Duration) {
	n := newNames(t)
	t.Cleanup(func() { n.expectNoShm(t) })
	srv, addr := startOurServer(t, tr, n)
	client := ref.startClient(t, addr, tr, n, "soak", "-duration", fmt.Sprintf("%ds", int(d.Seconds())))
	rss := watchRSS(client, d)
	rss.check(t, ref.name+" client")
	if err := client.wait(d); err != nil {
		t.Fatalf("%s client: %v", ref.name, err)
	}
	if _, err := client.waitLine(time.Second, func(l string) bool { return l == "PASS soak" }); err != nil {
		t.Fatalf("%s client exited 0 without PASS: %v", ref.name, err)
	}
	if !srv.fallIn.Load() || !srv.fallOut.Load() {
		t.Errorf("fallback data received %v, sent %v: want both", srv.fallIn.Load(), srv.fallOut.Load())
	}
	if bad := srv.badEnds(); len(bad) > 0 {
		t.Errorf("%d streams of our server ended badly, the first: %v", len(bad), bad[0])
	}
}

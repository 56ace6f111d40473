package interop

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/goshm/shmipc/interop/internal/cells"
)

// TestKill kills the reference process with SIGKILL in the middle of
// traffic with fallback data: this library's side must see a clean error
// (not a timeout, not a hang) within a second, work again with a fresh
// reference process, and leave nothing in /dev/shm.
func TestKill(t *testing.T) {
	for _, ref := range []*reference{goRef, rustRef} {
		t.Run(ref.name, func(t *testing.T) {
			ref.need(t)
			for _, tr := range transports {
				t.Run(tr.name, func(t *testing.T) {
					t.Run("server-killed", func(t *testing.T) {
						if ref == rustRef && tr.tcp {
							t.Logf("%s: no traffic to interrupt (TestOurClientRustServer checks how we fail)", rustServerTCP)
							return
						}
						killServer(t, ref, tr)
					})
					t.Run("client-killed", func(t *testing.T) { killClient(t, ref, tr) })
				})
			}
		})
	}
}

// waitFor polls cond every 10 ms until it holds or timeout passes.
func waitFor(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(10 * time.Millisecond)
	}
	return true
}

// killServer: this library's session manager against a reference server
// that is killed, then started afresh at the same address.
func killServer(t *testing.T, ref *reference, tr transport) {
	n := newNames(t)
	t.Cleanup(func() { n.expectNoShm(t) })
	addr := tr.addr(t, n)
	srv := ref.startServer(t, addr)
	m, lib := managerOurs(t, addr, ourConfig(tr, n, regionSmall), 1)
	var counts cells.SoakCounts
	soakErr := make(chan error, 1)
	go func() { soakErr <- cells.Soak(lib, 4, make(chan struct{}), &counts) }()
	if !waitFor(10*time.Second, func() bool { return counts.RoundTrips.Load() >= 40 }) {
		t.Fatalf("only %d round trips before the kill", counts.RoundTrips.Load())
	}
	killed := time.Now()
	srv.kill()
	select {
	case err := <-soakErr:
		took := time.Since(killed)
		var ne net.Error
		switch {
		case err == nil:
			t.Fatal("traffic went on without error after the server was killed")
		case errors.As(err, &ne) && ne.Timeout():
			t.Fatalf("after %v, a timeout instead of the session's end: %v", took, err)
		}
		t.Logf("every stream failed %v after the kill; the first: %v", took.Round(time.Millisecond), firstLine(err))
	case <-time.After(time.Second):
		t.Fatal("traffic did not fail within a second of the kill")
	}

	ref.startServer(t, addr)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := m.GetStreamContext(ctx)
	if err != nil {
		t.Fatalf("no stream from the fresh server: %v", err)
	}
	defer st.Close()
	if err := cells.RoundTrip(st, cells.Pattern(cells.FallbackSize, 5)); err != nil {
		t.Fatalf("fresh server: %v", err)
	}
}

// killClient: a reference client killed in the middle of traffic against
// this library's server, then a fresh reference client.
func killClient(t *testing.T, ref *reference, tr transport) {
	n := newNames(t)
	t.Cleanup(func() { n.expectNoShm(t) })
	srv, addr := startOurServer(t, tr, n)
	client := ref.startClient(t, addr, tr, n, "traffic")
	if !waitFor(15*time.Second, func() bool { return srv.endCount() >= 20 }) {
		t.Fatalf("only %d streams served before the kill", srv.endCount())
	}
	if srv.active.Load() == 0 {
		t.Fatal("no stream open at the time of the kill")
	}
	killed := time.Now()
	client.kill()
	if !waitFor(time.Second, func() bool { return srv.active.Load() == 0 }) {
		t.Fatalf("%d streams of our server still open a second after the client was killed", srv.active.Load())
	}
	t.Logf("every stream of our server ended %v after the kill", time.Since(killed).Round(time.Millisecond))
	ref.runClient(t, addr, tr, n, "concurrent")
}

func firstLine(err error) string {
	s := err.Error()
	for i, c := range s {
		if c == '\n' {
			return s[:i]
		}
	}
	return s
}

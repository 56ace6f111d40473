package interop

import (
	"strings"
	"testing"
	"time"

	"github.com/goshm/shmipc"

	"github.com/goshm/shmipc/interop/internal/cells"
)

// The cells with this library as the client and a reference server, and
// with a reference client and this library as the server, for every
// transport. TestKill and TestSoak hold the other cells.

func TestOurClientGoServer(t *testing.T)   { ourClientCells(t, goRef) }
func TestOurClientRustServer(t *testing.T) { ourClientCells(t, rustRef) }
func TestGoClientOurServer(t *testing.T)   { refClientCells(t, goRef) }
func TestRustClientOurServer(t *testing.T) { refClientCells(t, rustRef) }

// ourClientCell is one cell with this library as the client.
type ourClientCell struct {
	name string
	run  func(t *testing.T, ref *reference, srv *refProc, addr string, tr transport, n names)
}

var ourClientCellList = []ourClientCell{
	{"sizes", func(t *testing.T, ref *reference, _ *refProc, addr string, tr transport, n names) {
		// Messages of more than half the 32 MiB region go as fallback data,
		// in frames of at most 32 MiB: the Rust reference panics on a larger
		// one (rustFallbackFrameLimit), so 40 MiB goes as two frames.
		s, lib := dialOurs(t, addr, ourConfig(tr, n, regionRef))
		if err := cells.Sizes(lib, cells.DefaultSizes); err != nil {
			t.Fatal(err)
		}
		expectFallbackBothWays(t, s)
		if ref == rustRef {
			t.Logf("%s: 33 and 40 MiB went to the Rust server as fallback data in frames of at most 32 MiB", rustFallbackFrameLimit)
		}
	}},
	{"concurrent16", func(t *testing.T, _ *reference, _ *refProc, addr string, tr transport, n names) {
		_, lib := dialOurs(t, addr, ourConfig(tr, n, regionDefault))
		if err := cells.Concurrent(lib, 16, 20); err != nil {
			t.Fatal(err)
		}
	}},
	{"sessions4", func(t *testing.T, _ *reference, _ *refProc, addr string, tr transport, n names) {
		m, lib := managerOurs(t, addr, ourConfig(tr, n, regionDefault), 4)
		if got := len(m.Sessions()); got != 4 {
			t.Fatalf("%d sessions open, want 4", got)
		}
		if err := cells.Concurrent(lib, 64, 5); err != nil {
			t.Fatal(err)
		}
	}},
	{"sequential1000", func(t *testing.T, _ *reference, _ *refProc, addr string, tr transport, n names) {
		_, lib := dialOurs(t, addr, ourConfig(tr, n, regionDefault))
		if err := cells.Sequential(lib, 1000); err != nil {
			t.Fatal(err)
		}
	}},
	{"closeorder", func(t *testing.T, ref *reference, srv *refProc, addr string, tr transport, n names) {
		s, lib := dialOurs(t, addr, ourConfig(tr, n, regionSmall))
		if err := cells.CloseAfterFallback(lib); err != nil {
			t.Fatalf("the server's last bytes as fallback data, then its close: %v", err)
		}
		sent, err := cells.CloseAfterSend(lib)
		if err != nil {
			t.Fatalf("our last bytes as fallback data, then our close: %v", err)
		}
		expectFallbackBothWays(t, s)
		line, err := srv.waitLine(10*time.Second, func(l string) bool { return strings.HasSuffix(l, " "+sent.String()) })
		if err != nil {
			t.Fatalf("the %s server reported no stream with all %s: %v", ref.name, sent, err)
		}
		if line != "end eof "+sent.String() {
			if ref == goRef && line == "end error: stream closed "+sent.String() {
				t.Logf("%s: the Go server read every byte, then ended the stream with \"stream closed\" instead of end-of-stream", goServerStreamClosed)
			} else {
				t.Fatalf("the %s server got every byte, then %q, want end-of-stream", ref.name, line)
			}
		}
	}},
}

// expectFallbackBothWays checks that s both sent and received fallback
// data, so that a cell meant to force it did.
func expectFallbackBothWays(t *testing.T, s *shmipc.Session) {
	t.Helper()
	st := s.Stats()
	if st.FallbackMessagesOut == 0 || st.FallbackMessagesIn == 0 {
		t.Errorf("fallback data sent %d, received %d messages: want both", st.FallbackMessagesOut, st.FallbackMessagesIn)
	}
}

func ourClientCells(t *testing.T, ref *reference) {
	ref.need(t)
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			if ref == rustRef && tr.tcp {
				rustServerOverTCP(t, tr)
				return
			}
			if ref == rustRef && tr.mode == "file" {
				t.Logf("%s: every cell starts a fresh Rust server", rustClosesFD0)
			}
			for _, c := range ourClientCellList {
				t.Run(c.name, func(t *testing.T) {
					n := newNames(t)
					// Runs last: after our sessions closed and the server ended.
					t.Cleanup(func() { n.expectNoShm(t) })
					addr := tr.addr(t, n)
					// A fresh server per cell: the Rust reference closes fd 0
					// after unmapping a file-mode region (rustClosesFD0).
					srv := ref.startServer(t, addr)
					c.run(t, ref, srv, addr, tr, n)
				})
			}
		})
	}
}

// refClientCell is one cell with a reference client and this library as
// the server; the reference client runs the cell of the same name.
type refClientCell struct {
	name  string
	check func(t *testing.T, ref *reference, srv *ourServer, client *refProc)
}

var refClientCellList = []refClientCell{
	{"sizes", func(t *testing.T, _ *reference, srv *ourServer, _ *refProc) {
		// The client's region is 32 MiB: 33 and 40 MiB come as fallback data.
		if !srv.fallIn.Load() || !srv.fallOut.Load() {
			t.Errorf("fallback data received %v, sent %v: want both", srv.fallIn.Load(), srv.fallOut.Load())
		}
	}},
	{"concurrent", nil},
	{"sessions", func(t *testing.T, _ *reference, srv *ourServer, _ *refProc) {
		if got := srv.conns.Load(); got != 4 {
			t.Errorf("%d connections from the client, want 4 sessions", got)
		}
	}},
	{"sequential", func(t *testing.T, _ *reference, srv *ourServer, _ *refProc) {
		// The client may exit before our server has seen its last close.
		if !srv.waitEndCount(1000, 5*time.Second) {
			t.Errorf("%d streams served, want 1000", srv.endCount())
		}
	}},
	{"closeorder", func(t *testing.T, ref *reference, srv *ourServer, client *refProc) {
		line, err := client.waitLine(time.Second, func(l string) bool { return strings.HasPrefix(l, "sent ") })
		if err != nil {
			t.Fatalf("the %s client printed no sent line: %v", ref.name, err)
		}
		sent := strings.TrimPrefix(line, "sent ")
		end, ok := srv.waitEnd(5*time.Second, func(e cells.End) bool { return e.Sent().String() == sent })
		if !ok {
			t.Fatalf("no stream of our server received exactly %s", sent)
		}
		if end.How != "eof" {
			t.Fatalf("our server got every byte of %s, then %q, want end-of-stream", sent, end.How)
		}
		if !srv.fallIn.Load() || !srv.fallOut.Load() {
			t.Errorf("fallback data received %v, sent %v: want both", srv.fallIn.Load(), srv.fallOut.Load())
		}
	}},
}

func refClientCells(t *testing.T, ref *reference) {
	ref.need(t)
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			for _, c := range refClientCellList {
				t.Run(c.name, func(t *testing.T) {
					n := newNames(t)
					t.Cleanup(func() { n.expectNoShm(t) })
					srv, addr := startOurServer(t, tr, n)
					client := ref.runClient(t, addr, tr, n, c.name)
					if c.check != nil {
						c.check(t, ref, srv, client)
					}
					if bad := srv.badEnds(); len(bad) > 0 {
						t.Errorf("%d streams of our server ended badly, the first: %v", len(bad), bad[0])
					}
				})
			}
		})
	}
}

package interop

import (
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goshm/shmipc"

	"github.com/goshm/shmipc/interop/internal/cells"
)

func ourIsEOF(err error) bool { return errors.Is(err, io.EOF) }

// region is the client's buffer region for a cell.
type region int

const (
	regionDefault region = iota // this library's default, 128 MiB
	regionRef                   // 32 MiB in the references' layout
	regionSmall                 // 1 MiB in the references' layout: forces fallback data
)

// ourConfig is this library's client configuration for a cell.
func ourConfig(tr transport, n names, r region) *shmipc.Config {
	conf := shmipc.DefaultConfig()
	conf.ShareMemoryPathPrefix = n.prefix
	conf.MemMapType = shmipc.MemMapTypeMemFd
	if tr.mode == "file" {
		conf.MemMapType = shmipc.MemMapTypeDevShmFile
	}
	switch r {
	case regionRef:
		conf.ShareMemoryBufferCap = 32 << 20
		conf.BufferSliceSizes = shmipc.ReferenceSliceSizes()
		conf.FallbackWhenFull = true
	case regionSmall:
		conf.ShareMemoryBufferCap = 1 << 20
		conf.BufferSliceSizes = shmipc.ReferenceSliceSizes()
		conf.FallbackWhenFull = true
	}
	return conf
}

func splitAddr(addr string) (network, address string) {
	network, address, _ = strings.Cut(addr, ":")
	return network, address
}

// dialOurs opens one session of this library to addr, closed when the
// test ends.
func dialOurs(t *testing.T, addr string, conf *shmipc.Config) (*shmipc.Session, cells.Lib) {
	t.Helper()
	network, address := splitAddr(addr)
	s, err := shmipc.Dial(network, address, conf)
	if err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	t.Cleanup(func() { s.Close() })
	return s, cells.Lib{
		Open: func() (cells.Stream, error) {
			st, err := s.OpenStream()
			if err != nil {
				return nil, err
			}
			return st, nil
		},
		IsEOF: ourIsEOF,
	}
}

// managerOurs opens a session manager of this library to addr, closed
// when the test ends.
func managerOurs(t *testing.T, addr string, conf *shmipc.Config, sessions int) (*shmipc.SessionManager, cells.Lib) {
	t.Helper()
	network, address := splitAddr(addr)
	m, err := shmipc.NewSessionManager(shmipc.SessionManagerConfig{
		Config: conf, Network: network, Address: address, SessionNum: sessions,
	})
	if err != nil {
		t.Fatalf("session manager for %s: %v", addr, err)
	}
	t.Cleanup(func() { m.Close() })
	return m, cells.Lib{
		Open: func() (cells.Stream, error) {
			st, err := m.GetStream()
			if err != nil {
				return nil, err
			}
			return st, nil
		},
		IsEOF: ourIsEOF,
	}
}

// ourServer is this library's echo server, in the test process.
type ourServer struct {
	ln       *shmipc.Listener
	conns    atomic.Int32 // connections accepted
	active   atomic.Int32 // streams being echoed
	fallIn   atomic.Bool  // a session received fallback data
	fallOut  atomic.Bool  // a session sent fallback data
	mu       sync.Mutex
	ends     []cells.End
	endAdded chan struct{}
}

// startOurServer serves the echo contract at a new address of tr.
func startOurServer(t *testing.T, tr transport, n names) (*ourServer, string) {
	t.Helper()
	network, address := "unix", n.sock
	if tr.tcp {
		// Bound here, not picked free and bound again: another cell
		// running in parallel may take a port between the two.
		network, address = "tcp", "127.0.0.1:0"
	}
	nl, err := net.Listen(network, address)
	if err != nil {
		t.Fatal(err)
	}
	addr := network + ":" + nl.Addr().String()
	srv := &ourServer{endAdded: make(chan struct{})}
	srv.ln = shmipc.NewListener(countingListener{nl, &srv.conns}, shmipc.DefaultConfig())
	done := make(chan struct{})
	go func() {
		defer close(done)
		srv.ln.Serve(func(st *shmipc.Stream) {
			srv.active.Add(1)
			defer srv.active.Add(-1)
			end := cells.Echo(st, ourIsEOF)
			stats := st.Session().Stats()
			if stats.FallbackMessagesIn > 0 {
				srv.fallIn.Store(true)
			}
			if stats.FallbackMessagesOut > 0 {
				srv.fallOut.Store(true)
			}
			srv.mu.Lock()
			srv.ends = append(srv.ends, end)
			close(srv.endAdded)
			srv.endAdded = make(chan struct{})
			srv.mu.Unlock()
		})
	}()
	t.Cleanup(func() {
		srv.ln.CloseAll()
		<-done
	})
	return srv, addr
}

type countingListener struct {
	net.Listener
	n *atomic.Int32
}

func (l countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.n.Add(1)
	}
	return c, err
}

// waitEnd waits for a stream end for which match is true.
func (s *ourServer) waitEnd(timeout time.Duration, match func(cells.End) bool) (cells.End, bool) {
	deadline := time.After(timeout)
	seen := 0
	for {
		s.mu.Lock()
		ends, added := s.ends, s.endAdded
		s.mu.Unlock()
		for ; seen < len(ends); seen++ {
			if match(ends[seen]) {
				return ends[seen], true
			}
		}
		select {
		case <-added:
		case <-deadline:
			return cells.End{}, false
		}
	}
}

// waitEndCount waits until n streams have ended.
func (s *ourServer) waitEndCount(n int, timeout time.Duration) bool {
	_, ok := s.waitEnd(timeout, func(cells.End) bool { n--; return n <= 0 })
	return ok
}

func (s *ourServer) endCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.ends)
}

// badEnds returns the streams that ended otherwise than as the echo
// contract ends them.
func (s *ourServer) badEnds() []cells.End {
	s.mu.Lock()
	defer s.mu.Unlock()
	var bad []cells.End
	for _, e := range s.ends {
		if e.How != "eof" && e.How != "zero" {
			bad = append(bad, e)
		}
	}
	return bad
}

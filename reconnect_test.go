package shmipc

import (
	"context"
	"net"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// rcServer completes the handshake of every client and then, while it is
// not healthy, closes the session at once (as a server does that refuses
// the client after the handshake); once healthy it serves the echo of
// mpServeEcho.
type rcServer struct {
	ln      net.Listener
	conf    *Config
	dials   atomic.Int32 // connections accepted
	healthy atomic.Bool
	wg      sync.WaitGroup

	mu       sync.Mutex
	sessions []*Session // kept open
}

func rcStart(t *testing.T, sock string, conf *Config) *rcServer {
	t.Helper()
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &rcServer{ln: ln, conf: conf}
	srv.wg.Add(1)
	go srv.acceptLoop()
	t.Cleanup(srv.close)
	return srv
}

func (srv *rcServer) acceptLoop() {
	defer srv.wg.Done()
	for {
		c, err := srv.ln.Accept()
		if err != nil {
			return
		}
		srv.dials.Add(1)
		srv.wg.Add(1)
		go func() {
			defer srv.wg.Done()
			s, err := Server(c, srv.conf)
			if err != nil {
				return
			}
			if !srv.healthy.Load() {
				s.Close()
				return
			}
			srv.mu.Lock()
			srv.sessions = append(srv.sessions, s)
			srv.mu.Unlock()
			for {
				st, err := s.AcceptStream()
				if err != nil {
					return
				}
				srv.wg.Add(1)
				go func() {
					defer srv.wg.Done()
					_ = mpServeEcho(st)
				}()
			}
		}()
	}
}

func (srv *rcServer) close() {
	srv.ln.Close()
	srv.mu.Lock()
	for _, s := range srv.sessions {
		s.Close()
	}
	srv.mu.Unlock()
	srv.wg.Wait()
}

// TestSessionManagerBackoffAcrossShortSessions: against a server that
// completes each handshake and drops the session at once, the manager's
// re-dials slow down (the backoff is not reset by a dial whose session dies
// straight away), and once the server is healthy the manager recovers.
func TestSessionManagerBackoffAcrossShortSessions(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: watches a backoff grow over seconds")
	}
	prefix := shmPrefix(t, "rc")
	conf := clConfig(MemMapTypeMemFd, prefix)
	conf.BufferSliceSizes = ReferenceSliceSizes()
	conf.ShareMemoryBufferCap = minBufferCap
	conf.InitializeTimeout = 10 * time.Second
	sock := filepath.Join(t.TempDir(), "s.sock")
	srv := rcStart(t, sock, conf)

	m, err := NewSessionManager(SessionManagerConfig{
		Config:              conf,
		Network:             "unix",
		Address:             sock,
		MinReconnectBackoff: 10 * time.Millisecond,
		MaxReconnectBackoff: 2 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()

	// Doubling from 10 ms, the dials fall 10, 30, 70, 150, 310, 630 and
	// 1270 ms after the first: eight in two seconds. Allow for more.
	const window, maxDials = 2 * time.Second, 20
	time.Sleep(window)
	n := srv.dials.Load()
	t.Logf("%d dials in %v against a server that drops every session", n, window)
	if n > maxDials {
		t.Errorf("%d dials in %v against a server that drops every session, want at most %d", n, window, maxDials)
	}

	srv.healthy.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var lastErr error
	for ctx.Err() == nil {
		st, err := m.GetStreamContext(ctx)
		if err != nil {
			lastErr = err
			continue
		}
		st.SetDeadline(time.Now().Add(5 * time.Second))
		if lastErr = mpRoundTrip(st, mpPayload(64, 3), false); lastErr == nil {
			m.PutBack(st)
			return
		}
		st.Close() // a session dropped before the server became healthy
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("no echo through the manager 20s after the server became healthy: %v", lastErr)
}

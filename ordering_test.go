package shmipc

// Ordering of a close after FallbackData, against a peer in another process
// that behaves as both reference implementations do: it writes a stream's
// last bytes as FallbackData on the socket, waits until the write has
// completed, then publishes the close as a queue element. Every byte must
// arrive, followed by exactly one clean end of stream.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

// orderingServerPeer starts the peer process as a server on network
// (a Unix socket of the test's own, or TCP loopback) and returns its
// address.
func orderingServerPeer(t *testing.T, network, mode string) string {
	t.Helper()
	addr := "127.0.0.1:0"
	if network == "unix" {
		addr = filepath.Join(t.TempDir(), "peer.sock")
	}
	c, info := startChild(t, proctest.Config{
		TestName: "TestOrderingPeerChild",
		Role:     "order-server",
		Args:     map[string]string{"NET": network, "ADDR": addr, "MODE": mode},
		Timeout:  5 * time.Minute,
	})
	t.Cleanup(func() {
		if err := c.Stop(30 * time.Second); err != nil {
			t.Errorf("peer: %v\n%s", err, c.Output())
		}
	})
	return info
}

// orderingClientPeer starts the peer process as a client of addr; it
// opens streams streams of size + 37·k bytes each and keeps its session
// until the test ends.
func orderingClientPeer(t *testing.T, network, addr, mode, prefix string, streams, size int) *proctest.Child {
	t.Helper()
	c := proctest.Start(t, proctest.Config{
		TestName: "TestOrderingPeerChild",
		Role:     "order-client",
		Args: map[string]string{"NET": network, "ADDR": addr, "MODE": mode, "PREFIX": prefix,
			"COUNT": fmt.Sprint(streams), "SIZE": fmt.Sprint(size)},
		Timeout: 5 * time.Minute,
	})
	t.Cleanup(func() {
		if err := c.Stop(30 * time.Second); err != nil {
			t.Errorf("peer: %v\n%s", err, c.Output())
		}
	})
	return c
}

// orderingPattern is the peer's byte sequence for stream id.
func orderingPattern(id uint32, size int) []byte {
	p := make([]byte, size)
	start := int(13*id) % 251
	for i := range p {
		p[i] = byte((start + i) % 251)
	}
	return p
}

// readToEnd reads a stream until it ends and checks it got exactly want,
// then a clean end of stream (and nothing after it).
func readToEnd(st *Stream, want []byte) error {
	st.SetReadDeadline(time.Now().Add(30 * time.Second))
	got := make([]byte, 0, len(want))
	buf := make([]byte, 256<<10)
	for {
		n, err := st.Read(buf)
		got = append(got, buf[:n]...)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("stream %d: after %d of %d bytes: %w", st.ID(), len(got), len(want), err)
		}
	}
	if len(got) != len(want) {
		return fmt.Errorf("stream %d: %d bytes then end of stream, want %d (lost %d)", st.ID(), len(got), len(want), len(want)-len(got))
	}
	if !bytes.Equal(got, want) {
		i := 0
		for got[i] == want[i] {
			i++
		}
		return fmt.Errorf("stream %d: byte %d is %d, want %d", st.ID(), i, got[i], want[i])
	}
	if n, err := st.Read(buf); n != 0 || !errors.Is(err, io.EOF) {
		return fmt.Errorf("stream %d: after the end of stream Read returned %d bytes, %v", st.ID(), n, err)
	}
	return nil
}

// orderingRounds is how many streams each ordering test runs: fewer with
// -short.
func orderingRounds() int {
	if testing.Short() {
		return 10
	}
	return 100
}

// Our client against a server that replies by FallbackData and then closes
// with a queue element, with and without spinning.
func TestOrderingFallbackThenCloseClient(t *testing.T) {
	testOrderingClient(t, "unix", MemMapTypeMemFd)
}

// Our server against a client that sends each stream's bytes by
// FallbackData and closes it with a queue element right after.
func TestOrderingFallbackThenCloseServer(t *testing.T) {
	for _, mode := range []string{"memfd", "file"} {
		t.Run(mode, func(t *testing.T) { testOrderingServer(t, "unix", mode) })
	}
}

func testOrderingClient(t *testing.T, network string, mode MemMapType) {
	modeArg := "file"
	if mode == MemMapTypeMemFd {
		modeArg = "memfd"
	}
	for _, spin := range []time.Duration{0, DefaultConfig().ConsumerSpinTime} {
		t.Run(fmt.Sprintf("spin=%v", spin), func(t *testing.T) {
			addr := orderingServerPeer(t, network, modeArg)
			conf := DefaultConfig()
			conf.MemMapType = mode
			conf.ConsumerSpinTime = spin
			conf.ShareMemoryPathPrefix = shmPrefix(t, "order")
			s, err := Dial(network, addr, conf)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			var total uint64
			for k := 0; k < orderingRounds(); k++ {
				size := 1<<20 + k*(48<<10) // 1 to ~5.6 MiB, one to two frames each
				total += uint64(size)
				st, err := s.OpenStream()
				if err != nil {
					t.Fatal(err)
				}
				var req [8]byte
				binary.BigEndian.PutUint64(req[:], uint64(size))
				if _, err := st.Write(req[:]); err != nil {
					t.Fatal(err)
				}
				err = readToEnd(st, orderingPattern(st.ID(), size))
				st.Close()
				if err != nil {
					t.Fatalf("round %d: %v", k, err)
				}
			}
			if got := s.Stats().FallbackBytesIn; got < total {
				t.Errorf("%d bytes arrived as FallbackData, want all %d", got, total)
			}
		})
	}
}

func testOrderingServer(t *testing.T, network, mode string) {
	streams := orderingRounds()
	const size = 1 << 20
	conf := DefaultConfig()
	prefix := shmPrefix(t, "order") // the peer's names, in the server's directory
	conf.ShareMemoryPathPrefix = prefix
	addr := "127.0.0.1:0"
	if network == "unix" {
		addr = filepath.Join(t.TempDir(), "srv.sock")
	}
	ln, err := Listen(network, addr, conf)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var mu sync.Mutex
	var errs []error
	var wg sync.WaitGroup
	wg.Add(streams)
	go func() {
		for k := 0; k < streams; k++ {
			st, err := ln.AcceptStream()
			if err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
				for ; k < streams; k++ {
					wg.Done()
				}
				return
			}
			go func() {
				defer wg.Done()
				defer st.Close()
				// Streams are opened in order: the k-th has id k+2.
				if err := readToEnd(st, orderingPattern(st.ID(), size+37*int(st.ID()-2))); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
				}
			}()
		}
	}()
	peer := orderingClientPeer(t, network, ln.Addr().String(), mode, prefix, streams, size)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-peer.Done():
		select {
		case <-done:
		case <-time.After(2 * time.Minute):
			t.Fatalf("the peer exited before the streams ended:\n%s", peer.Output())
		}
	case <-time.After(2 * time.Minute):
		t.Fatal("the streams did not all end within 2 minutes")
	}
	mu.Lock()
	defer mu.Unlock()
	for _, err := range errs {
		t.Error(err)
	}
	var total, got uint64
	for k := range streams {
		total += uint64(size + 37*k)
	}
	for s := range listenerSessions(ln) {
		got += s.Stats().FallbackBytesIn
	}
	if got < total {
		t.Errorf("%d bytes arrived as FallbackData, want all %d", got, total)
	}
}

// TestOrderingFallbackThenCloseTCPClient is TestOrderingFallbackThenCloseClient
// over TCP loopback, with file-mode regions.
func TestOrderingFallbackThenCloseTCPClient(t *testing.T) {
	testOrderingClient(t, "tcp", MemMapTypeDevShmFile)
}

// TestOrderingFallbackThenCloseTCPServer is TestOrderingFallbackThenCloseServer
// over TCP loopback, with file-mode regions.
func TestOrderingFallbackThenCloseTCPServer(t *testing.T) {
	testOrderingServer(t, "tcp", "file")
}

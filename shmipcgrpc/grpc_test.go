package shmipcgrpc_test

// gRPC over shmipc between two processes, with shmipcgrpc's options and
// credentials/local on both sides: the server is this test binary started
// again (child_test.go).

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/goshm/shmipc"
	"github.com/goshm/shmipc/shmipcgrpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/local"
	"google.golang.org/grpc/peer"
)

const testTimeout = 60 * time.Second

// dialShm connects a gRPC client with shmipcgrpc's options and local
// credentials to a shmipc server at network and addr; it closes both at the
// test's end.
func dialShm(t testing.TB, network, addr string) *grpc.ClientConn {
	t.Helper()
	conf := shmipc.DefaultConfig()
	if network == "tcp" {
		conf.MemMapType = shmipc.MemMapTypeDevShmFile // memfds need a Unix socket
	}
	m, err := shmipc.NewSessionManager(shmipc.SessionManagerConfig{Network: network, Address: addr, Config: conf})
	if err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient(shmipcgrpc.Target, append(shmipcgrpc.DialOptions(m),
		grpc.WithTransportCredentials(local.NewCredentials()), callOpts)...)
	if err != nil {
		m.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cc.Close()
		m.Close()
	})
	return cc
}

func payload(n int, seed uint64) []byte {
	p := make([]byte, n)
	r := rand.New(rand.NewPCG(seed, uint64(n)))
	for i := range p {
		p[i] = byte(r.Uint32())
	}
	return p
}

// Unary calls of 0 B to 1 MiB, one at a time and from 8 goroutines at
// once, come back intact, and their bytes went through shmipc.
func TestUnaryEcho(t *testing.T) {
	srv := startTestServer(t, shmUnix)
	cc := dialShm(t, "unix", srv.addrs[shmUnix])
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()

	before := shmipc.AggregateStats()
	sent := 0
	for _, size := range []int{0, 1, 64, 4 << 10, 64 << 10, 1 << 20, 3<<20 + 1} {
		req := payload(size, 1)
		resp, err := echo(ctx, cc, req)
		if err != nil {
			t.Fatalf("%d B: %v", size, err)
		}
		if !bytes.Equal(resp, req) {
			t.Fatalf("%d B: %d bytes back, or different bytes", size, len(resp))
		}
		sent += size
	}

	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := range 8 {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(g), 2))
			for i := range 25 {
				req := payload(r.IntN(256<<10), uint64(g*100+i))
				resp, err := echo(ctx, cc, req)
				if err == nil && !bytes.Equal(resp, req) {
					err = fmt.Errorf("%d bytes back for %d, or different bytes", len(resp), len(req))
				}
				if err != nil {
					errs <- fmt.Errorf("goroutine %d, call %d: %w", g, i, err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}

	after := shmipc.AggregateStats()
	if out := after.BytesOut - before.BytesOut; out < uint64(sent) {
		t.Errorf("this process's shmipc sessions sent %d bytes, less than the %d of the requests: the calls did not go through shmipc", out, sent)
	}
	var srvStats shmipc.Stats
	if err := getJSON(ctx, cc, methodStats, &srvStats); err != nil {
		t.Fatal(err)
	}
	if srvStats.BytesIn < uint64(sent) {
		t.Errorf("the server's shmipc sessions received %d bytes, less than the %d of the requests", srvStats.BytesIn, sent)
	}
}

// A bidirectional stream echoes messages in order, in lock-step and with
// the client sending while it receives, and ends with io.EOF.
func TestStreaming(t *testing.T) {
	srv := startTestServer(t, shmUnix)
	cc := dialShm(t, "unix", srv.addrs[shmUnix])
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()

	t.Run("lockstep", func(t *testing.T) {
		stream, err := cc.NewStream(ctx, bidiDesc, methodBidi)
		if err != nil {
			t.Fatal(err)
		}
		for i := range 200 {
			msg := payload(i*397%(300<<10), uint64(i))
			if err := stream.SendMsg(&msg); err != nil {
				t.Fatalf("send %d: %v", i, err)
			}
			var got []byte
			if err := stream.RecvMsg(&got); err != nil {
				t.Fatalf("receive %d: %v", i, err)
			}
			if !bytes.Equal(got, msg) {
				t.Fatalf("message %d: %d bytes back for %d, or different bytes", i, len(got), len(msg))
			}
		}
		if err := stream.CloseSend(); err != nil {
			t.Fatal(err)
		}
		var extra []byte
		if err := stream.RecvMsg(&extra); !errors.Is(err, io.EOF) {
			t.Fatalf("after CloseSend: %v, want io.EOF", err)
		}
	})

	t.Run("pipelined", func(t *testing.T) {
		stream, err := cc.NewStream(ctx, bidiDesc, methodBidi)
		if err != nil {
			t.Fatal(err)
		}
		const n = 500
		size := func(i int) int { return 1 + i*31%(64<<10) }
		sendErr := make(chan error, 1)
		go func() {
			for i := range n {
				msg := payload(size(i), uint64(i))
				if err := stream.SendMsg(&msg); err != nil {
					sendErr <- fmt.Errorf("send %d: %w", i, err)
					return
				}
			}
			sendErr <- stream.CloseSend()
		}()
		for i := range n {
			var got []byte
			if err := stream.RecvMsg(&got); err != nil {
				t.Fatalf("receive %d: %v", i, err)
			}
			if want := payload(size(i), uint64(i)); !bytes.Equal(got, want) {
				t.Fatalf("message %d: %d bytes back for %d, or different bytes", i, len(got), len(want))
			}
		}
		if err := <-sendErr; err != nil {
			t.Fatal(err)
		}
		var extra []byte
		if err := stream.RecvMsg(&extra); !errors.Is(err, io.EOF) {
			t.Fatalf("after the last message: %v, want io.EOF", err)
		}
	})
}

// credentials/local accepts the connection on both sides: over a Unix
// socket as a connection of network "unix" (PrivacyAndIntegrity), over TCP
// loopback as a loopback address (NoSecurity), as it does for a plain Unix
// socket or TCP connection.
func TestLocalCredentials(t *testing.T) {
	srv := startTestServer(t, shmUnix, shmTCP)
	for _, c := range []struct {
		transport, network, level string
	}{
		{shmUnix, "unix", "PrivacyAndIntegrity"},
		{shmTCP, "tcp", "NoSecurity"},
	} {
		t.Run(c.network, func(t *testing.T) {
			cc := dialShm(t, c.network, srv.addrs[c.transport])
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()
			var p peer.Peer
			if _, err := echo(ctx, cc, []byte("hello"), grpc.Peer(&p)); err != nil {
				t.Fatal(err) // local credentials refused the stream
			}
			want := peerInfo{AuthType: "local", SecurityLevel: c.level, RemoteNetwork: c.network, LocalNetwork: c.network}
			if got := peerInfoOf(&p, true); got != want {
				t.Errorf("the client's view of the server: %+v, want %+v", got, want)
			}
			var got peerInfo
			if err := getJSON(ctx, cc, methodPeer, &got); err != nil {
				t.Fatal(err)
			}
			if got != want {
				t.Errorf("the server's view of the client: %+v, want %+v", got, want)
			}
		})
	}
}

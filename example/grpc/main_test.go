package main

// gRPC over shmipc between two processes: the server is this test binary
// started again (child.go), the client is the test.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestMain(m *testing.M) {
	if code, ran := runChildRole(); ran {
		os.Exit(code)
	}
	os.Exit(m.Run())
}

// testTimeout bounds every call of a test that is expected to succeed.
const testTimeout = 60 * time.Second

// startTestServer starts a server process over shmipc with the option set
// opts, in a directory of its own, and stops it when the test ends.
func startTestServer(t *testing.T, opts string) (srv *serverProcess, dir string) {
	t.Helper()
	dir, err := tempDir()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	srv = startTestServerIn(t, dir, opts)
	return srv, dir
}

func startTestServerIn(t *testing.T, dir, opts string) *serverProcess {
	t.Helper()
	srv, err := startServer(dir, opts, []string{transportShmipc})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := srv.stop(); err != nil && !t.Failed() {
			t.Errorf("server process: %v\n%s", err, srv.Output())
		}
	})
	return srv
}

// dialTest connects a client over shmipc and closes it when the test ends.
func dialTest(t *testing.T, addr string, opts optionSet) *client {
	t.Helper()
	c, err := dial(transportShmipc, addr, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// forEachOptionSet runs fn against a server process and a client with
// gRPC's default options, then with the tuned ones.
func forEachOptionSet(t *testing.T, fn func(t *testing.T, ctx context.Context, srv *serverProcess, c *client)) {
	for _, opts := range []optionSet{defaultOptions(), tunedOptions()} {
		t.Run(opts.name, func(t *testing.T) {
			srv, _ := startTestServer(t, opts.name)
			c := dialTest(t, srv.addrs[transportShmipc], opts)
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()
			fn(t, ctx, srv, c)
		})
	}
}

func payload(n int, seed uint64) []byte {
	p := make([]byte, n)
	r := rand.New(rand.NewPCG(seed, uint64(n)))
	for i := range p {
		p[i] = byte(r.Uint32())
	}
	return p
}

// Many goroutines make unary calls of sizes from 0 to 128 KiB at once; every
// response equals its request, and the server counted every call.
func TestConcurrentUnary(t *testing.T) {
	forEachOptionSet(t, func(t *testing.T, ctx context.Context, _ *serverProcess, c *client) {
		const goroutines, calls = 16, 20
		var wg sync.WaitGroup
		errs := make(chan error, goroutines)
		for g := range goroutines {
			wg.Go(func() {
				r := rand.New(rand.NewPCG(uint64(g), 1))
				for i := range calls {
					size := r.IntN(128 << 10)
					if i%5 == 0 {
						size = r.IntN(100)
					}
					req := payload(size, uint64(g*calls+i))
					resp, err := echo(ctx, c, req)
					if err != nil {
						errs <- fmt.Errorf("goroutine %d call %d (%d B): %w", g, i, size, err)
						return
					}
					if !bytes.Equal(resp, req) {
						errs <- fmt.Errorf("goroutine %d call %d: %d bytes back for %d, or different bytes", g, i, len(resp), size)
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
		st, err := getStats(ctx, c)
		if err != nil {
			t.Fatal(err)
		}
		if st.Unary != goroutines*calls {
			t.Errorf("the server counted %d unary calls, want %d", st.Unary, goroutines*calls)
		}
		if st.Shmipc.MessagesIn == 0 || st.Shmipc.BytesIn < goroutines*calls {
			t.Errorf("the server's shmipc sessions received %d messages (%d bytes): the calls did not go through shmipc",
				st.Shmipc.MessagesIn, st.Shmipc.BytesIn)
		}
	})
}

// A bidirectional stream echoes messages in order, both in lock-step and with
// the client sending everything before it reads, and ends cleanly.
func TestBidiStream(t *testing.T) {
	srv, _ := startTestServer(t, "tuned")
	c := dialTest(t, srv.addrs[transportShmipc], tunedOptions())
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()

	t.Run("lockstep", func(t *testing.T) {
		stream, err := c.NewStream(ctx, bidiDesc, methodBidi)
		if err != nil {
			t.Fatal(err)
		}
		for i := range 200 {
			msg := payload(i*97%(64<<10), uint64(i))
			if err := stream.SendMsg(&msg); err != nil {
				t.Fatalf("send %d: %v", i, err)
			}
			var got []byte
			if err := stream.RecvMsg(&got); err != nil {
				t.Fatalf("receive %d: %v", i, err)
			}
			if !bytes.Equal(got, msg) {
				t.Fatalf("message %d: got %d bytes, sent %d (or different bytes)", i, len(got), len(msg))
			}
		}
		closeAndExpectEOF(t, stream)
	})

	t.Run("pipelined", func(t *testing.T) {
		stream, err := c.NewStream(ctx, bidiDesc, methodBidi)
		if err != nil {
			t.Fatal(err)
		}
		const n = 500
		sent := make(chan error, 1)
		go func() {
			for i := range n {
				msg := payload(1+i*31%(16<<10), uint64(i))
				if err := stream.SendMsg(&msg); err != nil {
					sent <- fmt.Errorf("send %d: %w", i, err)
					return
				}
			}
			sent <- stream.CloseSend()
		}()
		for i := range n {
			var got []byte
			if err := stream.RecvMsg(&got); err != nil {
				t.Fatalf("receive %d: %v", i, err)
			}
			if want := payload(1+i*31%(16<<10), uint64(i)); !bytes.Equal(got, want) {
				t.Fatalf("message %d: got %d bytes, want %d (or different bytes)", i, len(got), len(want))
			}
		}
		if err := <-sent; err != nil {
			t.Fatal(err)
		}
		var extra []byte
		if err := stream.RecvMsg(&extra); !errors.Is(err, io.EOF) {
			t.Fatalf("after the last message: %v, want io.EOF", err)
		}
	})
}

func closeAndExpectEOF(t *testing.T, stream grpc.ClientStream) {
	t.Helper()
	if err := stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	var extra []byte
	if err := stream.RecvMsg(&extra); !errors.Is(err, io.EOF) {
		t.Fatalf("after CloseSend: %v, want io.EOF", err)
	}
}

// A call that runs past its deadline fails with DeadlineExceeded and a
// cancelled call or stream with Canceled; the server's handler sees its
// context end in both cases, and the connection goes on working.
func TestDeadlineAndCancel(t *testing.T) {
	srv, _ := startTestServer(t, "tuned")
	c := dialTest(t, srv.addrs[transportShmipc], tunedOptions())
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if _, err := echo(ctx, c, []byte("up")); err != nil {
		t.Fatal(err)
	}

	short, cancelShort := context.WithTimeout(ctx, 100*time.Millisecond)
	err := waitCall(short, c, time.Minute)
	cancelShort()
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("a call past its deadline: %v, want DeadlineExceeded", err)
	}
	waitForCancelled(t, ctx, c, 1)

	callCtx, cancelCall := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- waitCall(callCtx, c, time.Minute) }()
	waitForWaiting(t, ctx, c)
	cancelCall()
	if err := <-done; status.Code(err) != codes.Canceled {
		t.Fatalf("a cancelled call: %v, want Canceled", err)
	}
	waitForCancelled(t, ctx, c, 2)

	streamCtx, cancelStream := context.WithCancel(ctx)
	stream, err := c.NewStream(streamCtx, bidiDesc, methodBidi)
	if err != nil {
		t.Fatal(err)
	}
	msg := []byte("ping")
	if err := stream.SendMsg(&msg); err != nil {
		t.Fatal(err)
	}
	if err := stream.RecvMsg(&msg); err != nil {
		t.Fatal(err)
	}
	cancelStream()
	if err := stream.RecvMsg(&msg); status.Code(err) != codes.Canceled {
		t.Fatalf("a cancelled stream: %v, want Canceled", err)
	}

	if resp, err := echo(ctx, c, []byte("still there")); err != nil || string(resp) != "still there" {
		t.Fatalf("a call after the cancellations: %q, %v", resp, err)
	}
}

// waitForCancelled waits until the server has seen want Wait calls end by
// cancellation: the cancellation travels to the server asynchronously.
func waitForCancelled(t *testing.T, ctx context.Context, c *client, want int64) {
	t.Helper()
	for {
		st, err := getStats(ctx, c)
		if err != nil {
			t.Fatal(err)
		}
		if st.Cancelled >= want {
			if st.Cancelled > want {
				t.Fatalf("the server saw %d cancelled calls, want %d", st.Cancelled, want)
			}
			return
		}
		if ctx.Err() != nil {
			t.Fatalf("the server saw %d cancelled calls, want %d", st.Cancelled, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitForWaiting waits until a Wait call is running on the server.
func waitForWaiting(t *testing.T, ctx context.Context, c *client) {
	t.Helper()
	for {
		st, err := getStats(ctx, c)
		if err != nil {
			t.Fatal(err)
		}
		if st.Waiting > 0 {
			return
		}
		if ctx.Err() != nil {
			t.Fatal("no Wait call reached the server")
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// Messages up to 16 MiB go through, with gRPC's size limits raised, under
// the default and the tuned options; with the default receive limit (4 MiB)
// a larger message is refused with ResourceExhausted.
func TestLargeMessages(t *testing.T) {
	forEachOptionSet(t, func(t *testing.T, ctx context.Context, srv *serverProcess, c *client) {
		for _, size := range []int{1 << 20, 4<<20 + 1, 8 << 20, 16 << 20} {
			req := payload(size, uint64(size))
			resp, err := echo(ctx, c, req)
			if err != nil {
				t.Fatalf("%s: %v", sizeName(size), err)
			}
			if !bytes.Equal(resp, req) {
				t.Fatalf("%s: %d bytes back (or different bytes)", sizeName(size), len(resp))
			}
		}
		limited := dialTest(t, srv.addrs[transportShmipc], optionSet{})
		_, err := echo(ctx, limited, make([]byte, 5<<20))
		if status.Code(err) != codes.ResourceExhausted {
			t.Fatalf("a 5 MiB response to a client with gRPC's default 4 MiB limit: %v, want ResourceExhausted", err)
		}
	})
}

// The server process dies and a new one starts on the same socket: the
// client's calls succeed again on the new server, without a new client.
func TestServerRestart(t *testing.T) {
	srv, dir := startTestServer(t, "tuned")
	addr := srv.addrs[transportShmipc]
	c := dialTest(t, addr, tunedOptions())
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	before, err := getStats(ctx, c)
	if err != nil {
		t.Fatal(err)
	}

	srv.kill()
	if err := os.Remove(addr); err != nil { // the dead server's socket file
		t.Fatal(err)
	}
	next := startTestServerIn(t, dir, "tuned")
	if next.addrs[transportShmipc] != addr {
		t.Fatalf("the new server listens on %s, not %s", next.addrs[transportShmipc], addr)
	}

	// The first calls may fail while gRPC notices the broken connection;
	// within the test's timeout a call must reach the new server.
	var after serverStats
	for {
		callCtx, cancelCall := context.WithTimeout(ctx, 2*time.Second)
		after, err = getStats(callCtx, c, grpc.WaitForReady(true))
		cancelCall()
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("no call succeeded after the restart: %v", err)
		}
	}
	if after.Pid == before.Pid {
		t.Fatalf("the call after the restart was answered by the old server (pid %d)", before.Pid)
	}
	if resp, err := echo(ctx, c, []byte("again")); err != nil || string(resp) != "again" {
		t.Fatalf("echo after the restart: %q, %v", resp, err)
	}
}

// GracefulStop lets a call in progress finish, refuses new calls, and the
// server process exits.
func TestGracefulStop(t *testing.T) {
	srv, _ := startTestServer(t, "tuned")
	c := dialTest(t, srv.addrs[transportShmipc], tunedOptions())
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()

	const inFlight = 500 * time.Millisecond
	done := make(chan error, 1)
	go func() { done <- waitCall(ctx, c, inFlight) }()
	waitForWaiting(t, ctx, c)
	if err := srv.terminate(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("the call in progress during GracefulStop: %v", err)
	}
	if err := srv.wait(testTimeout); err != nil {
		t.Fatalf("server process: %v\n%s", err, srv.Output())
	}
	if out := srv.Output(); !strings.Contains(out, "stopped gracefully") {
		t.Fatalf("the server did not stop gracefully: %s", out)
	}
	short, cancelShort := context.WithTimeout(ctx, time.Second)
	defer cancelShort()
	if _, err := echo(short, c, []byte("late")); status.Code(err) != codes.Unavailable && status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("a call after the server stopped: %v, want Unavailable or DeadlineExceeded", err)
	}
}

// The benchmark runs (briefly), so that it cannot rot.
func TestBenchQuick(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	cfg := quickBench()
	cfg.block = 5 * time.Millisecond
	var out bytes.Buffer
	if err := runBench(cfg, &out); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"| tuned", "shmipc", "uds", "tcp", "MB/s"} {
		if !strings.Contains(out.String(), want) {
			t.Fatalf("the benchmark output lacks %q:\n%s", want, out.String())
		}
	}
}

package shmipcgrpc_test

// BenchmarkUnaryEcho: gRPC unary echo between two processes over shmipc
// with shmipcgrpc's options and over a Unix socket with gRPC's defaults,
// both against one server process (child_test.go), with 1, 8 or 64 calls in
// flight on the connection at once (calls=N; each op is one round of N
// concurrent calls). The two take turns in blocks of 20 ms within each run,
// so that a change in the machine's load hits both alike, and each run
// reports the p50 and p99 of a call on each and their ratios (shm/uds):
// read the ratios, run to run. bench.sh runs it with the machine's state
// recorded.

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/local"
	"google.golang.org/grpc/mem"
)

// benchServer is the server process of the benchmarks, started by the
// first and stopped by TestMain.
var benchServer struct {
	once sync.Once
	srv  *serverProcess
	err  error
}

func stopBenchServer() {
	if benchServer.srv != nil {
		if err := benchServer.srv.stop(); err != nil {
			fmt.Fprintln(os.Stderr, "benchmark server process:", err)
		}
	}
}

// benchClients returns a client over shmipc and one over a Unix socket,
// both connected to the benchmarks' server process.
func benchClients(b *testing.B) (shm, sock *grpc.ClientConn) {
	benchServer.once.Do(func() {
		benchServer.srv, benchServer.err = startServer(shmUnix, uds)
	})
	if benchServer.err != nil {
		b.Fatal(benchServer.err)
	}
	addrs := benchServer.srv.addrs
	shm = dialShm(b, "unix", addrs[shmUnix])
	sock, err := grpc.NewClient("unix://"+addrs[uds], grpc.WithTransportCredentials(local.NewCredentials()), callOpts)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { sock.Close() })
	return shm, sock
}

// echoNoCopy makes one Unary call and checks the response's length; it
// copies neither the request nor the response.
func echoNoCopy(ctx context.Context, cc *grpc.ClientConn, req []byte) error {
	var resp mem.BufferSlice
	if err := cc.Invoke(ctx, methodUnary, &req, &resp); err != nil {
		return err
	}
	n := resp.Len()
	resp.Free()
	if n != len(req) {
		return fmt.Errorf("%d bytes back for %d", n, len(req))
	}
	return nil
}

// benchBlock is how long one transport runs before the other takes its
// turn.
const benchBlock = 20 * time.Millisecond

func BenchmarkUnaryEcho(b *testing.B) {
	for _, calls := range []int{1, 8, 64} {
		for _, size := range []int{64, 4 << 10, 64 << 10, 1 << 20} {
			if calls == 64 && size > 4<<10 {
				continue // 64 MiB in flight each way would not fit in the default buffer region
			}
			b.Run(fmt.Sprintf("calls=%d/%s", calls, sizeName(size)), func(b *testing.B) { benchUnary(b, calls, size) })
		}
	}
}

// benchUnary runs rounds of calls concurrent echo calls of size bytes.
func benchUnary(b *testing.B, calls, size int) {
	shm, sock := benchClients(b)
	conns := [2]*grpc.ClientConn{shm, sock}
	ctx := context.Background()
	req := payload(size, 7)
	var lat [2][]time.Duration
	var mu sync.Mutex
	var firstErr error
	// round makes calls concurrent calls on cc and appends their latencies
	// to record, unless it is a warm-up (keep false).
	round := func(cc *grpc.ClientConn, record []time.Duration, keep bool) []time.Duration {
		var wg sync.WaitGroup
		for range calls {
			wg.Go(func() {
				t0 := time.Now()
				err := echoNoCopy(ctx, cc, req)
				d := time.Since(t0)
				mu.Lock()
				defer mu.Unlock()
				if err != nil && firstErr == nil {
					firstErr = err
				}
				if keep {
					record = append(record, d)
				}
			})
		}
		wg.Wait()
		return record
	}
	for _, cc := range conns { // warm up: connections, windows, pools
		for start := time.Now(); time.Since(start) < 5*benchBlock; {
			round(cc, nil, false)
		}
	}
	turn := 0
	blockStart := time.Now()
	for b.Loop() {
		lat[turn] = round(conns[turn], lat[turn], true)
		if firstErr != nil {
			b.Fatal(firstErr)
		}
		if t := time.Now(); t.Sub(blockStart) >= benchBlock {
			turn, blockStart = 1-turn, t
		}
	}
	if firstErr != nil {
		b.Fatal(firstErr)
	}
	if len(lat[0]) == 0 || len(lat[1]) == 0 {
		return // too short a run to have both
	}
	p50s, p99s := percentile(lat[0], 0.50), percentile(lat[0], 0.99)
	p50u, p99u := percentile(lat[1], 0.50), percentile(lat[1], 0.99)
	b.ReportMetric(0, "ns/op") // the mean of two transports means nothing
	b.ReportMetric(float64(p50s.Nanoseconds()), "shm-p50-ns")
	b.ReportMetric(float64(p50u.Nanoseconds()), "uds-p50-ns")
	b.ReportMetric(float64(p99s.Nanoseconds()), "shm-p99-ns")
	b.ReportMetric(float64(p99u.Nanoseconds()), "uds-p99-ns")
	b.ReportMetric(float64(p50s)/float64(p50u), "p50-shm/uds")
	b.ReportMetric(float64(p99s)/float64(p99u), "p99-shm/uds")
}

func percentile(d []time.Duration, p float64) time.Duration {
	slices.Sort(d)
	return d[min(len(d)-1, int(p*float64(len(d))))]
}

func sizeName(n int) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%dMiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return fmt.Sprintf("%dB", n)
}

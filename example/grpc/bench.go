package main

// The benchmark: gRPC unary echo and streaming between two processes over
// shmipc, a Unix socket and TCP loopback, in one run of one binary. The
// transports take turns in short blocks, so that a change in the machine's
// load affects them alike. A fourth column, "in-process", runs the same
// server in the client's own process over an in-memory pipe
// (grpc/test/bufconn): no transport at all, which is what gRPC costs by
// itself.

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/goshm/shmipc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"
)

// transportInProc is the in-process reference.
const transportInProc = "in-process"

// benchConfig says how much to measure.
type benchConfig struct {
	options     []string      // option sets, each with its own server process
	sizes       []int         // unary payload sizes
	streamSizes []int         // message sizes of the streaming benchmark
	rounds      int           // blocks per transport and size
	block       time.Duration // length of one block
	streamBytes int           // bytes per streaming block
	inProc      bool          // measure the in-process reference too
	transports  []string      // the transports between processes to measure; nil: all
}

func fullBench() benchConfig {
	return benchConfig{
		options:     []string{"default", "tuned"},
		sizes:       []int{64, 1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20},
		streamSizes: []int{1 << 10, 64 << 10, 1 << 20},
		rounds:      5,
		block:       200 * time.Millisecond,
		streamBytes: 64 << 20,
		inProc:      true,
	}
}

func quickBench() benchConfig {
	return benchConfig{
		options:     []string{"default", "tuned"},
		sizes:       []int{64, 1 << 20},
		streamSizes: []int{64 << 10},
		rounds:      1,
		block:       20 * time.Millisecond,
		streamBytes: 4 << 20,
		inProc:      true,
	}
}

// cell is what was measured for one option set, transport and size.
type cell struct {
	lat     []time.Duration
	blocks  []float64     // per block: the p50 in ns (unary) or MB/s (streaming)
	elapsed time.Duration // total time of the calls
	cpu     time.Duration // client + server
	sleeps  int64         // voluntary context switches, client + server
	calls   int
	bytes   int // streaming: bytes received
	// shmipc only: messages (writes on a stream) and wake-ups sent by the
	// client and by the server.
	cliMsgs, srvMsgs, cliWakeups, srvWakeups uint64
}

func (c *cell) add(o cell) {
	c.lat = append(c.lat, o.lat...)
	c.blocks = append(c.blocks, o.blocks...)
	c.elapsed += o.elapsed
	c.cpu += o.cpu
	c.sleeps += o.sleeps
	c.calls += o.calls
	c.bytes += o.bytes
	c.cliMsgs += o.cliMsgs
	c.srvMsgs += o.srvMsgs
	c.cliWakeups += o.cliWakeups
	c.srvWakeups += o.srvWakeups
}

func (c *cell) percentile(p float64) time.Duration {
	if c == nil || len(c.lat) == 0 {
		return 0
	}
	slices.Sort(c.lat)
	return c.lat[min(len(c.lat)-1, int(p*float64(len(c.lat))))]
}

func (c *cell) mbPerSec() float64 {
	if c == nil || c.elapsed == 0 {
		return 0
	}
	return float64(c.bytes) / 1e6 / c.elapsed.Seconds()
}

type cellKey struct {
	opts, transport string
	size            int
}

// results are the cells of a run.
type results struct {
	unary, stream map[cellKey]*cell
}

// benchTarget is one client connection under test.
type benchTarget struct {
	transport string
	client    *client
	inProc    bool // the server runs in this process
}

// runBench measures everything in cfg and prints the tables to out.
func runBench(cfg benchConfig, out io.Writer) error {
	r := results{unary: map[cellKey]*cell{}, stream: map[cellKey]*cell{}}
	for _, opts := range cfg.options {
		if err := benchOptionSet(cfg, opts, r); err != nil {
			return fmt.Errorf("%s options: %w", opts, err)
		}
	}
	printTables(cfg, r, out)
	return nil
}

// benchOptionSet starts a server process with one option set and measures
// every transport with it.
func benchOptionSet(cfg benchConfig, optsName string, r results) error {
	opts, err := optionsByName(optsName)
	if err != nil {
		return err
	}
	dir, err := tempDir()
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	srv, err := startServer(dir, optsName, cfg.between())
	if err != nil {
		return err
	}
	defer srv.stop()
	ctx := context.Background()
	var targets []benchTarget
	for _, tr := range cfg.between() {
		c, err := connect(ctx, tr, srv.addrs[tr], opts)
		if err != nil {
			return err
		}
		defer c.Close()
		targets = append(targets, benchTarget{transport: tr, client: c})
	}
	if cfg.inProc {
		c, stop, err := connectInProc(ctx, opts)
		if err != nil {
			return err
		}
		defer stop()
		targets = append(targets, benchTarget{transport: transportInProc, client: c, inProc: true})
	}

	for _, size := range cfg.sizes {
		req := make([]byte, size)
		for i := range req {
			req[i] = byte(rand.Uint32())
		}
		for _, t := range targets { // warm up: buffers, windows, pools
			if _, err := unaryBlock(ctx, t, req, cfg.block/5); err != nil {
				return err
			}
		}
		err := takeTurns(targets, cfg.rounds, r.unary, optsName, size, func(t benchTarget) (cell, error) {
			return unaryBlock(ctx, t, req, cfg.block)
		})
		if err != nil {
			return err
		}
	}
	for _, size := range cfg.streamSizes {
		err := takeTurns(targets, cfg.rounds, r.stream, optsName, size, func(t benchTarget) (cell, error) {
			return downloadBlock(ctx, t, size, cfg.streamBytes)
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// takeTurns runs block for each target in turn, rounds times, and adds
// the results to the cells of size.
func takeTurns(targets []benchTarget, rounds int, cells map[cellKey]*cell, opts string, size int,
	block func(benchTarget) (cell, error)) error {
	for round := range rounds {
		for _, t := range rotated(targets, round) {
			c, err := block(t)
			if err != nil {
				return fmt.Errorf("%s, %s: %w", t.transport, sizeName(size), err)
			}
			k := cellKey{opts, t.transport, size}
			if cells[k] == nil {
				cells[k] = &cell{}
			}
			cells[k].add(c)
		}
	}
	return nil
}

// rotated returns the targets rotated by round places, so that none is
// always first.
func rotated(targets []benchTarget, round int) []benchTarget {
	k := round % len(targets)
	return append(slices.Clone(targets[k:]), targets[:k]...)
}

// connectInProc starts a server in this process on an in-memory pipe and
// connects a client to it.
func connectInProc(ctx context.Context, opts optionSet) (*client, func(), error) {
	lis := bufconn.Listen(1 << 20)
	srv := grpc.NewServer(opts.serverOptions(transportInProc)...)
	srv.RegisterService(&echoServiceDesc, &echoServer{})
	go srv.Serve(lis)
	dopts := append([]grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		callOpts,
	}, opts.dialOptions(transportInProc, nil)...)
	cc, err := grpc.NewClient("passthrough:///in-process", dopts...)
	if err != nil {
		srv.Stop()
		return nil, nil, err
	}
	c := &client{ClientConn: cc}
	if _, err := echo(ctx, c, []byte("hello")); err != nil {
		c.Close()
		srv.Stop()
		return nil, nil, err
	}
	return c, func() { c.Close(); srv.Stop() }, nil
}

// measure runs fn and adds the CPU time of both processes to the cell it
// returns. The server's CPU time is asked for over the same connection,
// outside the timed part.
func measure(ctx context.Context, t benchTarget, fn func() (cell, error)) (cell, error) {
	var before serverStats
	var err error
	if !t.inProc {
		if before, err = getStats(ctx, t.client); err != nil {
			return cell{}, err
		}
	}
	shm0 := shmipc.AggregateStats()
	cpu0, sleeps0 := processCPU(), processSleeps()
	res, err := fn()
	cpu1, sleeps1 := processCPU(), processSleeps()
	shm1 := shmipc.AggregateStats()
	if err != nil {
		return cell{}, err
	}
	res.cpu = cpu1 - cpu0 // both ends, if the server runs in this process
	res.sleeps = sleeps1 - sleeps0
	if t.inProc {
		return res, nil
	}
	after, err := getStats(ctx, t.client)
	if err != nil {
		return cell{}, err
	}
	res.cpu += time.Duration(after.CPUNanos - before.CPUNanos)
	res.sleeps += after.Sleeps - before.Sleeps
	if t.transport == transportShmipc {
		res.cliMsgs = shm1.MessagesOut - shm0.MessagesOut
		res.cliWakeups = shm1.WakeupsSent - shm0.WakeupsSent
		// Less the first Stats call's response, sent after before was
		// taken.
		res.srvMsgs = after.Shmipc.MessagesOut - before.Shmipc.MessagesOut - 1
		res.srvWakeups = after.Shmipc.WakeupsSent - before.Shmipc.WakeupsSent
	}
	return res, nil
}

// unaryBlock makes echo calls one after the other for about d.
func unaryBlock(ctx context.Context, t benchTarget, req []byte, d time.Duration) (cell, error) {
	return measure(ctx, t, func() (cell, error) {
		var res cell
		start := time.Now()
		for res.calls < 3 || time.Since(start) < d {
			t0 := time.Now()
			n, err := echoNoCopy(ctx, t.client, req)
			res.lat = append(res.lat, time.Since(t0))
			if err != nil {
				return res, err
			}
			if n != len(req) {
				return res, fmt.Errorf("echo returned %d bytes for %d", n, len(req))
			}
			res.calls++
		}
		res.elapsed = time.Since(start)
		res.blocks = []float64{float64(res.percentile(0.50))}
		return res, nil
	})
}

// downloadBlock receives about total bytes in messages of size bytes on one
// server stream.
func downloadBlock(ctx context.Context, t benchTarget, size, total int) (cell, error) {
	return measure(ctx, t, func() (cell, error) {
		var res cell
		count := max(1, total/size)
		start := time.Now()
		got, err := download(ctx, t.client, size, count)
		res.elapsed = time.Since(start)
		res.bytes = got
		res.blocks = []float64{res.mbPerSec()}
		res.calls = count
		if err == nil && got != size*count {
			err = fmt.Errorf("received %d bytes of %d", got, size*count)
		}
		return res, err
	})
}

// benchTransports are the columns of the tables, in order.
func benchTransports(cfg benchConfig) []string {
	if cfg.inProc {
		return append(slices.Clone(cfg.between()), transportInProc)
	}
	return cfg.between()
}

// between returns the transports between processes to measure.
func (cfg benchConfig) between() []string {
	if cfg.transports == nil {
		return allTransports
	}
	return cfg.transports
}

// parseSizes parses a comma-separated list of sizes such as "64,1k,4m".
func parseSizes(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		f = strings.ToLower(strings.TrimSpace(f))
		mult := 1
		switch {
		case strings.HasSuffix(f, "k"):
			mult, f = 1<<10, strings.TrimSuffix(f, "k")
		case strings.HasSuffix(f, "m"):
			mult, f = 1<<20, strings.TrimSuffix(f, "m")
		}
		var n int
		if _, err := fmt.Sscan(f, &n); err != nil || n < 0 {
			return nil, fmt.Errorf("bad size %q", f)
		}
		out = append(out, n*mult)
	}
	return out, nil
}

package main

// The benchmark: gRPC unary echo and streaming between two processes over
// shmipc, a Unix socket and TCP loopback, in one run of one binary. The
// transports take turns in short blocks, so that a change in the machine's
// load affects all three alike.

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/goshm/shmipc"
)

// benchConfig says how much to measure.
type benchConfig struct {
	options     []string      // option sets, each with its own server process
	sizes       []int         // unary payload sizes
	streamSizes []int         // message sizes of the streaming benchmark
	rounds      int           // blocks per transport and size
	block       time.Duration // length of one block
	streamBytes int           // bytes per streaming block
}

func fullBench() benchConfig {
	return benchConfig{
		options:     []string{"default", "tuned"},
		sizes:       []int{64, 1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20},
		streamSizes: []int{1 << 10, 64 << 10, 1 << 20},
		rounds:      6,
		block:       250 * time.Millisecond,
		streamBytes: 128 << 20,
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
	}
}

// cell is what was measured for one option set, transport and size.
type cell struct {
	lat     []time.Duration
	elapsed time.Duration // total time of the calls
	cpu     time.Duration // client + server CPU
	calls   int
	bytes   int // streaming: bytes received
	// shmipc only: messages (writes on a stream) and wake-ups sent by the
	// client and by the server.
	cliMsgs, srvMsgs, cliWakeups, srvWakeups uint64
}

func (c *cell) add(o cell) {
	c.lat = append(c.lat, o.lat...)
	c.elapsed += o.elapsed
	c.cpu += o.cpu
	c.calls += o.calls
	c.bytes += o.bytes
	c.cliMsgs += o.cliMsgs
	c.srvMsgs += o.srvMsgs
	c.cliWakeups += o.cliWakeups
	c.srvWakeups += o.srvWakeups
}

func (c *cell) percentile(p float64) time.Duration {
	if len(c.lat) == 0 {
		return 0
	}
	slices.Sort(c.lat)
	return c.lat[min(len(c.lat)-1, int(p*float64(len(c.lat))))]
}

type cellKey struct {
	opts, transport string
	size            int
}

// runBench measures everything in cfg and prints the tables to out.
func runBench(cfg benchConfig, out io.Writer) error {
	unary := map[cellKey]*cell{}
	stream := map[cellKey]*cell{}
	for _, opts := range cfg.options {
		if err := benchOptionSet(cfg, opts, unary, stream); err != nil {
			return fmt.Errorf("%s options: %w", opts, err)
		}
	}
	printTables(cfg, unary, stream, out)
	return nil
}

// benchOptionSet starts a server process with one option set and measures
// every transport with it.
func benchOptionSet(cfg benchConfig, optsName string, unary, stream map[cellKey]*cell) error {
	opts, err := optionsByName(optsName)
	if err != nil {
		return err
	}
	dir, err := tempDir()
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	srv, err := startServer(dir, optsName, allTransports)
	if err != nil {
		return err
	}
	defer srv.stop()
	ctx := context.Background()
	clients := map[string]*client{}
	for _, tr := range allTransports {
		c, err := connect(ctx, tr, srv.addrs[tr], opts)
		if err != nil {
			return err
		}
		defer c.Close()
		clients[tr] = c
	}
	order := slices.Clone(allTransports)
	for _, size := range cfg.sizes {
		req := make([]byte, size)
		for i := range req {
			req[i] = byte(rand.Uint32())
		}
		for _, tr := range order { // warm up: buffers, windows, pools
			if _, err := unaryBlock(ctx, clients[tr], req, cfg.block/5); err != nil {
				return err
			}
		}
		for round := range cfg.rounds {
			rotate(order, round)
			for _, tr := range order {
				c, err := unaryBlock(ctx, clients[tr], req, cfg.block)
				if err != nil {
					return fmt.Errorf("%s %d B: %w", tr, size, err)
				}
				k := cellKey{optsName, tr, size}
				if unary[k] == nil {
					unary[k] = &cell{}
				}
				unary[k].add(c)
			}
		}
	}
	for _, size := range cfg.streamSizes {
		for round := range cfg.rounds {
			rotate(order, round)
			for _, tr := range order {
				c, err := downloadBlock(ctx, clients[tr], size, cfg.streamBytes)
				if err != nil {
					return fmt.Errorf("%s stream %d B: %w", tr, size, err)
				}
				k := cellKey{optsName, tr, size}
				if stream[k] == nil {
					stream[k] = &cell{}
				}
				stream[k].add(c)
			}
		}
	}
	return nil
}

// rotate moves the transports by one place each round, so that none is
// always first after a change of size.
func rotate(order []string, round int) {
	if round > 0 {
		first := order[0]
		copy(order, order[1:])
		order[len(order)-1] = first
	}
}

// measure runs fn and adds the CPU time of both processes to the cell it
// returns. The server's CPU time is asked for over the same connection,
// outside the timed part.
func measure(ctx context.Context, c *client, fn func() (cell, error)) (cell, error) {
	before, err := getStats(ctx, c)
	if err != nil {
		return cell{}, err
	}
	shm0 := shmipc.AggregateStats()
	cpu0 := processCPU()
	res, err := fn()
	cpu1 := processCPU()
	shm1 := shmipc.AggregateStats()
	if err != nil {
		return cell{}, err
	}
	after, err := getStats(ctx, c)
	if err != nil {
		return cell{}, err
	}
	res.cpu = cpu1 - cpu0 + time.Duration(after.CPUNanos-before.CPUNanos)
	if c.manager != nil {
		res.cliMsgs = shm1.MessagesOut - shm0.MessagesOut
		res.cliWakeups = shm1.WakeupsSent - shm0.WakeupsSent
		// The Stats call itself: one message each way, at most one wake-up.
		res.srvMsgs = after.Shmipc.MessagesOut - before.Shmipc.MessagesOut - 1
		res.srvWakeups = after.Shmipc.WakeupsSent - before.Shmipc.WakeupsSent
	}
	return res, nil
}

// unaryBlock makes echo calls one after the other for about d.
func unaryBlock(ctx context.Context, c *client, req []byte, d time.Duration) (cell, error) {
	return measure(ctx, c, func() (cell, error) {
		var res cell
		start := time.Now()
		for res.calls < 3 || time.Since(start) < d {
			t := time.Now()
			resp, err := echo(ctx, c, req)
			res.lat = append(res.lat, time.Since(t))
			if err != nil {
				return res, err
			}
			if len(resp) != len(req) {
				return res, fmt.Errorf("echo returned %d bytes for %d", len(resp), len(req))
			}
			res.calls++
		}
		res.elapsed = time.Since(start)
		return res, nil
	})
}

// downloadBlock receives about total bytes in messages of size bytes on one
// server stream.
func downloadBlock(ctx context.Context, c *client, size, total int) (cell, error) {
	return measure(ctx, c, func() (cell, error) {
		var res cell
		count := max(1, total/size)
		start := time.Now()
		got, err := download(ctx, c, size, count)
		res.elapsed = time.Since(start)
		res.bytes = got
		res.calls = count
		if err == nil && got != size*count {
			err = fmt.Errorf("received %d bytes of %d", got, size*count)
		}
		return res, err
	})
}

// printTables prints the unary and the streaming table as Markdown.
func printTables(cfg benchConfig, unary, stream map[cellKey]*cell, out io.Writer) {
	w := tabwriter.NewWriter(out, 0, 0, 1, ' ', tabwriter.AlignRight|tabwriter.Debug)
	fmt.Fprintln(out, "Unary echo, one call at a time (latency per call; CPU = client + server per call):")
	fmt.Fprintln(out)
	fmt.Fprintln(w, "| options\t size\t transport\t p50\t p99\t calls/s\t CPU/call\t p50 vs UDS\t")
	fmt.Fprintln(w, "|---\t---:\t---\t---:\t---:\t---:\t---:\t---:\t")
	for _, opts := range cfg.options {
		for _, size := range cfg.sizes {
			uds := unary[cellKey{opts, transportUDS, size}]
			for _, tr := range allTransports {
				c := unary[cellKey{opts, tr, size}]
				if c == nil || c.calls == 0 {
					continue
				}
				p50 := c.percentile(0.50)
				fmt.Fprintf(w, "| %s\t %s\t %s\t %s\t %s\t %.0f\t %s\t %.2f×\t\n", opts, sizeName(size), tr,
					fmtDur(p50), fmtDur(c.percentile(0.99)),
					float64(c.calls)/c.elapsed.Seconds(), fmtDur(c.cpu/time.Duration(c.calls)),
					float64(p50)/float64(uds.percentile(0.50)))
			}
		}
	}
	w.Flush()
	fmt.Fprintln(out)
	fmt.Fprintln(out, "Over shmipc, per call: messages (stream writes) and wake-ups sent by each side:")
	fmt.Fprintln(out)
	fmt.Fprintln(w, "| options\t size\t client msgs\t server msgs\t client wake-ups\t server wake-ups\t")
	fmt.Fprintln(w, "|---\t---:\t---:\t---:\t---:\t---:\t")
	for _, opts := range cfg.options {
		for _, size := range cfg.sizes {
			c := unary[cellKey{opts, transportShmipc, size}]
			if c == nil || c.calls == 0 {
				continue
			}
			n := float64(c.calls)
			fmt.Fprintf(w, "| %s\t %s\t %.2f\t %.2f\t %.2f\t %.2f\t\n", opts, sizeName(size),
				float64(c.cliMsgs)/n, float64(c.srvMsgs)/n, float64(c.cliWakeups)/n, float64(c.srvWakeups)/n)
		}
	}
	w.Flush()
	fmt.Fprintln(out)
	fmt.Fprintln(out, "Server streaming (Download), one stream at a time:")
	fmt.Fprintln(out)
	fmt.Fprintln(w, "| options\t message\t transport\t MB/s\t msgs/s\t CPU/MB\t vs UDS\t")
	fmt.Fprintln(w, "|---\t---:\t---\t---:\t---:\t---:\t---:\t")
	for _, opts := range cfg.options {
		for _, size := range cfg.streamSizes {
			uds := stream[cellKey{opts, transportUDS, size}]
			for _, tr := range allTransports {
				c := stream[cellKey{opts, tr, size}]
				if c == nil || c.elapsed == 0 {
					continue
				}
				mbs := float64(c.bytes) / 1e6 / c.elapsed.Seconds()
				udsMBs := float64(uds.bytes) / 1e6 / uds.elapsed.Seconds()
				fmt.Fprintf(w, "| %s\t %s\t %s\t %.0f\t %.0f\t %s\t %.2f×\t\n", opts, sizeName(size), tr,
					mbs, float64(c.calls)/c.elapsed.Seconds(),
					fmtDur(time.Duration(float64(c.cpu)/(float64(c.bytes)/1e6))), mbs/udsMBs)
			}
		}
	}
	w.Flush()
}

func sizeName(n int) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d B", n)
}

func fmtDur(d time.Duration) string {
	switch {
	case d >= 10*time.Millisecond:
		return fmt.Sprintf("%.1f ms", float64(d)/1e6)
	case d >= time.Millisecond:
		return fmt.Sprintf("%.2f ms", float64(d)/1e6)
	}
	return fmt.Sprintf("%.0f µs", float64(d)/1e3)
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

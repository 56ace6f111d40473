package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/goshm/shmipc"
)

// The many-streams mode (-streams N): N client goroutines in this process,
// each with its own stream of one shm session, or its own connection, do
// round trips of one size with the echo server child as fast as they can
// for -duration. For each transport it reports round trips per second,
// p50, p99, p99.9 and the largest round-trip time over all clients, how
// fair the transport was (round trips of the slowest client ÷ those of the
// fastest) and the CPU time both processes spent per round trip.
//
// The transports take turns, measurement by measurement (shm, uds, then
// uds, shm in the next round, and so on), -rounds times, so that a change
// in the machine's state during the run hits them alike; the summary gives
// per transport the median of the rounds, and per pair the median of the
// per-round ratios.

// streamsOptions fills in the defaults of the many-streams mode that the
// flags in set did not choose.
func streamsOptions(o options, set map[string]bool) options {
	if !set["sizes"] {
		o.sizes = []int{4 << 10}
	}
	if !set["transports"] {
		o.transports = []string{"shm", "uds"}
	}
	return o
}

// streamsResult is one measurement: a transport at a size, in one round.
type streamsResult struct {
	Round      int      `json:"round"`
	Transport  string   `json:"transport"`
	Size       int      `json:"size_bytes"`
	Streams    int      `json:"streams"`
	Seconds    float64  `json:"seconds"`
	RoundTrips int64    `json:"round_trips"`
	PerSecond  float64  `json:"round_trips_per_s"`
	P50        float64  `json:"p50_us"`
	P99        float64  `json:"p99_us"`
	P999       float64  `json:"p999_us"`
	Max        float64  `json:"max_us"`
	Slowest    int64    `json:"slowest_stream_round_trips"`
	Fastest    int64    `json:"fastest_stream_round_trips"`
	Fairness   float64  `json:"slowest_over_fastest"`
	ClientCPU  float64  `json:"client_cpu_us_per_round_trip"`
	ServerCPU  float64  `json:"server_cpu_us_per_round_trip"`
	Wakeups    *float64 `json:"wakeups_per_round_trip,omitempty"` // shm only
}

func (r streamsResult) cpu() float64 { return r.ClientCPU + r.ServerCPU }

// streamsReport is everything a many-streams run measured.
type streamsReport struct {
	runEnv
	Streams int             `json:"streams"`
	Results []streamsResult `json:"results"`
	Medians []streamsMedian `json:"medians"`
}

// streamsMedian is the median over the rounds of one quantity at one size:
// per transport, and of the per-round ratios of the first transport to each
// other one.
type streamsMedian struct {
	Size     int                `json:"size_bytes"`
	Quantity string             `json:"quantity"`
	Values   map[string]float64 `json:"values"` // by transport
	Ratios   map[string]float64 `json:"ratios"` // by "shm/uds" and so on
}

const streamsRowFormat = "%5s  %-9s %8s %10s %9s %9s %9s %9s %8s %15s  %12s  %12s  %11s\n"

// runStreams runs the many-streams mode and prints its table to out.
func runStreams(opts options, out io.Writer) (*streamsReport, error) {
	srv, hogs, env, err := startRun(opts)
	if err != nil {
		return nil, err
	}
	defer srv.stop()
	defer hogs.stop()
	rep := &streamsReport{runEnv: env, Streams: opts.streams}
	fmt.Fprintf(out, "pingpong: %d streams at once between two processes, %v per measurement, %d rounds (client pid %d, echo server pid %d)\n",
		opts.streams, opts.duration, opts.rounds, rep.ClientPID, rep.ServerPID)
	fmt.Fprintf(out, "%s\n\n", rep.platform(hogs))
	fmt.Fprintf(out, streamsRowFormat, "round", "transport", "size", "round/s", "p50", "p99", "p99.9", "max",
		"slow/fast", "(slowest-fastest)", "client CPU/rt", "server CPU/rt", "wake-ups/rt")
	for round := 1; round <= opts.rounds; round++ {
		order := slices.Clone(opts.transports)
		if round%2 == 0 {
			slices.Reverse(order)
		}
		for _, size := range opts.sizes {
			for _, tr := range order {
				r, err := measureStreams(tr, size, opts, srv)
				if err != nil {
					return nil, fmt.Errorf("%s, %s, round %d: %w", tr, fmtSize(size), round, err)
				}
				r.Round = round
				rep.Results = append(rep.Results, r)
				fmt.Fprintf(out, streamsRowFormat, fmt.Sprint(round), tr, fmtSize(size), thousands(int(r.PerSecond)),
					fmtUs(r.P50), fmtUs(r.P99), fmtUs(r.P999), fmtUs(r.Max), fmt.Sprintf("%.2f", r.Fairness),
					fmt.Sprintf("(%d-%d)", r.Slowest, r.Fastest), fmtUs(r.ClientCPU), fmtUs(r.ServerCPU), fmtWakeups(r.Wakeups))
			}
		}
	}
	after := rep.finish(hogs)
	srv.stop()

	rep.Medians = streamsMedians(rep.Results, opts.transports, opts.sizes)
	printStreamsMedians(out, rep.Medians, opts)
	fmt.Fprintln(out)
	fmt.Fprintln(out, "round/s: round trips of all streams per second. p50…max: round-trip times of single round trips, all streams together.")
	fmt.Fprintln(out, "slow/fast: round trips of the slowest stream ÷ those of the fastest (1 is fair). CPU/rt: process CPU time (user+system) ÷ round trips.")
	fmt.Fprintln(out, "wake-ups/rt: Polling frames sent either way per round trip (0: the receivers' spinning caught every message).")
	fmt.Fprintln(out, after)
	if opts.jsonPath != "" {
		if err := writeJSON(opts.jsonPath, rep); err != nil {
			return nil, err
		}
	}
	return rep, nil
}

// streamsQuantity is a quantity the summary compares.
type streamsQuantity struct {
	name  string
	value func(streamsResult) float64
	unit  string // "" for a plain number, "µs" for a duration
}

var streamsQuantities = []streamsQuantity{
	{"round trips/s", func(r streamsResult) float64 { return r.PerSecond }, ""},
	{"p50", func(r streamsResult) float64 { return r.P50 }, "µs"},
	{"p99", func(r streamsResult) float64 { return r.P99 }, "µs"},
	{"p99.9", func(r streamsResult) float64 { return r.P999 }, "µs"},
	{"slowest/fastest", func(r streamsResult) float64 { return r.Fairness }, ""},
	{"CPU/round trip", func(r streamsResult) float64 { return r.cpu() }, "µs"},
	{"client CPU/rt", func(r streamsResult) float64 { return r.ClientCPU }, "µs"},
	{"server CPU/rt", func(r streamsResult) float64 { return r.ServerCPU }, "µs"},
}

// streamsMedians computes the medians over the rounds.
func streamsMedians(results []streamsResult, transports []string, sizes []int) []streamsMedian {
	var out []streamsMedian
	base := transports[0]
	for _, size := range sizes {
		for _, q := range streamsQuantities {
			m := streamsMedian{Size: size, Quantity: q.name, Values: map[string]float64{}, Ratios: map[string]float64{}}
			byRound := map[int]map[string]float64{}
			for _, r := range results {
				if r.Size != size {
					continue
				}
				if byRound[r.Round] == nil {
					byRound[r.Round] = map[string]float64{}
				}
				byRound[r.Round][r.Transport] = q.value(r)
			}
			for _, tr := range transports {
				var vs, ratios []float64
				for _, v := range byRound {
					vs = append(vs, v[tr])
					if tr != base && v[tr] > 0 {
						ratios = append(ratios, v[base]/v[tr])
					}
				}
				m.Values[tr] = median(vs)
				if len(ratios) > 0 {
					m.Ratios[base+"/"+tr] = median(ratios)
				}
			}
			out = append(out, m)
		}
	}
	return out
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	slices.Sort(v)
	if len(v)%2 == 1 {
		return v[len(v)/2]
	}
	return (v[len(v)/2-1] + v[len(v)/2]) / 2
}

func printStreamsMedians(out io.Writer, meds []streamsMedian, opts options) {
	base := opts.transports[0]
	others := opts.transports[1:]
	size := -1
	for _, m := range meds {
		if m.Size != size {
			size = m.Size
			fmt.Fprintf(out, "\nmedians of %d rounds, %d streams × %s", opts.rounds, opts.streams, fmtSize(size))
			if len(others) > 0 {
				fmt.Fprintf(out, " (ratios: median of the per-round ratios)")
			}
			fmt.Fprintf(out, "\n%-16s", "")
			for _, tr := range opts.transports {
				fmt.Fprintf(out, " %12s", tr)
			}
			for _, tr := range others {
				fmt.Fprintf(out, " %10s", base+"/"+tr)
			}
			fmt.Fprintln(out)
		}
		q := streamsQuantities[slices.IndexFunc(streamsQuantities, func(q streamsQuantity) bool { return q.name == m.Quantity })]
		fmt.Fprintf(out, "%-16s", m.Quantity)
		for _, tr := range opts.transports {
			v := m.Values[tr]
			s := fmt.Sprintf("%.2f", v)
			switch {
			case q.unit == "µs":
				s = fmtUs(v)
			case v >= 100:
				s = thousands(int(v))
			}
			fmt.Fprintf(out, " %12s", s)
		}
		for _, tr := range others {
			fmt.Fprintf(out, " %10s", fmt.Sprintf("%.2f", m.Ratios[base+"/"+tr]))
		}
		fmt.Fprintln(out)
	}
	if base == "shm" && slices.Contains(others, "uds") {
		fmt.Fprintln(out, "\nissue 10 targets at 64 streams × 4 KiB: round trips/s shm/uds ≥ 5, p99 shm/uds ≤ 1, shm slowest/fastest ≥ 0.8, CPU/round trip shm/uds ≤ 1")
	}
}

// streamClient is one client of the many-streams mode.
type streamClient interface {
	pinger
	Close() error
}

// measureStreams opens opts.streams clients of transport tr, warms them up
// and runs them for opts.duration.
func measureStreams(tr string, size int, opts options, srv *server) (streamsResult, error) {
	clients, wakeups, closeAll, err := openClients(tr, size, opts.streams, srv)
	if err != nil {
		return streamsResult{}, err
	}
	defer closeAll()

	// Warm up: every client at once, as in the timed part, long enough for
	// memory to be committed and the receivers' spinning to settle.
	warm := min(max(opts.duration/4, 50*time.Millisecond), 500*time.Millisecond)
	if err := runClients(clients, warm, true, nil); err != nil {
		return streamsResult{}, fmt.Errorf("warm-up: %w", err)
	}

	hists := make([]latencyHist, len(clients))
	runtime.GC() // not during the timed part, which allocates nothing
	c0, s0, w0, t0 := selfCPU(), procCPU(srv.pid()), wakeups(), time.Now()
	if err := runClients(clients, opts.duration, false, hists); err != nil {
		return streamsResult{}, err
	}
	c1, s1, w1, elapsed := selfCPU(), procCPU(srv.pid()), wakeups(), time.Since(t0)

	// Still echoing the right bytes?
	for _, c := range clients {
		if err := c.roundTrip(true); err != nil {
			return streamsResult{}, fmt.Errorf("after timing: %w", err)
		}
	}

	var all latencyHist
	slowest, fastest := int64(hists[0].n), int64(hists[0].n)
	for i := range hists {
		all.merge(&hists[i])
		slowest, fastest = min(slowest, int64(hists[i].n)), max(fastest, int64(hists[i].n))
	}
	n := int64(all.n)
	if n == 0 {
		return streamsResult{}, errors.New("no round trip completed")
	}
	r := streamsResult{
		Transport:  tr,
		Size:       size,
		Streams:    len(clients),
		Seconds:    elapsed.Seconds(),
		RoundTrips: n,
		PerSecond:  float64(n) / elapsed.Seconds(),
		P50:        all.percentile(0.50),
		P99:        all.percentile(0.99),
		P999:       all.percentile(0.999),
		Max:        us(all.max),
		Slowest:    slowest,
		Fastest:    fastest,
		Fairness:   float64(slowest) / float64(fastest),
		ClientCPU:  us(c1-c0) / float64(n),
		ServerCPU:  us(s1-s0) / float64(n),
		Wakeups:    perRoundTrip(w0, w1, int(n)),
	}
	return r, nil
}

// runClients runs every client on its own goroutine, round trip after round
// trip, until d has passed; each finishes the round trip it is in. With
// hists, client i records its round-trip times in hists[i]. With verify,
// each client checks its first echo. The first error stops all clients.
func runClients(clients []streamClient, d time.Duration, verify bool, hists []latencyHist) error {
	var (
		stop     atomic.Bool
		wg       sync.WaitGroup
		errOnce  sync.Once
		firstErr error
	)
	start := make(chan struct{})
	for i, c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var h *latencyHist
			if hists != nil {
				h = &hists[i]
			}
			<-start
			check := verify
			for !stop.Load() {
				t := time.Now()
				err := c.roundTrip(check)
				if err != nil {
					errOnce.Do(func() { firstErr = err })
					stop.Store(true)
					return
				}
				check = false
				if h != nil {
					h.record(time.Since(t))
				}
			}
		}()
	}
	close(start)
	timer := time.NewTimer(d)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-timer.C:
		stop.Store(true)
		<-done
	case <-done: // all failed
		timer.Stop()
	}
	return firstErr
}

// openClients opens n clients of transport tr that send size-byte messages
// to srv, and returns them with a function that counts their wake-ups (-1
// for transports without) and one that closes them all.
func openClients(tr string, size, n int, srv *server) ([]streamClient, func() int64, func(), error) {
	var (
		clients []streamClient
		sess    *shmipc.Session
	)
	closeAll := func() {
		for _, c := range clients {
			c.Close()
		}
		if sess != nil {
			sess.Close()
		}
	}
	var open func() (streamClient, error)
	wakeups := func() int64 { return -1 }
	switch tr {
	case "shm":
		conf := shmConfig()
		var err error
		if sess, err = shmipc.Dial("unix", srv.shmSock, conf); err != nil {
			return nil, nil, nil, err
		}
		open = func() (streamClient, error) { return openShm(sess, conf, size) }
		wakeups = func() int64 { return sessionWakeups(sess) }
	case "uds", "tcp":
		network, addr := "unix", srv.udsSock
		if tr == "tcp" {
			network, addr = "tcp", srv.tcpAddr
		}
		open = func() (streamClient, error) { return openConn(network, addr, size) }
	default:
		return nil, nil, nil, fmt.Errorf("unknown transport %q", tr)
	}
	for range n {
		c, err := open()
		if err != nil {
			closeAll()
			return nil, nil, nil, fmt.Errorf("opening client %d of %d: %w", len(clients)+1, n, err)
		}
		clients = append(clients, c)
	}
	return clients, wakeups, closeAll, nil
}

// writeJSON writes v as indented JSON to path, or to stdout for "-".
func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	b = append(b, '\n')
	if path == "-" {
		_, err = os.Stdout.Write(b)
	} else {
		err = os.WriteFile(path, b, 0o644)
	}
	return err
}

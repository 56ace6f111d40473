package main

// The single-stream run: where it ran, the table it prints as rows
// complete, the idle session's cost, and the chart and JSON it writes.

import (
	"fmt"
	"io"
	"os"
	"runtime"
	"time"
)

// report is everything a run measured.
type report struct {
	runEnv
	Results []summary   `json:"results"`
	Idle    *idleResult `json:"idle_shm_session,omitempty"`
}

// runEnv is what a run records about where it ran.
type runEnv struct {
	Machine   string    `json:"machine"`
	Go        string    `json:"go"`
	Time      time.Time `json:"time"`
	ClientPID int       `json:"client_pid"`
	ServerPID int       `json:"server_pid"`
	Load      string    `json:"load_average"` // 1, 5 and 15 min, before the run
	LoadAfter string    `json:"load_average_after"`
	Hogs      int       `json:"cpu_hogs"`
	HogPIDs   []int     `json:"cpu_hog_pids,omitempty"`
	HogsCores float64   `json:"cpu_hogs_cores_used"` // CPU time the hogs got, in cores

	dir string // the server's socket directory, removed by now
}

// startRun starts the echo server for the transports of opts and the CPU
// hogs. The caller stops both.
func startRun(opts options) (*server, *contention, runEnv, error) {
	srv, err := startServer(opts.transports)
	if err != nil {
		return nil, nil, runEnv{}, err
	}
	load := loadAverage()
	hogs, err := startContention(opts.hogs)
	if err != nil {
		srv.stop()
		return nil, nil, runEnv{}, err
	}
	return srv, hogs, runEnv{
		Machine:   machine(),
		Go:        goVersion(),
		Time:      time.Now().UTC().Truncate(time.Second),
		ClientPID: os.Getpid(),
		ServerPID: srv.pid(),
		Load:      load,
		Hogs:      opts.hogs,
		HogPIDs:   hogs.pids(),
		dir:       srv.dir,
	}, nil
}

// platform is the line under a run's title: machine, Go, load and hogs.
func (e *runEnv) platform(hogs *contention) string {
	api := "shm in place"
	if connAPI {
		api = "shm through net.Conn (-conn)"
	}
	return fmt.Sprintf("%s · %s · GOMAXPROCS %d · load average %s · %s · %s", e.Machine, e.Go, runtime.GOMAXPROCS(0), e.Load, hogs.describe(), api)
}

// finish stops the hogs and records what they got and the load after the
// run, and returns the line that says so.
func (e *runEnv) finish(hogs *contention) string {
	e.HogsCores = hogs.cores()
	hogs.stop()
	e.LoadAfter = loadAverage()
	return "load average after: " + e.LoadAfter + hogs.summary(e.HogsCores)
}

// idleResult is the CPU an open, unused shm session costs each process.
type idleResult struct {
	Seconds   float64 `json:"seconds"`
	ClientPct float64 `json:"client_cpu_percent_of_a_core"`
	ServerPct float64 `json:"server_cpu_percent_of_a_core"`
}

// run starts the echo server, measures every transport and size, prints the
// table to out as rows complete, and writes the chart and the JSON file.
func run(opts options, out io.Writer) (*report, error) {
	srv, hogs, env, err := startRun(opts)
	if err != nil {
		return nil, err
	}
	defer srv.stop()
	defer hogs.stop()
	rep := &report{runEnv: env}
	fmt.Fprintf(out, "pingpong: round trips between two processes (client pid %d, echo server pid %d)\n", rep.ClientPID, rep.ServerPID)
	fmt.Fprintf(out, "%s\n\n", rep.platform(hogs))
	fmt.Fprintf(out, rowFormat, "transport", "size", "n", "p50", "p99", "p99.9", "mean", "MB/s", "client CPU/op", "server CPU/op", "wake-ups/op")
	emit := func(s summary) {
		rep.Results = append(rep.Results, s)
		p999 := "-"
		if s.hasP999() {
			p999 = fmtUs(s.P999)
		}
		fmt.Fprintf(out, rowFormat, s.Transport, fmtSize(s.Size), fmt.Sprint(s.N), fmtUs(s.P50), fmtUs(s.P99), p999,
			fmtUs(s.Mean), fmt.Sprintf("%.1f", s.MBps), fmtUs(s.ClientCPU), fmtUs(s.ServerCPU), fmtWakeups(s.Wakeups))
	}
	for i, tr := range opts.transports {
		if i > 0 {
			fmt.Fprintln(out)
		}
		switch tr {
		case "shm":
			rep.Idle, err = runShm(opts, srv, emit)
		case "uds":
			err = runConn(opts, srv, "unix", srv.udsSock, tr, emit)
		case "tcp":
			err = runConn(opts, srv, "tcp", srv.tcpAddr, tr, emit)
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", tr, err)
		}
	}
	fmt.Fprintln(out)
	fmt.Fprintln(out, "Round-trip times from the client; p99.9 only with n ≥ 1000. MB/s counts both directions (10⁶ B/s).")
	fmt.Fprintln(out, "CPU/op: process CPU time (user+system, all threads) during the timed round trips, divided by n.")
	fmt.Fprintln(out, "wake-ups/op: Polling frames sent either way per round trip (0: the receivers' spinning caught every message; 2: both slept).")
	if rep.Idle != nil {
		fmt.Fprintf(out, "idle: one open shm session, unused for %.1f s: client %.2f %%, server %.2f %% of a core\n",
			rep.Idle.Seconds, rep.Idle.ClientPct, rep.Idle.ServerPct)
	}
	fmt.Fprintln(out, rep.finish(hogs))
	srv.stop() // before writing files, so that a crash there leaves nothing behind

	if opts.svg != "" {
		if err := writeSVG(opts.svg, rep, opts.transports); err != nil {
			return nil, err
		}
		fmt.Fprintf(out, "chart: %s\n", opts.svg)
	}
	if opts.jsonPath != "" {
		if err := writeJSON(opts.jsonPath, rep); err != nil {
			return nil, err
		}
	}
	return rep, nil
}

const rowFormat = "%-9s %8s %6s %9s %9s %9s %9s %9s  %13s  %13s  %11s\n"

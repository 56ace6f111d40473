package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The test binary doubles as the echo server (run re-executes
// os.Executable, which is the test binary here) and, for
// TestServerExitsWithParent, as a client that gets killed.
func TestMain(m *testing.M) {
	if childMain() {
		return
	}
	if args, ok := os.LookupEnv("PINGPONG_TEST_MAIN"); ok {
		os.Args = append([]string{"pingpong"}, strings.Fields(args)...)
		main()
		return
	}
	if os.Getenv("PINGPONG_TEST_PARENT") == "1" {
		srv, err := startServer(allTransports)
		if err == nil {
			var hogs *contention
			if hogs, err = startContention(2); err == nil {
				fmt.Println(srv.pid(), srv.dir, strings.Trim(fmt.Sprint(hogs.pids()), "[]"))
				select {} // until killed
			}
		}
		fmt.Println("error", err)
		os.Exit(1)
	}
	os.Exit(m.Run())
}

var durationRE = regexp.MustCompile(`[0-9] (ns|µs|ms|s)( |$)`)

// TestQuick runs the -quick configuration end to end and checks the table,
// the chart, the JSON file and that nothing is left behind.
func TestQuick(t *testing.T) {
	dir := t.TempDir()
	opts := quickOptions(defaultOptions(), nil)
	opts.svg = filepath.Join(dir, "chart.svg")
	opts.jsonPath = filepath.Join(dir, "out.json")
	var out bytes.Buffer
	start := time.Now()
	rep, err := run(opts, &out)
	t.Logf("run took %v; output:\n%s", time.Since(start).Round(time.Millisecond), out.String())
	if err != nil {
		t.Fatal(err)
	}

	// A table row for every transport and size, with p50 and p99 in it.
	lines := strings.Split(out.String(), "\n")
	for _, tr := range opts.transports {
		for _, size := range opts.sizes {
			prefix := fmt.Sprintf("%-9s %8s ", tr, fmtSize(size))
			found := false
			for _, l := range lines {
				if strings.HasPrefix(l, prefix) {
					found = true
					if n := len(durationRE.FindAllString(l, -1)); n < 5 { // p50, p99, mean, 2 × CPU
						t.Errorf("row %q lacks durations", l)
					}
				}
			}
			if !found {
				t.Errorf("no table row for %s at %s", tr, fmtSize(size))
			}
		}
	}
	if !strings.Contains(out.String(), "idle: one open shm session") {
		t.Error("no idle line")
	}
	if want := len(opts.transports) * len(opts.sizes); len(rep.Results) != want {
		t.Errorf("%d results, want %d", len(rep.Results), want)
	}
	for _, s := range rep.Results {
		if s.N < 1 || s.P50 <= 0 || s.P99 < s.P50 || s.MBps <= 0 || s.ClientCPU <= 0 || s.ServerCPU <= 0 {
			t.Errorf("implausible result %+v", s)
		}
		if (s.Wakeups != nil) != (s.Transport == "shm") || s.Wakeups != nil && *s.Wakeups < 0 {
			t.Errorf("%s at %d B: wake-ups per round trip %v; want a count for shm only", s.Transport, s.Size, s.Wakeups)
		}
	}
	if rep.Idle == nil || rep.Idle.Seconds < 0.15 || rep.Idle.ClientPct < 0 || rep.Idle.ServerPct < 0 {
		t.Errorf("idle result %+v", rep.Idle)
	}

	// The SVG is XML with one line per transport in each panel, a point per size.
	f, err := os.Open(opts.svg)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	polylines := map[string]int{}
	dec := xml.NewDecoder(f)
	root := ""
	for {
		tok, err := dec.Token()
		if err != nil {
			if !errors.Is(err, io.EOF) {
				t.Fatalf("chart is not well-formed XML: %v", err)
			}
			break
		}
		se, ok := tok.(xml.StartElement)
		if !ok {
			continue
		}
		if root == "" {
			root = se.Name.Local
		}
		if se.Name.Local != "polyline" {
			continue
		}
		attr := map[string]string{}
		for _, a := range se.Attr {
			attr[a.Name.Local] = a.Value
		}
		polylines[attr["data-transport"]]++
		if n := len(strings.Fields(attr["points"])); n != len(opts.sizes) {
			t.Errorf("%s line in panel %s has %d points, want %d", attr["data-transport"], attr["data-panel"], n, len(opts.sizes))
		}
	}
	if root != "svg" {
		t.Errorf("chart's root element is %q", root)
	}
	for _, tr := range opts.transports {
		if polylines[tr] != len(chartPanels) {
			t.Errorf("chart has %d lines for %s, want %d (one per panel)", polylines[tr], tr, len(chartPanels))
		}
	}
	if len(polylines) != len(opts.transports) {
		t.Errorf("chart has lines for %v, want %v", polylines, opts.transports)
	}

	// The JSON file holds the same results.
	b, err := os.ReadFile(opts.jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	var got report
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	if len(got.Results) != len(rep.Results) || got.Idle == nil || got.ServerPID != rep.ServerPID {
		t.Errorf("JSON output differs from the report: %s", b)
	}

	// The server is gone and so are its sockets.
	if alive(rep.ServerPID) {
		t.Errorf("server %d still runs", rep.ServerPID)
	}
	if _, err := os.Stat(rep.dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket directory %s still exists (%v)", rep.dir, err)
	}
}

// TestChildrenExitWithParent kills a client with SIGKILL, so that it cannot
// clean up, and checks that its server exits and removes its sockets
// anyway, and that its CPU hogs exit.
func TestChildrenExitWithParent(t *testing.T) {
	parent, stdout := startSelf(t, "PINGPONG_TEST_PARENT=1")
	line, err := stdout.ReadString('\n')
	f := strings.Fields(line)
	if err != nil || len(f) != 4 {
		t.Fatalf("parent said %q, %v", line, err)
	}
	var hogs []int
	for _, s := range f[2:] {
		pid, err := strconv.Atoi(s)
		if err != nil {
			t.Fatalf("parent said %q", line)
		}
		hogs = append(hogs, pid)
	}
	pid, err := strconv.Atoi(f[0])
	if err != nil {
		t.Fatal(err)
	}
	dir := f[1]
	if !alive(pid) {
		t.Fatalf("server %d is not running", pid)
	}
	parent.Process.Signal(syscall.SIGKILL)
	parent.Wait()
	deadline := time.Now().Add(5 * time.Second)
	for _, hog := range hogs {
		waitGone(t, hog, deadline, "CPU hog")
	}
	waitGone(t, pid, deadline, "server")
	// The server removes the directory after its sockets; give it a moment.
	for {
		if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
			break
		}
		if time.Now().After(deadline) {
			os.RemoveAll(dir)
			t.Fatalf("socket directory %s left behind", dir)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// waitGone waits until process pid has exited, and kills it and fails the
// test if it still runs at the deadline.
func waitGone(t *testing.T, pid int, deadline time.Time, what string) {
	t.Helper()
	for alive(pid) {
		if time.Now().After(deadline) {
			syscall.Kill(pid, syscall.SIGKILL)
			t.Fatalf("%s %d still runs 5 s after its parent was killed", what, pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// alive reports whether process pid exists and is not a zombie (a killed
// parent's orphans may not be reaped promptly in a container).
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	rest := string(b[strings.LastIndexByte(string(b), ')')+1:])
	f := strings.Fields(rest)
	return len(f) > 0 && f[0] != "Z" && f[0] != "X"
}

func TestParseSizes(t *testing.T) {
	got, err := parseSizes("1m, 64,4KiB,1k,4k,0.5k,2MB")
	if err != nil {
		t.Fatal(err)
	}
	want := []int{64, 512, 1024, 4096, 1 << 20, 2 << 20}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("got %v, want %v", got, want)
	}
	for _, bad := range []string{"", "x", "-1", "0", "65m"} {
		if _, err := parseSizes(bad); err == nil {
			t.Errorf("parseSizes(%q) succeeded", bad)
		}
	}
}

func TestNiceScale(t *testing.T) {
	if lo, hi := niceBelow(13), niceAbove(870); lo != 10 || hi != 1000 {
		t.Errorf("niceBelow(13), niceAbove(870) = %v, %v; want 10, 1000", lo, hi)
	}
	if got := fmt.Sprint(niceTicks(20, 1000)); got != "[20 50 100 200 500 1000]" {
		t.Errorf("niceTicks(20, 1000) = %s", got)
	}
	for v, want := range map[float64]string{0.5: "500 ns", 20: "20 µs", 2000: "2 ms"} {
		if got := fmtTick(v); got != want {
			t.Errorf("fmtTick(%v) = %q, want %q", v, got, want)
		}
	}
	if got := thousands(1234567); got != "1,234,567" {
		t.Errorf("thousands(1234567) = %q", got)
	}
	if got := fmtSize(1536); got != "1.5 KiB" {
		t.Errorf("fmtSize(1536) = %q", got)
	}
}

// TestStreamsQuick runs the many-streams mode with a CPU hog and checks the
// table, the medians, the JSON file and that the server and the hog are
// gone afterwards.
func TestStreamsQuick(t *testing.T) {
	dir := t.TempDir()
	opts := streamsOptions(defaultOptions(), nil)
	opts.streams = 8
	opts.hogs = 1
	opts = quickOptions(opts, map[string]bool{"duration": true})
	opts.duration = 100 * time.Millisecond
	opts.jsonPath = filepath.Join(dir, "out.json")
	var out bytes.Buffer
	rep, err := runStreams(opts, &out)
	t.Logf("output:\n%s", out.String())
	if err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprint(opts.transports, opts.sizes, opts.rounds); got != "[shm uds] [4096] 2" {
		t.Errorf("transports, sizes, rounds = %s; want the many-streams defaults [shm uds] [4096] 2", got)
	}

	// A row per round and transport, the transports taking turns.
	var order []string
	for _, l := range strings.Split(out.String(), "\n") {
		f := strings.Fields(l)
		if len(f) > 2 && strings.Trim(f[0], "0123456789") == "" {
			order = append(order, f[0]+f[1])
		}
	}
	if got := strings.Join(order, " "); got != "1shm 1uds 2uds 2shm" {
		t.Errorf("rows in the order %q, want 1shm 1uds 2uds 2shm", got)
	}
	for _, r := range rep.Results {
		if r.Streams != 8 || r.RoundTrips < 8 || r.PerSecond <= 0 || r.P50 <= 0 || r.P99 < r.P50 ||
			r.Max < r.P99 || r.Slowest < 1 || r.Fastest < r.Slowest || r.Fairness <= 0 || r.Fairness > 1 ||
			r.ClientCPU <= 0 || r.ServerCPU <= 0 {
			t.Errorf("implausible result %+v", r)
		}
		if (r.Wakeups != nil) != (r.Transport == "shm") || r.Wakeups != nil && *r.Wakeups < 0 {
			t.Errorf("%s, round %d: wake-ups per round trip %v; want a count for shm only", r.Transport, r.Round, r.Wakeups)
		}
	}
	ratios := 0
	for _, m := range rep.Medians {
		if m.Values["shm"] <= 0 || m.Values["uds"] <= 0 {
			t.Errorf("median of %s: %v", m.Quantity, m.Values)
		}
		if _, ok := m.Ratios["shm/uds"]; ok {
			ratios++
		}
	}
	if ratios != len(streamsQuantities) {
		t.Errorf("%d shm/uds ratios among the medians, want %d", ratios, len(streamsQuantities))
	}
	if !strings.Contains(out.String(), "medians of 2 rounds, 8 streams × 4 KiB") {
		t.Error("no medians table")
	}

	b, err := os.ReadFile(opts.jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	var got streamsReport
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	if len(got.Results) != 4 || len(got.Medians) != len(rep.Medians) || got.Hogs != 1 || len(got.HogPIDs) != 1 {
		t.Errorf("JSON output differs from the report: %s", b)
	}

	if alive(rep.ServerPID) {
		t.Errorf("server %d still runs", rep.ServerPID)
	}
	for _, pid := range rep.HogPIDs {
		if alive(pid) {
			t.Errorf("CPU hog %d still runs", pid)
		}
	}
	if _, err := os.Stat(rep.dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket directory %s still exists (%v)", rep.dir, err)
	}
}

// TestHogsStopOnFailure checks that the hogs go when a run fails after
// starting them.
func TestHogsStopOnFailure(t *testing.T) {
	opts := quickOptions(streamsOptions(defaultOptions(), nil), nil)
	opts.streams, opts.hogs = 1, 2
	opts.transports = []string{"uds"}
	opts.sizes = []int{maxSize + 1} // the server refuses the size and hangs up
	rep, err := runStreams(opts, io.Discard)
	if err == nil {
		t.Fatalf("a run with an oversized message succeeded: %+v", rep)
	}
	if hogs := hogChildren(t); len(hogs) > 0 {
		t.Errorf("CPU hogs %v still run after the run failed (%v)", hogs, err)
	}
}

// TestInterruptStopsChildren interrupts a many-streams run with hogs and
// checks that it stops its server and hogs before it exits.
func TestInterruptStopsChildren(t *testing.T) {
	cmd, br := startSelf(t, "PINGPONG_TEST_MAIN=-streams 2 -hogs 2 -duration 1m -rounds 1")
	// The second line names the hogs; the server's pid is in the first.
	first, _ := br.ReadString('\n')
	second, err := br.ReadString('\n')
	if err != nil {
		t.Fatalf("run said %q %q, %v", first, second, err)
	}
	server := regexp.MustCompile(`echo server pid ([0-9]+)`).FindStringSubmatch(first)
	hogs := regexp.MustCompile(`pids ([0-9]+), ([0-9]+)\)`).FindStringSubmatch(second)
	if server == nil || hogs == nil {
		t.Fatalf("run said %q %q", first, second)
	}
	time.Sleep(100 * time.Millisecond) // into the measurement
	cmd.Process.Signal(syscall.SIGINT)
	go io.Copy(io.Discard, br)
	err = cmd.Wait()
	if cmd.ProcessState.ExitCode() != 130 {
		t.Errorf("interrupted run ended with %v, want exit status 130", err)
	}
	for _, s := range append(server[1:], hogs[1:]...) {
		pid, _ := strconv.Atoi(s)
		if alive(pid) {
			syscall.Kill(pid, syscall.SIGKILL)
			t.Errorf("child %d still runs after the interrupted run exited", pid)
		}
	}
}

// startSelf starts the test binary, running no tests, with env added to
// its environment (TestMain looks at it), and returns it with its stdout.
// It is killed when the test ends if it still runs.
func startSelf(t *testing.T, env string) (*exec.Cmd, *bufio.Reader) {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self, "-test.run=^$")
	cmd.Env = append(os.Environ(), env)
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill() })
	return cmd, bufio.NewReader(stdout)
}

// hogChildren returns the pids of this process's children that are CPU hogs.
func hogChildren(t *testing.T) []int {
	t.Helper()
	procs, err := filepath.Glob("/proc/[0-9]*")
	if err != nil {
		t.Fatal(err)
	}
	var hogs []int
	for _, p := range procs {
		pid, _ := strconv.Atoi(filepath.Base(p))
		cmdline, err := os.ReadFile(p + "/cmdline")
		if err != nil || !alive(pid) {
			continue
		}
		args := strings.Split(string(cmdline), "\x00")
		if len(args) < 2 || args[1] != hogArg || parentPID(pid) != os.Getpid() {
			continue
		}
		hogs = append(hogs, pid)
	}
	return hogs
}

// parentPID is the parent of process pid (0 if unknown).
func parentPID(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	if len(f) < 2 {
		return 0
	}
	ppid, _ := strconv.Atoi(f[1])
	return ppid
}

// With -conn both processes use the stream's net.Conn methods, and the
// echoes still match what was sent (the first round trip of each
// measurement checks its echo).
func TestConnAPI(t *testing.T) {
	connAPI = true
	defer func() { connAPI = false }()
	opts := quickOptions(defaultOptions(), nil)
	opts.transports, opts.svg, opts.idle = []string{"shm"}, "", 0
	var out bytes.Buffer
	rep, err := run(opts, &out)
	t.Logf("output:\n%s", out.String())
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Results) != len(opts.sizes) {
		t.Fatalf("%d results, want %d", len(rep.Results), len(opts.sizes))
	}
	for _, s := range rep.Results {
		if s.N < 1 || s.P50 <= 0 {
			t.Errorf("implausible result %+v", s)
		}
	}
}

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
	if len(os.Args) > 1 && os.Args[1] == serveArg {
		serveMain(os.Args[2:])
		return
	}
	if os.Getenv("PINGPONG_TEST_PARENT") == "1" {
		srv, err := startServer(allTransports)
		if err != nil {
			fmt.Println("error", err)
			os.Exit(1)
		}
		fmt.Println(srv.pid(), srv.dir)
		select {} // until killed
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

// TestServerExitsWithParent kills a client with SIGKILL, so that it cannot
// clean up, and checks that its server exits and removes its sockets anyway.
func TestServerExitsWithParent(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	parent := exec.Command(self, "-test.run=^$")
	parent.Env = append(os.Environ(), "PINGPONG_TEST_PARENT=1")
	parent.Stderr = os.Stderr
	stdout, err := parent.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := parent.Start(); err != nil {
		t.Fatal(err)
	}
	defer parent.Process.Kill()
	line, err := bufio.NewReader(stdout).ReadString('\n')
	f := strings.Fields(line)
	if err != nil || len(f) != 2 {
		t.Fatalf("parent said %q, %v", line, err)
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
	for alive(pid) {
		if time.Now().After(deadline) {
			syscall.Kill(pid, syscall.SIGKILL)
			t.Fatalf("server %d still runs 5 s after its client was killed", pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
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

package shmipc

// Soak: many streams in both directions between two real processes, for a
// while, with every message checksummed and sequenced, so that a single
// corrupted, lost, duplicated or reordered byte fails the test.
//
// Two sessions run at once between the parent and a child process:
//
//   - session A: the parent is the client and the child the server, with the
//     default slice classes in a 16 MiB region;
//   - session B: the child is the client and the parent the server, with a
//     1 MiB region of ReferenceSliceSizes and a 64-element queue, so large
//     messages span many slices, the region runs dry (fallback) and the
//     queue fills (ErrQueueFull, retried).
//
// On each session the client keeps a few stream slots busy: each slot opens
// a stream, both ends send a random number of messages of 1 B to 4 MiB and an
// end marker, read the other end's messages up to its end marker, and close
// the stream; then the slot opens the next one. One stream in skFallbackEvery
// starts with a 5 MiB message built with Reserve, more than the largest slice,
// which goes as fallback data, so the whole stream does from then on.
//
// Short run (part of go test): go test -run TestSoak .
// Long run: go test -run TestSoak -soak.duration=10m -timeout=20m .

import (
	"flag"
	"fmt"
	"math/rand/v2"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

var soakDuration = flag.Duration("soak.duration", 3*time.Second, "how long TestSoak sends traffic")

// Configurations of the two soak sessions.
func skConfigA(prefix string, fallbackWhenFull bool) *Config {
	conf := DefaultConfig()
	conf.FallbackWhenFull = fallbackWhenFull
	conf.ShareMemoryPathPrefix = prefix
	conf.ShareMemoryBufferCap = 16 << 20
	conf.InitializeTimeout = 20 * time.Second
	conf.ConnectionWriteTimeout = 60 * time.Second
	conf.WriteSpaceTimeout = 5 * time.Second // a writer stuck on a full region fails soon
	return conf
}

func skConfigB(prefix string, fallbackWhenFull bool) *Config {
	conf := skConfigA(prefix, fallbackWhenFull)
	conf.ShareMemoryBufferCap = 1 << 20
	conf.BufferSliceSizes = ReferenceSliceSizes()
	conf.QueueCap = 64
	return conf
}

const (
	skChildTest = "TestSoakChild"
	skSlotsA    = 6 // parent client → child server
	skSlotsB    = 4 // child client → parent server
)

var soakTotals struct {
	sync.Mutex
	msgs, bytes int64
}

// TestSoakChild is the child process of TestSoak: the server of session A
// (listening on SOCK) and the client of session B (dialing SOCK2) until
// DEADLINE (Unix nanoseconds). When its stdin closes it waits for the
// streams of session A, prints "result <stats>", and then waits for the
// parent to close both sessions.
func TestSoakChild(t *testing.T) {
	if proctest.Role() == "" {
		t.Skip("runs only as the child process of TestSoak")
	}
	prefix := proctest.MustArg(t, "PREFIX")
	dl, err := strconv.ParseInt(proctest.MustArg(t, "DEADLINE"), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Unix(0, dl)
	seed, _ := strconv.ParseUint(proctest.MustArg(t, "SEED"), 10, 64)
	fwf := proctest.MustArg(t, "FWF") == "1"
	stats := &skStats{}

	ln, err := Listen("unix", proctest.MustArg(t, "SOCK"), skConfigA(prefix, fwf))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	srv := &skServer{stats: stats}
	srv.serve(ln.AcceptStream, seed)
	proctest.Ready()

	sessB, err := Dial("unix", proctest.MustArg(t, "SOCK2"), skConfigB(prefix, fwf))
	if err != nil {
		t.Fatal(err)
	}
	defer sessB.Close()
	clientErrs := make(chan []error, 1)
	go func() { clientErrs <- skClient(sessB, skSlotsB, deadline, seed+1, stats) }()

	<-proctest.StdinClosed() // the parent's slots on session A are done
	for _, err := range <-clientErrs {
		t.Errorf("child client (session B): %v", err)
	}
	// The parent opens no more streams; finish ours of session A (they wait
	// for the parent's end markers) before reporting.
	if !srv.idle(2 * time.Minute) {
		t.Errorf("child: session A streams still running 2 min after the parent finished")
	}
	for _, err := range srv.errors() {
		t.Errorf("child server (session A): %v", err)
	}
	proctest.Println("result " + stats.String())
	// The parent closes both sessions once it has read our end markers.
	end := time.Now().Add(2 * time.Minute)
	for {
		ln.mu.Lock()
		n := len(ln.sessions)
		ln.mu.Unlock()
		if n == 0 && sessB.IsClosed() {
			break
		}
		if time.Now().After(end) {
			t.Errorf("the parent did not close the sessions within 2 min")
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	ln.Close()
	if !clWaitGroup(&srv.wg, 30*time.Second) {
		t.Errorf("child accept loop still running")
	}
}

// skParseStats parses the "result" line of the child.
func skParseStats(line string) (map[string]int64, error) {
	rest, ok := strings.CutPrefix(line, "result ")
	if !ok {
		return nil, fmt.Errorf("no result line: %q", line)
	}
	m := make(map[string]int64)
	for _, f := range strings.Fields(rest) {
		k, v, ok := strings.Cut(f, "=")
		if !ok {
			return nil, fmt.Errorf("bad field %q", f)
		}
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return nil, err
		}
		m[k] = n
	}
	return m, nil
}

// TestSoak runs the soak for -soak.duration (3 s by default) in two
// variants: with Config.FallbackWhenFull (a full region sends fallback data,
// as the reference implementations do), and with the default back-pressure
// (a writer waits for the peer to free slices).
func TestSoak(t *testing.T) {
	if proctest.IsChild() {
		t.Skip("parent-only test")
	}
	if testing.Short() {
		t.Skip("-short: a soak test")
	}
	t.Run("fallback-when-full", func(t *testing.T) { skRun(t, true) })
	t.Run("backpressure", func(t *testing.T) { skRun(t, false) })
}

func skRun(t *testing.T, fwf bool) {
	fwfArg := "0"
	if fwf {
		fwfArg = "1"
	}
	dur := shortOr(*soakDuration, *soakDuration/3)
	prefix := shmPrefix(t, "soak")
	dir := t.TempDir()
	sockA, sockB := filepath.Join(dir, "a.sock"), filepath.Join(dir, "b.sock")
	base := clBaseline(t, prefix)
	seed := rand.Uint64()
	t.Logf("soak for %v, seed %d", dur, seed)
	stats := &skStats{}

	// Session B: the parent serves, the child dials.
	rawB, err := net.Listen("unix", sockB)
	if err != nil {
		t.Fatal(err)
	}
	defer rawB.Close()
	deadline := time.Now().Add(dur)
	c, _ := startChild(t, proctest.Config{
		TestName: skChildTest,
		Role:     "soak",
		Args: map[string]string{
			"SOCK": sockA, "SOCK2": sockB, "PREFIX": prefix,
			"DEADLINE": strconv.FormatInt(deadline.UnixNano(), 10),
			"SEED":     strconv.FormatUint(seed, 10),
			"FWF":      fwfArg,
		},
		Timeout: dur + 5*time.Minute,
	})
	start := time.Now()
	sessA, err := Dial("unix", sockA, skConfigA(prefix, fwf))
	if err != nil {
		t.Fatalf("dial the child: %v", err)
	}
	defer sessA.Close()
	connB, err := rawB.Accept()
	if err != nil {
		t.Fatal(err)
	}
	sessB, err := Server(connB, skConfigB(prefix, fwf))
	if err != nil {
		t.Fatalf("session B handshake: %v", err)
	}
	defer sessB.Close()
	srv := &skServer{stats: stats}
	srv.serve(sessB.AcceptStream, seed+2)

	for _, err := range skClient(sessA, skSlotsA, deadline, seed+3, stats) {
		t.Errorf("parent client (session A): %v", err)
	}
	// No more streams on session A; the child finishes its session-B slots,
	// waits for its session-A streams and reports.
	_ = c.CloseStdin()
	line, err := c.ReadLine(dur + 2*time.Minute)
	if err != nil {
		t.Fatalf("waiting for the child's result: %v\n%s", err, c.Output())
	}
	child, err := skParseStats(line)
	if err != nil {
		t.Fatalf("%v\n%s", err, c.Output())
	}
	// Every stream the child opened has seen our end marker; wait until we
	// have read the child's.
	if !srv.idle(2 * time.Minute) {
		t.Errorf("session B streams still running 2 min after the child finished")
	}
	elapsed := time.Since(start)
	sessA.Close()
	sessB.Close()
	rawB.Close()
	if !clWaitGroup(&srv.wg, 30*time.Second) {
		t.Errorf("parent server goroutines still running")
	}
	for _, err := range srv.errors() {
		t.Errorf("parent server (session B): %v", err)
	}
	if err := c.Wait(2 * time.Minute); err != nil {
		t.Errorf("child: %v\n%s", err, c.Output())
	}
	clCheckBack(t, "after the soak", base, prefix)

	totalMsgs, totalBytes, totalStreams := int64(0), int64(0), int64(0)
	defer func() {
		soakTotals.Lock()
		soakTotals.msgs += totalMsgs
		soakTotals.bytes += totalBytes
		soakTotals.Unlock()
	}()
	totalMsgs = stats.msgs.Load() + child["msgs"]
	totalBytes = stats.bytes.Load() + child["bytes"]
	totalStreams = stats.streams.Load() + child["streams"]
	t.Logf("soak ran %v: verified %d messages, %d body bytes (%.1f MiB/s) on %d stream ends; parent %s; child %s",
		elapsed.Round(time.Millisecond), totalMsgs, totalBytes, float64(totalBytes)/(1<<20)/elapsed.Seconds(),
		totalStreams, stats, line)
	if t.Failed() {
		return
	}
	if stats.streams.Load() == 0 || child["streams"] == 0 {
		t.Errorf("a side finished no stream")
	}
	if stats.fallbackStreams.Load()+child["fallbackStreams"] == 0 {
		t.Errorf("no stream went to fallback")
	}
}

// TestSoakInProcess runs the soak's two sessions with both ends in this
// process: both ends' receive loops and writers busy at once, on both
// sessions at once.
func TestSoakInProcess(t *testing.T) {
	if proctest.IsChild() {
		t.Skip("parent-only test")
	}
	if testing.Short() {
		t.Skip("-short: a soak test")
	}
	t.Run("fallback-when-full", func(t *testing.T) { skRunInProcess(t, true) })
	t.Run("backpressure", func(t *testing.T) { skRunInProcess(t, false) })
}

func skRunInProcess(t *testing.T, fwf bool) {
	dur := shortOr(*soakDuration, *soakDuration/3) / 2
	prefix := shmPrefix(t, "soakip")
	base := clBaseline(t, prefix)
	seed := rand.Uint64()
	t.Logf("soak for %v, seed %d", dur, seed)
	stats := &skStats{}
	deadline := time.Now().Add(dur)
	type end struct {
		ln  *Listener
		cli *Session
		srv *skServer
	}
	start := func(name string, conf *Config, seed uint64) end {
		ln, err := Listen("unix", filepath.Join(t.TempDir(), name), conf)
		if err != nil {
			t.Fatal(err)
		}
		srv := &skServer{stats: stats}
		srv.serve(ln.AcceptStream, seed)
		cli, err := Dial("unix", ln.Addr().String(), conf)
		if err != nil {
			t.Fatal(err)
		}
		return end{ln, cli, srv}
	}
	ends := []end{start("a.sock", skConfigA(prefix, fwf), seed), start("b.sock", skConfigB(prefix, fwf), seed+1)}
	errs := make(chan []error, len(ends))
	for i, e := range ends {
		go func() { errs <- skClient(e.cli, []int{skSlotsA, skSlotsB}[i], deadline, seed+2+uint64(i), stats) }()
	}
	for range ends {
		for _, err := range <-errs {
			t.Errorf("client: %v", err)
		}
	}
	for _, e := range ends {
		if !e.srv.idle(2 * time.Minute) {
			t.Errorf("server streams still running 2 min after the clients finished")
		}
		e.cli.Close()
		e.ln.Close()
		if !clWaitGroup(&e.srv.wg, 30*time.Second) {
			t.Errorf("server accept loop still running")
		}
		for _, err := range e.srv.errors() {
			t.Errorf("server: %v", err)
		}
	}
	clCheckBack(t, "after the soak", base, prefix)
	t.Logf("verified %d messages, %d body bytes on %d stream ends; %s", stats.msgs.Load(), stats.bytes.Load(), stats.streams.Load(), stats)
	if stats.streams.Load() == 0 {
		t.Errorf("no stream finished")
	}
	if fwf && stats.fallbackStreams.Load() == 0 {
		t.Errorf("no stream went to fallback")
	}
}

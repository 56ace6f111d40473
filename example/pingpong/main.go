// Command pingpong measures the round-trip latency between two processes
// over shmipc shared memory, a plain Unix socket and TCP loopback, at
// several message sizes, in one run:
//
//	go run ./example/pingpong                      # all sizes and transports, about 30 s
//	go run ./example/pingpong -quick               # a few seconds, for CI
//	go run ./example/pingpong -sizes 64,4k,1m -transports shm,uds -n 50000 -json out.json
//	go run ./example/pingpong -streams 64          # 64 streams × 4 KiB at once, shm and uds, 5 rounds
//	go run ./example/pingpong -streams 64 -hogs 2  # the same while 2 CPU-bound processes compete
//
// With -streams N it measures many streams at once instead (streams.go):
// throughput, latency percentiles, fairness between the streams and CPU
// per round trip, the transports taking turns for -rounds rounds. With
// -hogs N, in either mode, N CPU-bound child processes spin while it
// measures (hog.go).
//
// It starts itself again as an echo server in a child process (the hidden
// first argument -serve), then, in this process, sends a message of each
// size, waits for the echo, and times every round trip. For each transport
// and size it prints p50, p99, p99.9 and mean round-trip time, throughput
// and the CPU time that each process spent per round trip; then how much
// CPU an idle open shmipc session costs; and it draws p50 and p99 against
// message size in an SVG chart (-svg).
//
// The transports:
//
//	shm  shmipc over a Unix socket, memfd regions, DefaultConfig. The client
//	     copies its payload into shared memory and reads the echo in place;
//	     the server echoes from shared memory into shared memory.
//	uds  a net.UnixConn; each process copies the bytes into and out of the
//	     kernel.
//	tcp  a TCP connection on 127.0.0.1, otherwise like uds.
//
// Every connection (or stream) starts with a 4-byte big-endian message size;
// after that both sides know where messages end, and the server echoes
// messages of that size until the client closes.
//
// The server exits, removing its sockets, when its standard input reaches
// end of file, which happens when this process exits or dies; it also gets
// SIGTERM if this process dies (Pdeathsig).
package main

import (
	"bytes"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"math"
	"net"
	"os"
	"os/signal"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/goshm/shmipc"
)

// serveArg, as the first argument, makes the program the echo server.
const serveArg = "-serve"

// spinTime is the shmipc ConsumerSpinTime of both processes.
var spinTime = shmipc.DefaultConfig().ConsumerSpinTime

// connAPI: both processes use shmipc streams through their net.Conn
// methods alone (Write, and io.ReadFull into their own buffer), as code
// written for any connection does, instead of writing and reading in
// place in shared memory.
var connAPI bool

// shmConfig is the configuration of both shm sides.
func shmConfig() *shmipc.Config {
	conf := shmipc.DefaultConfig()
	conf.ConsumerSpinTime = spinTime
	return conf
}

var allTransports = []string{"shm", "uds", "tcp"}

var transportInfo = map[string]string{
	"shm": "shmipc (memfd, Unix socket)",
	"uds": "Unix socket",
	"tcp": "TCP loopback",
}

// options is one run's configuration.
type options struct {
	sizes      []int
	n          int           // round trips for sizes up to 4 KiB; fewer for larger ones
	transports []string      // from allTransports
	svg        string        // chart path; "" for none
	idle       time.Duration // how long the idle shm session is watched; 0 to skip
	jsonPath   string        // "" for none, "-" for stdout
	minRun     time.Duration // short round trips are repeated for at least this long
	maxRun     time.Duration // cap on the timed part of one measurement
	hogs       int           // CPU-bound processes that run alongside the measurements

	// The many-streams mode (streams > 0, streams.go).
	streams  int           // clients at once, a stream or connection each
	duration time.Duration // timed part of one measurement
	rounds   int           // measurements of each transport and size, alternating
}

// serverProfile is where the echo server writes a CPU profile ("" for none).
var serverProfile string

func main() {
	if childMain() {
		return
	}
	def := defaultOptions()
	sizes := flag.String("sizes", "64,1k,4k,16k,64k,256k,1m", "message sizes, comma-separated (k and m are 1024 and 1024²)")
	flag.IntVar(&def.n, "n", def.n, "round trips per measurement for sizes up to 4 KiB; larger sizes get n·√(4 KiB/size), at least 200 (more if -minrun is not reached)")
	transports := flag.String("transports", strings.Join(allTransports, ","), "transports to measure: shm, uds, tcp")
	flag.StringVar(&def.svg, "svg", def.svg, "write the latency chart to this SVG file (\"\" for none)")
	flag.DurationVar(&def.idle, "idle", def.idle, "how long to watch an idle open shm session's CPU use (0 to skip)")
	flag.StringVar(&def.jsonPath, "json", def.jsonPath, "also write the results as JSON to this file (\"-\" for stdout; the table then goes to stderr)")
	flag.DurationVar(&def.minRun, "minrun", def.minRun, "repeat short round trips beyond n until a measurement has taken this long (for accurate CPU times)")
	flag.DurationVar(&def.maxRun, "maxrun", def.maxRun, "stop a measurement's timed round trips after this long")
	flag.DurationVar(&spinTime, "spin", spinTime, "shmipc ConsumerSpinTime on both sides (how long a waiting receiver polls before it sleeps)")
	flag.BoolVar(&connAPI, "conn", false, "use shmipc streams only through their net.Conn methods (Write, io.ReadFull) on both sides, copying every message in and out as over a socket, instead of in place")
	flag.IntVar(&def.hogs, "hogs", def.hogs, "run everything while this many CPU-bound child processes compete for the cores (the contended variant)")
	flag.IntVar(&def.streams, "streams", def.streams, "many-streams mode: this many clients at once, each with its own stream (shm) or connection, for -duration, -rounds times (default sizes 4k, transports shm,uds)")
	flag.DurationVar(&def.duration, "duration", def.duration, "many-streams mode: how long each measurement runs")
	flag.IntVar(&def.rounds, "rounds", def.rounds, "many-streams mode: how often each transport is measured, alternating with the others")
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile of the client process to this file")
	flag.StringVar(&serverProfile, "server-cpuprofile", "", "write a CPU profile of the echo server process to this file")
	quick := flag.Bool("quick", false, "a small run for CI: 2 sizes, 300 round trips, 0.2 s idle; with -streams 0.2 s per measurement, 2 rounds (other flags still apply)")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: pingpong [flags]\n\nMeasures round-trip latency between this process and an echo server child\nover shmipc, a Unix socket and TCP loopback; with -streams, throughput,\nlatency and fairness of many streams at once.\n\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if *cpuProfile != "" {
		stop, err := startProfile(*cpuProfile)
		if err != nil {
			log.Fatal(err)
		}
		defer stop()
	}
	if flag.NArg() > 0 {
		flag.Usage()
		os.Exit(2)
	}

	opts := def
	var err error
	if opts.sizes, err = parseSizes(*sizes); err != nil {
		fail(err)
	}
	if opts.transports, err = parseTransports(*transports); err != nil {
		fail(err)
	}
	set := map[string]bool{}
	flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if opts.streams > 0 {
		opts = streamsOptions(opts, set)
	}
	if *quick {
		opts = quickOptions(opts, set)
	}
	if err := opts.check(); err != nil {
		fail(err)
	}

	// Ctrl-C: stop the server and the hogs, and remove the server's
	// sockets before going.
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		<-sig
		interrupted.Store(true)
		stopChildren()
		os.Exit(130)
	}()

	table := io.Writer(os.Stdout)
	if opts.jsonPath == "-" {
		table = os.Stderr
	}
	if opts.streams > 0 {
		if set["svg"] {
			fmt.Fprintln(table, "pingpong: -svg is ignored with -streams")
		}
		_, err = runStreams(opts, table)
	} else {
		_, err = run(opts, table)
	}
	if err != nil {
		fail(err)
	}
}

// check reports the first option that makes no sense.
func (o options) check() error {
	switch {
	case o.n < 1:
		return fmt.Errorf("-n %d: want at least 1", o.n)
	case o.hogs < 0:
		return fmt.Errorf("-hogs %d: want 0 or more", o.hogs)
	case o.streams < 0:
		return fmt.Errorf("-streams %d: want 0 (single-stream latency) or more", o.streams)
	case o.streams > 0 && o.duration <= 0:
		return fmt.Errorf("-duration %v: want more than 0", o.duration)
	case o.streams > 0 && o.rounds < 1:
		return fmt.Errorf("-rounds %d: want at least 1", o.rounds)
	}
	return nil
}

// childMain runs this process as the echo server or a CPU hog if its first
// argument says so, and reports whether it did.
func childMain() bool {
	if len(os.Args) < 2 {
		return false
	}
	switch os.Args[1] {
	case serveArg:
		serveMain(os.Args[2:])
	case hogArg:
		hogMain()
	default:
		return false
	}
	return true
}

func defaultOptions() options {
	return options{
		sizes:      []int{64, 1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20},
		n:          20000,
		transports: allTransports,
		svg:        "pingpong.svg",
		idle:       2 * time.Second,
		minRun:     time.Second,
		maxRun:     4 * time.Second,
		duration:   2 * time.Second,
		rounds:     5,
	}
}

// quickOptions turns o into the -quick run, except for what the flags in
// set chose explicitly.
func quickOptions(o options, set map[string]bool) options {
	if !set["sizes"] && o.streams == 0 {
		o.sizes = []int{64, 256 << 10} // one small, one large
	}
	if !set["duration"] {
		o.duration = 200 * time.Millisecond
	}
	if !set["rounds"] {
		o.rounds = 2
	}
	if !set["n"] {
		o.n = 300
	}
	if !set["idle"] {
		o.idle = 200 * time.Millisecond
	}
	if !set["minrun"] {
		o.minRun = 20 * time.Millisecond
	}
	if !set["maxrun"] {
		o.maxRun = time.Second
	}
	return o
}

// startProfile starts writing a CPU profile of this process to path.
func startProfile(path string) (stop func(), err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
	}, nil
}

// interrupted is set once Ctrl-C (or SIGTERM) is being handled.
var interrupted atomic.Bool

// fail reports err and exits. During an interrupt the measurement fails
// because the server is being stopped: that is not reported, and the
// interrupt handler exits with 130 once the children are gone.
func fail(err error) {
	if interrupted.Load() {
		select {}
	}
	fmt.Fprintln(os.Stderr, "pingpong:", err)
	os.Exit(1)
}

func parseTransports(s string) ([]string, error) {
	var out []string
	for _, t := range strings.Split(s, ",") {
		t = strings.ToLower(strings.TrimSpace(t))
		if t == "" || slices.Contains(out, t) {
			continue
		}
		if !slices.Contains(allTransports, t) {
			return nil, fmt.Errorf("unknown transport %q: want shm, uds or tcp", t)
		}
		out = append(out, t)
	}
	if len(out) == 0 {
		return nil, errors.New("no transports")
	}
	return out, nil
}

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

// iterations is the number of timed round trips at a message size: n up to
// 4 KiB, then n·√(4 KiB/size) so that large sizes do not take minutes, but
// never fewer than 200 (or n, if smaller).
func iterations(n, size int) int {
	if size <= 4<<10 {
		return n
	}
	k := int(float64(n) * math.Sqrt(float64(4<<10)/float64(size)))
	return max(k, min(n, 200))
}

// pinger does one round trip on an open connection. With verify set it
// changes the payload first and checks that the echo matches.
type pinger interface {
	roundTrip(verify bool) error
}

// measure warms up, then times round trips and the CPU both processes use.
//
// It does n round trips (see iterations), and more if they take less than
// opts.minRun: the kernel brings the CPU time of a thread that keeps
// running on another core up to date only at scheduler ticks (4 ms at
// HZ=250), so reading another process's CPU clock, or one of our threads
// that spins, can be that much behind. Over a second that is under 1 %.
func measure(transport string, size int, p pinger, opts options, serverPID int) (summary, error) {
	n := iterations(opts.n, size)
	warm := min(max(n/10, 20), 2000)
	warmStart := time.Now()
	done := 0
	for ; done < warm && (done < 5 || time.Since(warmStart) < opts.maxRun/4); done++ {
		if err := p.roundTrip(done < 3); err != nil {
			return summary{}, fmt.Errorf("%s warm-up: %w", fmtSize(size), err)
		}
	}
	// Room for n round trips, or for as many as fit in 1.5·minRun at the
	// warm-up's pace, up to 4 million (32 MB of samples).
	perOp := time.Since(warmStart) / time.Duration(done)
	room := n
	if perOp > 0 && opts.minRun > 0 {
		room = max(n, min(int(opts.minRun*3/2/perOp), 4<<20))
	}
	lat := make([]time.Duration, room)
	runtime.GC() // not during the timed loop, which allocates nothing
	c0, s0, w0 := selfCPU(), procCPU(serverPID), wakeupsOf(p)
	start := time.Now()
	i := 0
	for i < room {
		t := time.Now()
		if err := p.roundTrip(false); err != nil {
			return summary{}, fmt.Errorf("%s round trip %d: %w", fmtSize(size), i, err)
		}
		lat[i] = time.Since(t)
		i++
		if elapsed := t.Sub(start); elapsed > opts.maxRun || i >= n && elapsed >= opts.minRun {
			break
		}
	}
	c1, s1, w1 := selfCPU(), procCPU(serverPID), wakeupsOf(p)
	if err := p.roundTrip(true); err != nil {
		return summary{}, fmt.Errorf("%s after timing: %w", fmtSize(size), err)
	}
	s := summarize(transport, size, lat[:i], c1-c0, s1-s0)
	s.Wakeups = perRoundTrip(w0, w1, i)
	return s, nil
}

// newPayload returns size bytes of a pattern that differs per size.
func newPayload(size int) []byte {
	p := make([]byte, size)
	for i := range p {
		p[i] = byte(i*131 + size)
	}
	return p
}

// bump changes the payload's first and last byte, so that a verified round
// trip cannot pass on a stale echo.
func bump(p []byte) {
	p[0]++
	p[len(p)-1]--
}

var errMismatch = errors.New("the echo differs from what was sent")

// sizeHeader is the 4-byte big-endian message size that starts a connection.
func sizeHeader(size int) []byte {
	return binary.BigEndian.AppendUint32(nil, uint32(size))
}

// ---- shm -------------------------------------------------------------------

// sliceChunk is the data capacity of the largest slice of a configuration.
// A message that fits in one slice is written into one slice and arrives as
// one contiguous piece. A larger one is written slice by slice, largest
// slices first (WriteBytes does that), so a reader that reads it in chunks
// of this size gets every chunk in place from ReadBytes, without a copy.
func sliceChunk(conf *shmipc.Config) int {
	m := uint32(0)
	for _, p := range conf.BufferSliceSizes {
		m = max(m, p.Size)
	}
	return int(m)
}

type shmPinger struct {
	sess    *shmipc.Session
	st      *shmipc.Stream
	payload []byte
	chunk   int
	conn    *connPinger // with -conn: the stream used as a net.Conn
}

// wakeups is how many Polling frames the pinger's session has sent and
// received.
func (p *shmPinger) wakeups() int64 { return sessionWakeups(p.sess) }

func sessionWakeups(sess *shmipc.Session) int64 {
	st := sess.Stats()
	return int64(st.WakeupsSent + st.WakeupsReceived)
}

// wakeupsOf is p's wake-up count, or -1 for a transport without them.
func wakeupsOf(p pinger) int64 {
	if w, ok := p.(interface{ wakeups() int64 }); ok {
		return w.wakeups()
	}
	return -1
}

// perRoundTrip is the wake-ups between counts w0 and w1 per round trip, or
// nil for a transport without them.
func perRoundTrip(w0, w1 int64, n int) *float64 {
	if w0 < 0 {
		return nil
	}
	v := float64(w1-w0) / float64(n)
	return &v
}

// fmtWakeups formats a wake-up rate, "-" for a transport without them.
func fmtWakeups(w *float64) string {
	if w == nil {
		return "-"
	}
	return fmt.Sprintf("%.3f", *w)
}

// roundTrip sends the payload through shared memory and reads the echo in
// place.
//
// The payload exists before the call, as it does for the socket transports,
// so the client appends it with WriteBytes, which is what a user holding a
// ready buffer would do: one copy into as few shared-memory slices as
// possible. (A user serialising a message would Reserve the space and write
// into it instead; for a message that fits one slice that is the same
// copy. A single Reserve larger than the largest slice — 128 KiB − 20 bytes
// in the reference layout — gets private memory and makes the stream send
// everything over the socket from then on, so such a user would reserve in
// chunks of at most sliceChunk bytes.) The echo is not copied out: ReadBytes
// returns it in shared memory, and ReleasePreviousRead hands it back.
func (p *shmPinger) roundTrip(verify bool) error {
	if p.conn != nil {
		return p.conn.roundTrip(verify) // -conn: as over a socket
	}
	if verify {
		bump(p.payload)
	}
	if _, err := p.st.BufferWriter().WriteBytes(p.payload); err != nil {
		return err
	}
	if err := p.st.Flush(false); err != nil {
		return err
	}
	r := p.st.BufferReader()
	for off := 0; off < len(p.payload); {
		c := min(p.chunk, len(p.payload)-off)
		b, err := r.ReadBytes(c) // points into shared memory
		if err != nil {
			return err
		}
		if verify && !bytes.Equal(b, p.payload[off:off+c]) {
			return errMismatch
		}
		off += c
	}
	p.st.BufferReader().ReleasePreviousRead() // hand the echo's slices back to the server
	return nil
}

// openShm opens a stream on sess and announces the message size.
func openShm(sess *shmipc.Session, conf *shmipc.Config, size int) (*shmPinger, error) {
	st, err := sess.OpenStream()
	if err != nil {
		return nil, err
	}
	_, err = st.BufferWriter().WriteBytes(sizeHeader(size))
	if err == nil {
		err = st.Flush(false)
	}
	if err != nil {
		st.Close()
		return nil, err
	}
	p := &shmPinger{sess: sess, st: st, payload: newPayload(size), chunk: sliceChunk(conf)}
	if connAPI {
		p.conn = &connPinger{c: st, payload: p.payload, buf: make([]byte, size)}
	}
	return p, nil
}

// Close closes the stream.
func (p *shmPinger) Close() error { return p.st.Close() }

// runShm measures every size on one session, a stream per size, then
// watches the session sit idle.
func runShm(opts options, srv *server, emit func(summary)) (*idleResult, error) {
	conf := shmConfig()
	sess, err := shmipc.Dial("unix", srv.shmSock, conf)
	if err != nil {
		return nil, err
	}
	defer sess.Close()
	for _, size := range opts.sizes {
		p, err := openShm(sess, conf, size)
		if err != nil {
			return nil, err
		}
		s, err := measure("shm", size, p, opts, srv.pid())
		p.st.Close()
		if err != nil {
			return nil, err
		}
		emit(s)
	}
	if opts.idle <= 0 {
		return nil, nil
	}
	// An open session with an open stream that has just been used, then
	// nothing: what does it cost to keep it?
	p, err := openShm(sess, conf, 64)
	if err != nil {
		return nil, err
	}
	defer p.st.Close()
	if err := p.roundTrip(true); err != nil {
		return nil, err
	}
	time.Sleep(50 * time.Millisecond) // let both sides settle into waiting
	c0, s0, t0 := selfCPU(), procCPU(srv.pid()), time.Now()
	time.Sleep(opts.idle)
	c1, s1, wall := selfCPU(), procCPU(srv.pid()), time.Since(t0)
	if err := p.roundTrip(true); err != nil { // still working after the pause?
		return nil, fmt.Errorf("after idling: %w", err)
	}
	pct := func(d time.Duration) float64 { return 100 * d.Seconds() / wall.Seconds() }
	return &idleResult{Seconds: wall.Seconds(), ClientPct: pct(c1 - c0), ServerPct: pct(s1 - s0)}, nil
}

// ---- uds, tcp ----------------------------------------------------------------

type connPinger struct {
	c       net.Conn
	payload []byte
	buf     []byte
}

// roundTrip writes the payload and reads the echo into a reused buffer.
func (p *connPinger) roundTrip(verify bool) error {
	if verify {
		bump(p.payload)
	}
	if _, err := p.c.Write(p.payload); err != nil {
		return err
	}
	if _, err := io.ReadFull(p.c, p.buf); err != nil {
		return err
	}
	if verify && !bytes.Equal(p.buf, p.payload) {
		return errMismatch
	}
	return nil
}

// openConn connects to addr and announces the message size.
func openConn(network, addr string, size int) (*connPinger, error) {
	c, err := net.Dial(network, addr) // TCP_NODELAY is Go's default
	if err != nil {
		return nil, err
	}
	if _, err := c.Write(sizeHeader(size)); err != nil {
		c.Close()
		return nil, err
	}
	return &connPinger{c: c, payload: newPayload(size), buf: make([]byte, size)}, nil
}

// Close closes the connection.
func (p *connPinger) Close() error { return p.c.Close() }

// runConn measures every size over a plain socket, a connection per size.
func runConn(opts options, srv *server, network, addr, name string, emit func(summary)) error {
	for _, size := range opts.sizes {
		p, err := openConn(network, addr, size)
		if err != nil {
			return err
		}
		s, err := measure(name, size, p, opts, srv.pid())
		p.Close()
		if err != nil {
			return err
		}
		emit(s)
	}
	return nil
}

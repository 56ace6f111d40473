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
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/signal"
	"runtime/pprof"
	"strings"
	"sync/atomic"
	"syscall"

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

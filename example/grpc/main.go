// Command grpc runs gRPC over shmipc between two processes: a demo, and a
// benchmark against gRPC over a Unix socket and over TCP loopback.
//
//	go run . -demo          # server process + client: unary, streaming, deadline
//	go run . -bench         # the full benchmark table (about two minutes)
//	go run . -bench -quick  # a short run, so that the benchmark cannot rot
//
// The server is this program started again as a second process.
package main

import (
	"flag"
	"fmt"
	"os"
	"runtime/pprof"
	"strings"
	"time"
)

func main() {
	if code, ran := runChildRole(); ran {
		os.Exit(code)
	}
	demoMode := flag.Bool("demo", false, "run the demo: a server process and a client")
	benchMode := flag.Bool("bench", false, "run the benchmark")
	quick := flag.Bool("quick", false, "with -bench: a short run")
	sizes := flag.String("sizes", "", "with -bench: unary payload sizes, such as 64,64k,1m")
	opts := flag.String("opts", "", "with -bench: option sets, such as default,tuned")
	block := flag.Duration("block", 0, "with -bench: length of one measured block")
	rounds := flag.Int("rounds", 0, "with -bench: blocks per transport and size")
	spin := flag.Duration("spin", -1, "with -bench: shmipc's ConsumerSpinTime on both sides (default: shmipc's default)")
	transports := flag.String("transports", "", "with -bench: transports to measure, such as shmipc,uds,in-process (default: all)")
	streams := flag.String("stream", "", "with -bench: message sizes of the streaming benchmark, or none")
	cpuprofile := flag.String("cpuprofile", "", "with -bench: write CPU profiles of the client and the server to FILE.client and FILE.server")
	flag.Parse()

	var err error
	switch {
	case *benchMode:
		cfg := fullBench()
		if *quick {
			cfg = quickBench()
		}
		if *sizes != "" {
			if cfg.sizes, err = parseSizes(*sizes); err != nil {
				break
			}
		}
		if *opts != "" {
			cfg.options = strings.Split(*opts, ",")
		}
		if *block > 0 {
			cfg.block = *block
		}
		if *rounds > 0 {
			cfg.rounds = *rounds
		}
		if *transports != "" {
			cfg.transports, cfg.inProc = []string{}, false
			for _, tr := range strings.Split(*transports, ",") {
				if tr == transportInProc {
					cfg.inProc = true
				} else {
					cfg.transports = append(cfg.transports, tr)
				}
			}
		}
		if *streams == "none" {
			cfg.streamSizes = nil
		} else if *streams != "" {
			if cfg.streamSizes, err = parseSizes(*streams); err != nil {
				break
			}
		}
		if *spin >= 0 {
			os.Setenv(spinEnv, spin.String())
		}
		if *cpuprofile != "" {
			var stop func()
			if stop, err = startCPUProfile(*cpuprofile + ".client"); err != nil {
				break
			}
			defer stop()
			os.Setenv(profileEnv, *cpuprofile+".server")
		}
		start := time.Now()
		err = runBench(cfg, os.Stdout)
		fmt.Printf("\n(%v)\n", time.Since(start).Round(time.Second))
	case *demoMode:
		err = demo(os.Stdout)
	default:
		flag.Usage()
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}

// profileEnv, when set, is where the server process writes its CPU profile
// (the benchmark's -cpuprofile flag; the server process inherits it).
const profileEnv = "SHMIPC_GRPC_EXAMPLE_CPUPROFILE"

// startCPUProfile writes a CPU profile to path until stop is called.
func startCPUProfile(path string) (stop func(), err error) {
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

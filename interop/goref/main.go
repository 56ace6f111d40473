// Command goref is an echo server and client built on CloudWeGo's Go
// implementation of Shmipc (github.com/cloudwego/shmipc-go), for the
// interoperability tests of this module. It follows the echo contract of
// the Shmipc conformance kit.
//
//	goref -server -addr unix:/tmp/s.sock       # or tcp:127.0.0.1:PORT
//	goref -client -addr unix:/tmp/s.sock -mode memfd -prefix /dev/shm/x -cell sizes
//
// The server prints "listening" once it accepts connections, and one line
// per stream that ends (cells.End). The client runs one cell, prints
// "PASS cell" or "FAIL cell: reason" (and, for closeorder, the Sent line
// the server must report) and exits 0 only if the cell passed. The cells
// that force fallback data, and traffic, give the client a 1 MiB region.
//
// Run the client with SHMIPC_DEBUG_MODE set: otherwise shmipc-go refuses to
// open streams for 30 s after a session carried fallback data.
package main

import (
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"strings"
	"time"

	shmipc "github.com/cloudwego/shmipc-go"

	"github.com/goshm/shmipc/interop/internal/cells"
)

func main() {
	server := flag.Bool("server", false, "serve echo streams until killed")
	client := flag.Bool("client", false, "run one cell against a server")
	addr := flag.String("addr", "", "unix:/path.sock or tcp:host:port")
	mode := flag.String("mode", "memfd", "client mapping mode: memfd or file")
	prefix := flag.String("prefix", "/dev/shm/shmipc", "client shared-memory path prefix")
	cell := flag.String("cell", "", "sizes, concurrent, sessions, sequential, closeorder, soak or traffic")
	duration := flag.Duration("duration", 20*time.Second, "length of the soak cell")
	flag.Parse()

	network, address, ok := strings.Cut(*addr, ":")
	if !ok || (network != "unix" && network != "tcp") || *server == *client {
		fmt.Fprintln(os.Stderr, "usage: goref -server|-client -addr unix:PATH|tcp:HOST:PORT [-mode memfd|file -prefix P -cell NAME]")
		os.Exit(2)
	}
	if *server {
		log.Fatal(serve(network, address))
	}
	if err := runCell(*cell, network, address, *mode, *prefix, *duration); err != nil {
		fmt.Printf("FAIL %s: %v\n", *cell, err)
		os.Exit(1)
	}
	fmt.Printf("PASS %s\n", *cell)
}

func isEOF(err error) bool { return errors.Is(err, shmipc.ErrEndOfStream) }

// serve accepts connections and makes each a shmipc-go server session.
func serve(network, address string) error {
	if network == "unix" {
		os.Remove(address) // the socket of a server that was killed
	}
	ln, err := net.Listen(network, address)
	if err != nil {
		return err
	}
	fmt.Println("listening", ln.Addr())
	for {
		conn, err := ln.Accept()
		if err != nil {
			return err
		}
		go func() {
			sess, err := shmipc.Server(conn, shmipc.DefaultConfig())
			if err != nil {
				fmt.Println("handshake failed:", err)
				conn.Close()
				return
			}
			defer sess.Close()
			for {
				st, err := sess.AcceptStream()
				if err != nil {
					return
				}
				go func() { fmt.Println(cells.Echo(st, isEOF)) }()
			}
		}()
	}
}

// runCell dials the server with a session manager of shmipc-go and runs
// the cell.
func runCell(cell, network, address, mode, prefix string, duration time.Duration) error {
	conf := shmipc.DefaultSessionManagerConfig()
	conf.Network, conf.Address = network, address
	conf.ShareMemoryPathPrefix = prefix
	conf.QueuePath = prefix + "_queue"
	conf.SessionNum = 1
	switch mode {
	case "memfd":
		conf.MemMapType = shmipc.MemMapTypeMemFd
	case "file":
		conf.MemMapType = shmipc.MemMapTypeDevShmFile
	default:
		return fmt.Errorf("unknown mode %q", mode)
	}
	switch cell {
	case "closeorder", "soak", "traffic":
		conf.ShareMemoryBufferCap = 1 << 20
	case "sessions":
		conf.SessionNum = 4
	}
	sm, err := shmipc.NewSessionManager(conf)
	if err != nil {
		return fmt.Errorf("session manager: %w", err)
	}
	defer sm.Close()
	lib := cells.Lib{
		Open: func() (cells.Stream, error) {
			st, err := sm.GetStream()
			if err != nil {
				return nil, err
			}
			return st, nil
		},
		IsEOF: isEOF,
	}
	switch cell {
	case "sizes":
		return cells.Sizes(lib, cells.DefaultSizes)
	case "concurrent":
		return cells.Concurrent(lib, 16, 20)
	case "sessions":
		return cells.Concurrent(lib, 64, 5)
	case "sequential":
		return cells.Sequential(lib, 1000)
	case "closeorder":
		if err := cells.CloseAfterFallback(lib); err != nil {
			return err
		}
		sent, err := cells.CloseAfterSend(lib)
		if err != nil {
			return err
		}
		fmt.Println("sent", sent)
		return nil
	case "soak", "traffic":
		if cell == "traffic" {
			duration = time.Hour // until killed
		}
		var counts cells.SoakCounts
		err := cells.Soak(lib, 4, cells.StopAfter(duration), &counts)
		fmt.Printf("soak: %d streams, %d round trips\n", counts.Streams.Load(), counts.RoundTrips.Load())
		return err
	}
	return fmt.Errorf("unknown cell %q", cell)
}

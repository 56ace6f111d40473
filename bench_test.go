package shmipc

import (
	"errors"
	"flag"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// The ping-pong benchmarks: a client sends size bytes on a stream (shm) or
// a Unix socket connection (uds) and a server goroutine echoes them. Both
// sides run in this process; the bytes still cross shared memory or the
// kernel exactly as between two processes (example/pingpong measures that).
//
// BenchmarkPingPong/streams=S/size=Z/transport=T runs exactly S client
// goroutines, each with its own stream or connection, that together do b.N
// round trips, so ns/op is wall time per round trip of the whole group.
// Besides ns/op, B/op and allocs/op it reports slowest/fastest: the round
// trips of the goroutine that did fewest divided by those of the one that
// did most (1 is perfectly fair); and for shm wakeups/op: Polling frames
// sent either way per round trip (0 when the receivers' spinning catches
// every message, 2 when each side sleeps before each message). Compare the transports with
//
//	benchstat -col /transport bench.txt
//
// BenchmarkPingPongConn is the same through the net.Conn methods alone,
// as code written for any connection uses a stream: Write, and io.ReadFull
// into the caller's buffer, on both sides (transport=shm-conn), against the
// same code on a Unix socket. Each message is then copied four times per
// round trip over either transport, where BenchmarkPingPong's shm clients
// and server copy once (Reserve, ReadBytes).
//
// BenchmarkParallelPingPong{ByShmipc,ByUds}{64B…4MB} are the older form:
// b.RunParallel, GOMAXPROCS goroutines.
//
// -hogs N (go test -run XXX -bench PingPong . -hogs 2) runs every benchmark
// while N CPU-bound processes compete for the cores: children of the test
// binary that spin until the benchmark ends.

var (
	benchHogs = flag.Int("hogs", 0, "run the ping-pong benchmarks while this many CPU-bound processes compete for the cores")
)

// pingPongSizes are the message sizes of the ping-pong benchmarks.
var pingPongSizes = []struct {
	name string
	size int
}{
	{"64B", 64}, {"512B", 512}, {"1KB", 1 << 10}, {"4KB", 4 << 10}, {"16KB", 16 << 10},
	{"32KB", 32 << 10}, {"64KB", 64 << 10}, {"256KB", 256 << 10}, {"512KB", 512 << 10},
	{"1MB", 1 << 20}, {"4MB", 4 << 20},
}

// pingPongStreams are the client counts of BenchmarkPingPong.
var pingPongStreams = []int{1, 8, 64}

func BenchmarkPingPong(b *testing.B) {
	startBenchHogs(b, *benchHogs)
	for _, streams := range pingPongStreams {
		for _, sz := range pingPongSizes {
			for _, tr := range benchTransports {
				name := fmt.Sprintf("streams=%d/size=%s/transport=%s", streams, sz.name, tr.name)
				b.Run(name, func(b *testing.B) { benchmarkStreams(b, tr, streams, sz.size) })
			}
		}
	}
}

func BenchmarkParallelPingPongByShmipc64B(b *testing.B)  { benchmarkParallel(b, shmTransport, 64) }
func BenchmarkParallelPingPongByShmipc512B(b *testing.B) { benchmarkParallel(b, shmTransport, 512) }
func BenchmarkParallelPingPongByShmipc1KB(b *testing.B)  { benchmarkParallel(b, shmTransport, 1<<10) }
func BenchmarkParallelPingPongByShmipc4KB(b *testing.B)  { benchmarkParallel(b, shmTransport, 4<<10) }
func BenchmarkParallelPingPongByShmipc16KB(b *testing.B) { benchmarkParallel(b, shmTransport, 16<<10) }
func BenchmarkParallelPingPongByShmipc32KB(b *testing.B) { benchmarkParallel(b, shmTransport, 32<<10) }
func BenchmarkParallelPingPongByShmipc64KB(b *testing.B) { benchmarkParallel(b, shmTransport, 64<<10) }
func BenchmarkParallelPingPongByShmipc256KB(b *testing.B) {
	benchmarkParallel(b, shmTransport, 256<<10)
}
func BenchmarkParallelPingPongByShmipc512KB(b *testing.B) {
	benchmarkParallel(b, shmTransport, 512<<10)
}
func BenchmarkParallelPingPongByShmipc1MB(b *testing.B) { benchmarkParallel(b, shmTransport, 1<<20) }
func BenchmarkParallelPingPongByShmipc4MB(b *testing.B) { benchmarkParallel(b, shmTransport, 4<<20) }

func BenchmarkParallelPingPongByUds64B(b *testing.B)   { benchmarkParallel(b, udsTransport, 64) }
func BenchmarkParallelPingPongByUds512B(b *testing.B)  { benchmarkParallel(b, udsTransport, 512) }
func BenchmarkParallelPingPongByUds1KB(b *testing.B)   { benchmarkParallel(b, udsTransport, 1<<10) }
func BenchmarkParallelPingPongByUds4KB(b *testing.B)   { benchmarkParallel(b, udsTransport, 4<<10) }
func BenchmarkParallelPingPongByUds16KB(b *testing.B)  { benchmarkParallel(b, udsTransport, 16<<10) }
func BenchmarkParallelPingPongByUds32KB(b *testing.B)  { benchmarkParallel(b, udsTransport, 32<<10) }
func BenchmarkParallelPingPongByUds64KB(b *testing.B)  { benchmarkParallel(b, udsTransport, 64<<10) }
func BenchmarkParallelPingPongByUds256KB(b *testing.B) { benchmarkParallel(b, udsTransport, 256<<10) }
func BenchmarkParallelPingPongByUds512KB(b *testing.B) { benchmarkParallel(b, udsTransport, 512<<10) }
func BenchmarkParallelPingPongByUds1MB(b *testing.B)   { benchmarkParallel(b, udsTransport, 1<<20) }
func BenchmarkParallelPingPongByUds4MB(b *testing.B)   { benchmarkParallel(b, udsTransport, 4<<20) }

// benchmarkStreams runs b.N round trips of size bytes on streams clients
// at once.
func benchmarkStreams(b *testing.B, tr benchTransport, streams, size int) {
	srv := tr.serve(b, size)
	clients := make([]pingClient, streams)
	for i := range clients {
		c, err := srv.connect()
		if err != nil {
			b.Fatal(err)
		}
		defer c.Close()
		// One checked round trip each, untimed: it opens the stream on the
		// server side and commits the memory it uses.
		if err := c.roundTrip(); err != nil {
			b.Fatal(err)
		}
		clients[i] = c
	}

	// The clients take their round trips from a shared count in grains,
	// as b.RunParallel hands out iterations: an atomic add on a line both
	// processors write, for every round trip, cost 2 % of the CPU profile
	// of 8 streams of 64 B over shared memory, and is no transport's cost.
	// A grain is at most a 64th of a client's share, so that the counts
	// that measure fairness stay fine-grained.
	grain := max(1, min(16, int64(b.N)/int64(64*streams)))
	var (
		issued atomic.Int64 // round trips taken by the clients so far
		start  = make(chan struct{})
		done   sync.WaitGroup
		counts = make([]int, streams) // round trips per client
		total  = int64(b.N)
	)
	for i, c := range clients {
		done.Add(1)
		go func() {
			defer done.Done()
			<-start
			n := 0
		take:
			for {
				end := issued.Add(grain)
				first := end - grain
				if first >= total {
					break
				}
				for k := min(end, total) - first; k > 0; k-- {
					if err := c.roundTrip(); err != nil {
						b.Error(err)
						break take
					}
					n++
				}
			}
			counts[i] = n
		}()
	}
	b.SetBytes(2 * int64(size))
	b.ReportAllocs()
	wakeups := srv.wakeups()
	b.ResetTimer()
	close(start)
	done.Wait()
	b.StopTimer()
	b.ReportMetric(slowestFastest(counts), "slowest/fastest")
	if wakeups >= 0 {
		b.ReportMetric(float64(srv.wakeups()-wakeups)/float64(b.N), "wakeups/op")
	}
}

// slowestFastest is the smallest count divided by the largest.
func slowestFastest(counts []int) float64 {
	lo, hi := counts[0], counts[0]
	for _, n := range counts {
		lo, hi = min(lo, n), max(hi, n)
	}
	if hi == 0 {
		return 0
	}
	return float64(lo) / float64(hi)
}

// BenchmarkPausedPingPong: one client does round trips of 64 B with a pause
// of pause between them, like a request now and then rather than a stream
// of them, so each one finds the other side's spinners stopped. ns/op is
// the round trip alone (the pause is not timed).
func BenchmarkPausedPingPong(b *testing.B) {
	startBenchHogs(b, *benchHogs)
	const pause = time.Millisecond
	for _, tr := range benchTransports {
		b.Run("transport="+tr.name, func(b *testing.B) {
			srv := tr.serve(b, 64)
			c, err := srv.connect()
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				if err := c.roundTrip(); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				time.Sleep(pause)
				b.StartTimer()
			}
		})
	}
}

// benchmarkParallel runs the round trips with b.RunParallel, a client per
// goroutine.
func benchmarkParallel(b *testing.B, tr benchTransport, size int) {
	startBenchHogs(b, *benchHogs)
	srv := tr.serve(b, size)
	b.SetBytes(2 * int64(size))
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		c, err := srv.connect()
		if err != nil {
			b.Error(err)
			return
		}
		defer c.Close()
		for pb.Next() {
			if err := c.roundTrip(); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.StopTimer()
}

// pingClient is one client of an echo server.
type pingClient interface {
	// roundTrip sends a message and waits for its echo, checking its first
	// and last byte.
	roundTrip() error
	Close() error
}

// benchTransport starts echo servers of one kind.
type benchTransport struct {
	name string
	// serve starts an echo server for size-byte messages that stops at the
	// end of the benchmark.
	serve func(b *testing.B, size int) benchServer
}

// benchServer is an echo server of a benchmark.
type benchServer struct {
	// connect connects a new client.
	connect func() (pingClient, error)
	// wakeups counts the Polling frames the clients' session has sent and
	// received so far; -1 for transports without them.
	wakeups func() int64
}

var (
	shmTransport     = benchTransport{"shm", serveShm}
	udsTransport     = benchTransport{"uds", serveUds}
	shmConnTransport = benchTransport{"shm-conn", serveShmConn}
	benchTransports  = []benchTransport{shmTransport, udsTransport}
)

func BenchmarkPingPongConn(b *testing.B) {
	startBenchHogs(b, *benchHogs)
	for _, streams := range pingPongStreams {
		for _, sz := range pingPongSizes {
			for _, tr := range []benchTransport{shmConnTransport, udsTransport} {
				name := fmt.Sprintf("streams=%d/size=%s/transport=%s", streams, sz.name, tr.name)
				b.Run(name, func(b *testing.B) { benchmarkStreams(b, tr, streams, sz.size) })
			}
		}
	}
}

var errEchoDiffers = errors.New("the echo differs from the message")

// serveEach runs serve on every connection ln accepts until ln is closed.
// The returned function, called once ln is closed, waits for the accept
// loop and the servers to finish.
func serveEach(ln net.Listener, serve func(net.Conn)) (wait func()) {
	var servers sync.WaitGroup
	servers.Add(1) // the accept loop, so that Add below never races with Wait from 0
	go func() {
		defer servers.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			servers.Add(1)
			go func() {
				defer servers.Done()
				serve(c)
			}()
		}
	}()
	return servers.Wait
}

// BenchmarkPingPongSessions: 8 and 64 clients in one process whose streams
// come from a SessionManager with SessionNum 1, 2 or 8 (spread round-robin
// over its sessions), against a Unix socket in the same run. With one
// session the streams of both processors write the same session's lines
// (its IO queue, stream table) for every message; with
// more, each session's exchanges mostly stay on one processor. Between
// two processes the opposite holds (more sessions, more receive loops and
// more polling for the same messages; example/pingpong), so SessionNum's
// default stays 1.
func BenchmarkPingPongSessions(b *testing.B) {
	startBenchHogs(b, *benchHogs)
	for _, streams := range []int{8, 64} {
		for _, sz := range pingPongSizes {
			if sz.size != 64 && sz.size != 4<<10 {
				continue
			}
			for _, n := range []int{1, 2, 8} {
				tr := benchTransport{fmt.Sprintf("shm-sessions=%d", n), func(b *testing.B, size int) benchServer {
					return serveShmManager(b, size, n)
				}}
				b.Run(fmt.Sprintf("streams=%d/size=%s/transport=%s", streams, sz.name, tr.name), func(b *testing.B) {
					benchmarkStreams(b, tr, streams, sz.size)
				})
			}
			b.Run(fmt.Sprintf("streams=%d/size=%s/transport=uds", streams, sz.name), func(b *testing.B) {
				benchmarkStreams(b, udsTransport, streams, sz.size)
			})
		}
	}
}

// serveShmManager is serveShm with the clients' streams taken from a
// SessionManager of sessions sessions.
func serveShmManager(b *testing.B, size, sessions int) benchServer {
	return serveShmWith(b, size, func(sock string, conf *Config) (shmClients, error) {
		m, err := NewSessionManager(SessionManagerConfig{Config: conf, Network: "unix", Address: sock, SessionNum: sessions})
		if err != nil {
			return shmClients{}, err
		}
		return shmClients{open: m.GetStream, sessions: m.Sessions, close: func() { m.Close() }}, nil
	})
}

package shmipc

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
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

// ---- shm ---------------------------------------------------------------------

// serveShm listens for shmipc sessions and echoes on their streams. All
// clients share one session, a stream each.
func serveShm(b *testing.B, size int) benchServer {
	return serveShmWith(b, size, dialShmClients)
}

// serveShmConn is serveShm with both sides using only the streams'
// net.Conn methods (connEcho, connClient).
func serveShmConn(b *testing.B, size int) benchServer {
	return serveShmWithEcho(b, size, dialShmClients,
		func(c net.Conn) { connEcho(c, size) },
		func(st *Stream) pingClient { return newConnClient(st, size) })
}

// dialShmClients dials one session for all clients.
func dialShmClients(sock string, conf *Config) (shmClients, error) {
	sess, err := Dial("unix", sock, conf)
	if err != nil {
		return shmClients{}, err
	}
	return shmClients{
		open:     sess.OpenStream,
		sessions: func() []*Session { return []*Session{sess} },
		close:    func() { sess.Close() },
	}, nil
}

// shmClients is the client side of a shm benchmark: how a client opens its
// stream, the sessions whose wake-ups are counted, and how they end.
type shmClients struct {
	open     func() (*Stream, error)
	sessions func() []*Session
	close    func()
}

// serveShmWith listens for shmipc sessions that echo size-byte messages on
// their streams, and sets up the clients' side with dial.
func serveShmWith(b *testing.B, size int, dial func(sock string, conf *Config) (shmClients, error)) benchServer {
	return serveShmWithEcho(b, size, dial,
		func(c net.Conn) { shmEchoServer(c.(*Stream), size) },
		func(st *Stream) pingClient { return &shmClient{st: st, size: size} })
}

// serveShmWithEcho is serveShmWith with echo serving each stream and
// client making the client of each stream opened.
func serveShmWithEcho(b *testing.B, size int, dial func(sock string, conf *Config) (shmClients, error), echo func(net.Conn), client func(*Stream) pingClient) benchServer {
	sock := sockPath(b)
	conf := DefaultConfig()
	ln, err := Listen("unix", sock, conf)
	if err != nil {
		b.Fatal(err)
	}
	wait := serveEach(ln, echo)
	clients, err := dial(sock, conf)
	if err != nil {
		ln.Close()
		b.Fatal(err)
	}
	b.Cleanup(func() {
		clients.close()
		ln.Close()
		wait()
	})
	connect := func() (pingClient, error) {
		st, err := clients.open()
		if err != nil {
			return nil, err
		}
		return client(st), nil
	}
	wakeups := func() int64 {
		var n int64
		for _, s := range clients.sessions() {
			st := s.Stats()
			n += int64(st.WakeupsSent + st.WakeupsReceived)
		}
		return n
	}
	return benchServer{connect, wakeups}
}

// shmEchoServer echoes size-byte messages: it reads each in place and
// appends it to the reply with WriteBytes, the one copy an echo makes. (A
// Reserve and the runtime's copy would be the same copy up to 1 MiB; from
// there it writes around the caches, and 8 streams of 1 MiB took 1.7 times
// as long per round trip.)
func shmEchoServer(st *Stream, size int) {
	defer st.Close()
	w, r := st.BufferWriter(), st.BufferReader()
	for {
		req, err := r.ReadBytes(size)
		if err != nil {
			return
		}
		if _, err := w.WriteBytes(req); err != nil {
			return
		}
		st.BufferReader().ReleasePreviousRead()
		if err := st.Flush(false); err != nil {
			return
		}
	}
}

// shmClient serialises its message straight into shared memory (Reserve)
// and reads the echo in place (ReadBytes).
type shmClient struct {
	st   *Stream
	size int
}

func (c *shmClient) roundTrip() error {
	p, err := c.st.BufferWriter().Reserve(c.size)
	if err != nil {
		return err
	}
	p[0], p[c.size-1] = 1, 2
	if err := c.st.Flush(false); err != nil {
		return err
	}
	reply, err := c.st.BufferReader().ReadBytes(c.size)
	if err != nil {
		return err
	}
	if reply[0] != 1 || reply[c.size-1] != 2 {
		return errEchoDiffers
	}
	c.st.BufferReader().ReleasePreviousRead()
	return nil
}

func (c *shmClient) Close() error { return c.st.Close() }

// ---- uds ---------------------------------------------------------------------

// serveUds listens on a Unix socket and echoes on every connection; each
// client has its own connection.
func serveUds(b *testing.B, size int) benchServer {
	sock := sockPath(b)
	ln, err := net.Listen("unix", sock)
	if err != nil {
		b.Fatal(err)
	}
	wait := serveEach(ln, func(c net.Conn) { connEcho(c, size) })
	var (
		mu      sync.Mutex
		clients []net.Conn
	)
	b.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range clients {
			c.Close() // ends its server; closing twice is harmless
		}
		mu.Unlock()
		wait()
	})
	connect := func() (pingClient, error) {
		c, err := net.Dial("unix", sock)
		if err != nil {
			return nil, err
		}
		mu.Lock()
		clients = append(clients, c)
		mu.Unlock()
		return newConnClient(c, size), nil
	}
	return benchServer{connect, func() int64 { return -1 }}
}

// connEcho echoes size-byte messages on c through its net.Conn methods
// alone.
func connEcho(c net.Conn, size int) {
	defer c.Close()
	buf := make([]byte, size)
	for {
		if _, err := io.ReadFull(c, buf); err != nil {
			return
		}
		if _, err := c.Write(buf); err != nil {
			return
		}
	}
}

// connClient writes its message from its own buffer and reads the echo into
// another (into and out of the kernel on a socket).
type connClient struct {
	c       net.Conn
	out, in []byte
}

func newConnClient(c net.Conn, size int) *connClient {
	return &connClient{c: c, out: make([]byte, size), in: make([]byte, size)}
}

func (c *connClient) roundTrip() error {
	n := len(c.out)
	c.out[0], c.out[n-1] = 1, 2
	if _, err := c.c.Write(c.out); err != nil {
		return err
	}
	if _, err := io.ReadFull(c.c, c.in); err != nil {
		return err
	}
	if c.in[0] != 1 || c.in[n-1] != 2 {
		return errEchoDiffers
	}
	return nil
}

func (c *connClient) Close() error { return c.c.Close() }

// ---- CPU hogs ----------------------------------------------------------------

// benchHogRole is the proctest role of a CPU hog child.
const benchHogRole = "cpu-hog"

// startBenchHogs starts n CPU hogs, child processes that spin on one core
// each, and stops them when b ends.
func startBenchHogs(b *testing.B, n int) {
	for range n {
		c, _ := startChild(b, proctest.Config{
			TestName: "TestBenchHogChild",
			Role:     benchHogRole,
			Timeout:  24 * time.Hour, // a full benchmark run takes long; Stop and the parent's death end it
		})
		b.Cleanup(func() {
			if err := c.Stop(10 * time.Second); err != nil {
				b.Errorf("CPU hog: %v\n%s", err, c.Output())
			}
		})
	}
}

// TestBenchHogChild is the CPU hog of the contended benchmarks: started by
// startBenchHogs, it spins until its stdin closes.
func TestBenchHogChild(t *testing.T) {
	if proctest.Role() != benchHogRole {
		t.Skip("helper process: a CPU hog for the ping-pong benchmarks run with -hogs")
	}
	stop := proctest.StdinClosed()
	proctest.Ready()
	for {
		select {
		case <-stop:
			return
		default:
		}
		for range 1 << 20 {
			hogSink++
		}
	}
}

// hogSink is what the CPU hog computes, kept so that its loop stays.
var hogSink uint64

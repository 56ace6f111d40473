package shmipc

import (
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

// BenchmarkPingPongProcess is BenchmarkPingPong with the echo server in a
// child process (the test binary re-executed), as two programs talk:
//
//	go test -run XXX -bench PingPongProcess .
//
// BenchmarkPingPongProcess/streams=S/size=Z/transport=T: S client
// goroutines in this process, each with its own stream (all on one
// session) or Unix socket connection, do b.N round trips together, so
// ns/op is wall time per round trip of the group. The server's echo is the
// same code as in-process: ReadBytes and WriteBytes over shared memory,
// io.ReadFull and Write over the socket.
func BenchmarkPingPongProcess(b *testing.B) {
	startBenchHogs(b, *benchHogs)
	for _, streams := range pingPongStreams {
		for _, sz := range processSizes {
			for _, tr := range []benchTransport{shmProcessTransport, udsProcessTransport} {
				name := fmt.Sprintf("streams=%d/size=%s/transport=%s", streams, sz.name, tr.name)
				b.Run(name, func(b *testing.B) { benchmarkStreams(b, tr, streams, sz.size) })
			}
		}
	}
}

// processSizes are the message sizes of BenchmarkPingPongProcess.
var processSizes = []struct {
	name string
	size int
}{{"64B", 64}, {"4KB", 4 << 10}, {"64KB", 64 << 10}, {"1MB", 1 << 20}}

var (
	shmProcessTransport = benchTransport{"shm", func(b *testing.B, size int) benchServer { return serveProcess(b, "shm", size) }}
	udsProcessTransport = benchTransport{"uds", func(b *testing.B, size int) benchServer { return serveProcess(b, "uds", size) }}
)

// benchServerRole is the proctest role of a benchmark's echo server.
const benchServerRole = "bench-echo-server"

// serveProcess starts an echo server of transport ("shm" or "uds") for
// size-byte messages in a child process, stopped when b ends.
func serveProcess(b *testing.B, transport string, size int) benchServer {
	sock := sockPath(b)
	c, _ := startChild(b, proctest.Config{
		TestName: "TestBenchServerChild",
		Role:     benchServerRole,
		Args:     map[string]string{"SOCK": sock, "TRANSPORT": transport, "SIZE": strconv.Itoa(size)},
		Timeout:  24 * time.Hour, // a benchmark run takes long; Stop and the parent's death end it
	})
	b.Cleanup(func() {
		if err := c.Stop(10 * time.Second); err != nil {
			b.Errorf("echo server: %v\n%s", err, c.Output())
		}
	})
	if transport == "uds" {
		var mu sync.Mutex
		var conns []net.Conn
		b.Cleanup(func() {
			mu.Lock()
			defer mu.Unlock()
			for _, c := range conns {
				c.Close()
			}
		})
		return benchServer{connect: func() (pingClient, error) {
			conn, err := net.Dial("unix", sock)
			if err != nil {
				return nil, err
			}
			mu.Lock()
			conns = append(conns, conn)
			mu.Unlock()
			return newConnClient(conn, size), nil
		}, wakeups: func() int64 { return -1 }}
	}
	clients, err := dialShmClients(sock, DefaultConfig())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(clients.close)
	return benchServer{connect: func() (pingClient, error) {
		st, err := clients.open()
		if err != nil {
			return nil, err
		}
		return &shmClient{st: st, size: size}, nil
	}, wakeups: func() int64 {
		st := clients.sessions()[0].Stats()
		return int64(st.WakeupsSent + st.WakeupsReceived)
	}}
}

// TestBenchServerChild is the echo server of BenchmarkPingPongProcess:
// started by serveProcess, it serves until its stdin closes.
func TestBenchServerChild(t *testing.T) {
	if proctest.Role() != benchServerRole {
		t.Skip("helper process: the echo server of BenchmarkPingPongProcess")
	}
	sock := proctest.Arg("SOCK")
	size, err := strconv.Atoi(proctest.Arg("SIZE"))
	if err != nil {
		t.Fatal(err)
	}
	var ln net.Listener
	var echo func(net.Conn)
	if proctest.Arg("TRANSPORT") == "uds" {
		ln, err = net.Listen("unix", sock)
		echo = func(c net.Conn) { connEcho(c, size) }
	} else {
		ln, err = Listen("unix", sock, DefaultConfig())
		echo = func(c net.Conn) { shmEchoServer(c.(*Stream), size) }
	}
	if err != nil {
		t.Fatal(err)
	}
	wait := serveEach(ln, echo)
	proctest.Ready()
	<-proctest.StdinClosed()
	ln.Close()
	if l, ok := ln.(*Listener); ok {
		l.CloseAll()
	}
	wait()
}

// CPU hogs: child processes that spin while a benchmark run with -hogs N
// measures.

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

// The echo servers and clients of the ping-pong benchmarks: shmipc streams
// (a session, or a SessionManager's sessions) and Unix socket connections.

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

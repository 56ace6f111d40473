package shmipc

import (
	"fmt"
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

package shmipc

// The echo servers and clients of the ping-pong benchmarks: shmipc streams
// (a session, or a SessionManager's sessions) and Unix socket connections.

import (
	"io"
	"net"
	"sync"
	"testing"
)

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

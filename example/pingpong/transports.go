package main

// The transports: shm (a stream of an shmipc session, read in place, or
// through net.Conn with -conn), and uds and tcp (a plain connection).

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/goshm/shmipc"
)

var allTransports = []string{"shm", "uds", "tcp"}

var transportInfo = map[string]string{
	"shm": "shmipc (memfd, Unix socket)",
	"uds": "Unix socket",
	"tcp": "TCP loopback",
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

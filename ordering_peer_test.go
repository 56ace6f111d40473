package shmipc

// The peer process of the ordering tests (ordering_test.go): a raw peer
// that ends every stream the way both reference implementations do. The
// stream's data goes as FallbackData frames on the socket, and once those
// writes have completed, the close goes on the IO queue as an element
// (a StreamClose frame only if the queue is full).
//
//	role order-server (NET, ADDR, MODE): serve one session on a socket of
//	    its own. Each stream carries an 8-byte request, a big-endian u64 n;
//	    the reply is n bytes of orderingPattern(id) as FallbackData, then a
//	    close element.
//	role order-client (NET, ADDR, MODE, PREFIX, COUNT, SIZE): open COUNT
//	    streams one after another; on the k-th send SIZE + 37·k bytes of
//	    orderingPattern(id) as FallbackData, then a close element. Then
//	    serve the session's wake-ups until stdin closes.

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
	"github.com/goshm/shmipc/internal/shm"
	"golang.org/x/sys/unix"
)

// orderChunk is the data of one FallbackData frame the peer sends.
const orderChunk = 4 << 20

// orderPeer is one side of a session played by hand, in the child process.
type orderPeer struct {
	conn    net.Conn
	version byte
	bm      *shm.Buffer // the buffer region, to read the messages sent to us
	send    rawQueue    // the queue we produce into
	recv    rawQueue    // the queue the other side produces into

	wmu sync.Mutex // one frame at a time on the socket
}

// setFlag stores the working flag of a queue half.
func (q rawQueue) setFlag(v uint32) { atomic.StoreUint32(q.u32(queueFlagOff), v) }

// tryPut publishes an element unless the queue is full.
func (q rawQueue) tryPut(id, offset, status uint32) bool {
	if q.tail()-q.head() >= int64(q.cap) {
		return false
	}
	q.put(id, offset, status)
	return true
}

func (p *orderPeer) write(b []byte) error {
	p.wmu.Lock()
	defer p.wmu.Unlock()
	p.conn.SetWriteDeadline(time.Now().Add(30 * time.Second))
	_, err := p.conn.Write(b)
	return err
}

// sendThenClose sends data on stream id as FallbackData, and once every
// frame is written, publishes the close on the queue, waking the other side
// with a Polling frame if its working flag was clear.
func (p *orderPeer) sendThenClose(id uint32, data []byte) error {
	for len(data) > 0 {
		n := min(len(data), orderChunk)
		if err := p.write(rawFallbackFrame(p.version, 0, id, 0, string(data[:n]))); err != nil {
			return fmt.Errorf("FallbackData on stream %d: %w", id, err)
		}
		data = data[n:]
	}
	if !p.send.tryPut(id, 0, 1) {
		return p.write(binary.BigEndian.AppendUint32(rawFrame(12, rawMagic, p.version, 2), id))
	}
	if p.send.casFlag() {
		return p.write(rawFrame(8, rawMagic, p.version, 1))
	}
	return nil
}

// drain takes every element off the receive queue, as a consumer does
// after a Polling frame: onData gets each message (its slices are freed),
// closes are dropped. It clears the working flag once the queue is empty.
func (p *orderPeer) drain(onData func(id uint32, data []byte)) error {
	for {
		for {
			e, ok := p.recv.pop()
			if !ok {
				break
			}
			switch e.Status {
			case 1: // a close
			case 0:
				slices, err := p.bm.ReadChain(nil, e.Offset)
				if err != nil {
					return fmt.Errorf("message on stream %d: %w", e.ID, err)
				}
				var b []byte
				for _, s := range slices {
					b = append(b, s.Data...)
				}
				for _, s := range slices {
					if err := p.bm.Push(int(s.List), s.Off); err != nil {
						return err
					}
				}
				onData(e.ID, b)
			default:
				return fmt.Errorf("element of status %d", e.Status)
			}
		}
		p.recv.setFlag(0)
		if p.recv.tail() <= p.recv.head() {
			return nil
		}
		p.recv.setFlag(1)
	}
}

// serve reads frames until the connection ends: Polling drains the queue,
// FallbackData goes to onData, StreamClose is dropped. It returns nil at
// the end of the connection.
func (p *orderPeer) serve(onData func(id uint32, data []byte)) error {
	h := make([]byte, 8)
	for {
		if _, err := io.ReadFull(p.conn, h); err != nil {
			return nil
		}
		n := binary.BigEndian.Uint32(h)
		if n < 8 || n > 64<<20 || binary.BigEndian.Uint16(h[4:]) != rawMagic {
			return fmt.Errorf("frame header % x", h)
		}
		body := make([]byte, n-8)
		if _, err := io.ReadFull(p.conn, body); err != nil {
			return nil
		}
		switch h[7] {
		case 1:
			if err := p.drain(onData); err != nil {
				return err
			}
		case 2:
		case 3:
			if len(body) < 8 {
				return fmt.Errorf("FallbackData of %d bytes", n)
			}
			onData(binary.BigEndian.Uint32(body), body[8:])
		default:
			return fmt.Errorf("frame of type %d in the running phase", h[7])
		}
	}
}

// orderMode is the mapping mode an argument names.
func orderMode(s string) MemMapType {
	if s == "memfd" {
		return MemMapTypeMemFd
	}
	return MemMapTypeDevShmFile
}

// orderServer is the order-server role.
func orderServer(t *testing.T) {
	ln, err := net.Listen(proctest.MustArg(t, "NET"), proctest.MustArg(t, "ADDR"))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	proctest.Ready(ln.Addr().String())
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	buf, q, v, err := serveRawHandshake(c, orderMode(proctest.MustArg(t, "MODE")))
	if err != nil {
		t.Fatalf("handshake: %v", err)
	}
	defer unix.Munmap(buf)
	defer unix.Munmap(q)
	bm, err := shm.NewBuffer(shm.RegionOf(buf), false)
	if err != nil {
		t.Fatal(err)
	}
	half := len(q) / 2
	qcap := uint32((half - queueHeaderSize) / queueElemSize)
	p := &orderPeer{conn: c, version: v, bm: bm,
		send: rawQueue{mem: q[half:], cap: qcap},
		recv: rawQueue{mem: q[:half], cap: qcap},
	}
	requests := make(map[uint32][]byte)
	replied := make(map[uint32]bool)
	var replyErr error
	err = p.serve(func(id uint32, data []byte) {
		if replied[id] || replyErr != nil {
			return
		}
		req := append(requests[id], data...)
		requests[id] = req
		if len(req) < 8 {
			return
		}
		replied[id] = true
		delete(requests, id)
		replyErr = p.sendThenClose(id, orderingPattern(id, int(binary.BigEndian.Uint64(req))))
	})
	if err == nil {
		err = replyErr
	}
	if err != nil {
		t.Fatal(err)
	}
}

// orderClient is the order-client role.
func orderClient(t *testing.T) {
	mode := orderMode(proctest.MustArg(t, "MODE"))
	count, err1 := strconv.Atoi(proctest.MustArg(t, "COUNT"))
	size, err2 := strconv.Atoi(proctest.MustArg(t, "SIZE"))
	if err1 != nil || err2 != nil {
		t.Fatalf("COUNT, SIZE: %v, %v", err1, err2)
	}
	conf := DefaultConfig()
	conf.MemMapType = mode
	conf.ShareMemoryPathPrefix = proctest.MustArg(t, "PREFIX")
	r := createRawRegions(t, conf, mode, rawLayout{})
	c, err := net.DialTimeout(proctest.MustArg(t, "NET"), proctest.MustArg(t, "ADDR"), 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	v, err := r.handshake(c, mode)
	if err != nil {
		t.Fatalf("handshake: %v", err)
	}
	bm, err := shm.NewBuffer(r.buf, true)
	if err != nil {
		t.Fatal(err)
	}
	half := len(r.queue.Mem()) / 2
	p := &orderPeer{conn: c, version: v, bm: bm,
		send: rawQueue{mem: r.queue.Mem()[:half], cap: conf.QueueCap},
		recv: rawQueue{mem: r.queue.Mem()[half:], cap: conf.QueueCap},
	}
	served := make(chan error, 1)
	go func() { served <- p.serve(func(uint32, []byte) {}) }()
	for k := 0; k < count; k++ {
		id := uint32(k + 2) // a client's streams: 2, 3, ... (docs/protocol.md §9.1)
		if err := p.sendThenClose(id, orderingPattern(id, size+37*k)); err != nil {
			t.Fatal(err)
		}
	}
	proctest.Ready("sent")
	select {
	case <-proctest.StdinClosed():
	case err := <-served:
		if err != nil {
			t.Fatal(err)
		}
		<-proctest.StdinClosed()
	}
}

// TestOrderingPeerChild is the peer process of the ordering tests.
func TestOrderingPeerChild(t *testing.T) {
	switch proctest.Role() {
	case "":
		t.Skip("runs only as the peer process of the ordering tests")
	case "order-server":
		orderServer(t)
	case "order-client":
		orderClient(t)
	default:
		t.Fatalf("unknown role %q", proctest.Role())
	}
}

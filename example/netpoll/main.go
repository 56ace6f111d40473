// Command netpoll shows how an RPC framework whose codecs are written
// against CloudWeGo netpoll's nocopy interfaces (netpoll.Reader and
// netpoll.Writer, as in Kitex and Hertz) can use shmipc as its transport.
//
// The framework part below (codec, server loop, client call) only sees a
// netpoll.Reader and a netpoll.Writer per connection. The shmipc part is a
// few lines: every stream of a session is a connection, and
// Stream.NetpollReader and Stream.NetpollWriter give its two sides.
//
// A server and a client run in this process, over a Unix socket in a
// temporary directory; the messages themselves travel through shared
// memory. The program prints a few lines and exits 0 when every response
// matched.
package main

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/cloudwego/netpoll"

	"github.com/goshm/shmipc"
)

// ---- The framework side: knows netpoll.Reader/Writer only. ----

// Conn is what the framework needs of a transport connection.
type Conn interface {
	Reader() netpoll.Reader
	Writer() netpoll.Writer
	SetReadDeadline(time.Time) error
	Close() error
}

// Frame layout: 4-byte big-endian length of what follows, 4-byte sequence
// id, 1-byte method, then the payload.
const headerSize = 9

// Methods of the demo service.
const (
	methodEcho  byte = 1
	methodUpper byte = 2
	methodSum   byte = 3 // payload: big-endian uint32s; reply: their sum
)

// encode writes one frame. The header is built in place with Malloc (in
// shared memory under shmipc); small payloads are too, large ones are
// copied with WriteBinary. Flush sends the frame.
func encode(w netpoll.Writer, seq uint32, method byte, payload []byte) error {
	hdr, err := w.Malloc(headerSize)
	if err != nil {
		return err
	}
	binary.BigEndian.PutUint32(hdr[0:4], uint32(headerSize-4+len(payload)))
	binary.BigEndian.PutUint32(hdr[4:8], seq)
	hdr[8] = method
	if len(payload) <= 4096 {
		body, err := w.Malloc(len(payload))
		if err != nil {
			return err
		}
		copy(body, payload)
	} else if _, err := w.WriteBinary(payload); err != nil {
		return err
	}
	return w.Flush()
}

// decode reads one frame. Peek waits for the length, Next for the whole
// frame (zero-copy when it lies in one slice of shared memory). payload is
// valid until r.Release.
func decode(r netpoll.Reader) (seq uint32, method byte, payload []byte, err error) {
	lenBuf, err := r.Peek(4)
	if err != nil {
		return 0, 0, nil, err
	}
	n := int(binary.BigEndian.Uint32(lenBuf))
	if n < headerSize-4 || n > 64<<20 {
		return 0, 0, nil, fmt.Errorf("bad frame length %d", n)
	}
	frame, err := r.Next(4 + n)
	if err != nil {
		return 0, 0, nil, err
	}
	return binary.BigEndian.Uint32(frame[4:8]), frame[8], frame[headerSize:], nil
}

// serveConn answers requests until the client closes the connection.
func serveConn(c Conn) error {
	defer c.Close()
	r, w := c.Reader(), c.Writer()
	var scratch []byte
	for {
		seq, method, req, err := decode(r)
		if errors.Is(err, io.EOF) || errors.Is(err, shmipc.ErrSessionClosed) {
			return nil // the client closed the stream or its session
		}
		if err != nil {
			return err
		}
		var resp []byte
		switch method {
		case methodEcho:
			resp = req
		case methodUpper:
			scratch = append(scratch[:0], bytes.ToUpper(req)...)
			resp = scratch
		case methodSum:
			var sum uint64
			for ; len(req) >= 4; req = req[4:] {
				sum += uint64(binary.BigEndian.Uint32(req))
			}
			resp = binary.BigEndian.AppendUint64(scratch[:0], sum)
		default:
			return fmt.Errorf("unknown method %d", method)
		}
		// The response is encoded before the request is released: resp
		// may point into the request's shared memory.
		if err := encode(w, seq, method, resp); err != nil {
			return err
		}
		if err := r.Release(); err != nil {
			return err
		}
	}
}

// call sends one request and waits for its response, which it returns as a
// copy.
func call(c Conn, seq uint32, method byte, req []byte) ([]byte, error) {
	if err := encode(c.Writer(), seq, method, req); err != nil {
		return nil, err
	}
	r := c.Reader()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	gotSeq, gotMethod, resp, err := decode(r)
	if err != nil {
		return nil, err
	}
	defer r.Release()
	if gotSeq != seq || gotMethod != method {
		return nil, fmt.Errorf("response %d/%d to request %d/%d", gotSeq, gotMethod, seq, method)
	}
	return bytes.Clone(resp), nil
}

// ---- The shmipc side: a stream is a connection. ----

// shmConn adapts a shmipc stream to the framework's Conn. The writer is
// kept, so that a WriteDirect and its Flush use the same one.
type shmConn struct {
	*shmipc.Stream
	r netpoll.Reader
	w netpoll.Writer
}

func newShmConn(st *shmipc.Stream) *shmConn {
	return &shmConn{Stream: st, r: st.NetpollReader(), w: st.NetpollWriter()}
}

func (c *shmConn) Reader() netpoll.Reader { return c.r }
func (c *shmConn) Writer() netpoll.Writer { return c.w }

// ---- The demo. ----

func main() {
	if err := run(); err != nil {
		log.Fatal(err)
	}
}

func run() error {
	dir, err := os.MkdirTemp("", "shmipc-netpoll")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "rpc.sock")

	// Server: every stream a client opens is a connection.
	ln, err := shmipc.Listen("unix", sock, nil)
	if err != nil {
		return err
	}
	defer ln.Close()
	var served sync.WaitGroup
	go func() {
		for {
			st, err := ln.AcceptStream()
			if err != nil {
				return // listener closed
			}
			served.Add(1)
			go func() {
				defer served.Done()
				if err := serveConn(newShmConn(st)); err != nil {
					log.Printf("server: stream %d: %v", st.ID(), err)
				}
			}()
		}
	}()

	// Client: one session, a small pool of streams used concurrently.
	sess, err := shmipc.Dial("unix", sock, nil)
	if err != nil {
		return err
	}
	defer sess.Close()
	fmt.Printf("client connected to %s; messages go through shared memory\n", sock)

	conn := func() (*shmConn, error) {
		st, err := sess.OpenStream()
		if err != nil {
			return nil, err
		}
		return newShmConn(st), nil
	}

	c, err := conn()
	if err != nil {
		return err
	}
	resp, err := call(c, 1, methodEcho, []byte("hello over shared memory"))
	if err != nil {
		return fmt.Errorf("echo: %w", err)
	}
	fmt.Printf("Echo(%q) = %q\n", "hello over shared memory", resp)

	resp, err = call(c, 2, methodUpper, []byte("netpoll reader and writer"))
	if err != nil {
		return fmt.Errorf("upper: %w", err)
	}
	fmt.Printf("Upper(%q) = %q\n", "netpoll reader and writer", resp)

	var nums []byte
	want := uint64(0)
	for i := uint32(1); i <= 1000; i++ {
		nums = binary.BigEndian.AppendUint32(nums, i)
		want += uint64(i)
	}
	resp, err = call(c, 3, methodSum, nums)
	if err != nil {
		return fmt.Errorf("sum: %w", err)
	}
	if got := binary.BigEndian.Uint64(resp); got != want {
		return fmt.Errorf("Sum(1..1000) = %d, want %d", got, want)
	}
	fmt.Printf("Sum(1..1000) = %d\n", want)
	c.Close()

	// Concurrent calls on a pool of 4 streams, payloads up to 1 MiB.
	const workers, calls = 4, 50
	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	var bytesMoved int64
	var mu sync.Mutex
	for wk := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := conn()
			if err != nil {
				errs <- err
				return
			}
			defer c.Close()
			for i := range calls {
				req := make([]byte, (i*i*397+wk*1000)%(1<<20))
				for j := range req {
					req[j] = byte(j*7 + i + wk)
				}
				resp, err := call(c, uint32(i), methodEcho, req)
				if err != nil {
					errs <- fmt.Errorf("worker %d call %d: %w", wk, i, err)
					return
				}
				if !bytes.Equal(resp, req) {
					errs <- fmt.Errorf("worker %d call %d: %d-byte echo differs", wk, i, len(req))
					return
				}
				mu.Lock()
				bytesMoved += int64(2 * len(req))
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		return err
	}
	fmt.Printf("%d concurrent echo calls on %d streams moved %.1f MiB in %v\n",
		workers*calls, workers, float64(bytesMoved)/(1<<20), time.Since(start).Round(time.Millisecond))

	sess.Close()
	served.Wait()
	fmt.Println("ok")
	return nil
}

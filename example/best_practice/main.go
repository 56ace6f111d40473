// Command best_practice shows the two recommended ways to use shmipc, each
// with a server and a client in separate processes.
//
// Synchronous: the server handles each stream with Listener.Serve, a
// goroutine per stream reading requests and writing responses in a loop; the
// client sends a request and waits for its response on one stream.
//
// Asynchronous: the server is event-driven (Listener.ServeHandler): its
// OnData callback answers every complete request that has arrived and leaves
// partial ones for the next call. The client takes pooled streams from a
// SessionManager, pipelines several requests on each before reading the
// responses, and puts the streams back for reuse.
//
// Both use the same framing: a big-endian u32 length, then the payload. The
// server answers "reply to: " + payload, in a frame of its own, built in
// shared memory with BufferWriter.Reserve; requests are read in place with
// BufferReader.ReadBytes.
//
// Usage:
//
//	best_practice                                  # demo: both styles, server in a child process
//	best_practice -server [-async] -sock /tmp/bp.sock
//	best_practice -client [-async] -sock /tmp/bp.sock
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/goshm/shmipc"
)

var replyPrefix = []byte("reply to: ")

func main() {
	server := flag.Bool("server", false, "run a server until SIGINT/SIGTERM")
	client := flag.Bool("client", false, "run a client against a running server")
	async := flag.Bool("async", false, "use the asynchronous style (callback server; pooled, pipelined client)")
	sock := flag.String("sock", filepath.Join(os.TempDir(), "shmipc-best-practice.sock"), "Unix socket path")
	requests := flag.Int("n", 1000, "client: number of requests")
	flag.Parse()
	log.SetFlags(0)

	var err error
	switch {
	case *server && *client:
		err = errors.New("choose -server or -client, or neither for the demo")
	case *server:
		err = runServer(*sock, *async)
	case *client && *async:
		err = asyncClient(*sock, *requests)
	case *client:
		err = syncClient(*sock, *requests)
	default:
		err = demo(*requests)
	}
	if err != nil {
		log.Fatal(err)
	}
}

// ---------------------------------------------------------------------------
// Servers

func runServer(sock string, async bool) error {
	// Remove a socket left behind by a server that was killed.
	if fi, err := os.Lstat(sock); err == nil && fi.Mode()&os.ModeSocket != 0 {
		os.Remove(sock)
	}
	ln, err := shmipc.Listen("unix", sock, nil)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	go func() {
		<-ctx.Done()
		ln.CloseAll() // Serve returns; every session and stream closes
	}()

	style := "synchronous"
	serve := func() error { return ln.Serve(syncHandler) }
	if async {
		style = "asynchronous"
		serve = func() error { return ln.ServeHandler(asyncHandler{}) }
	}
	fmt.Printf("ready: %s server on %s\n", style, sock)
	if err := serve(); !errors.Is(err, shmipc.ErrListenerClosed) {
		return err
	}
	fmt.Printf("server: stopped\n")
	return nil
}

// syncHandler serves one stream: request, response, repeat. Serve runs it in
// a goroutine of its own and closes the stream when it returns.
func syncHandler(st *shmipc.Stream) {
	r := st.BufferReader()
	for {
		hdr, err := r.ReadBytes(4)
		if err != nil {
			return // io.EOF: the client closed the stream
		}
		payload, err := r.ReadBytes(int(binary.BigEndian.Uint32(hdr)))
		if err != nil {
			return
		}
		if err := writeReply(st, payload); err != nil {
			return
		}
		// payload points into shared memory: release it only after use.
		r.ReleasePreviousRead()
	}
}

// asyncHandler answers every complete request that has arrived. It never
// blocks: a partial request stays unread, and OnData is called again when
// more data has come.
type asyncHandler struct{}

func (asyncHandler) OnData(st *shmipc.Stream) error {
	r := st.BufferReader()
	for r.Len() >= 4 {
		hdr, err := r.Peek(4)
		if err != nil {
			return err
		}
		n := int(binary.BigEndian.Uint32(hdr))
		if n > 1<<20 {
			return fmt.Errorf("request of %d bytes is too large", n)
		}
		if r.Len() < 4+n {
			return nil // the rest has not arrived yet
		}
		frame, err := r.ReadBytes(4 + n)
		if err != nil {
			return err
		}
		if err := writeReply(st, frame[4:]); err != nil {
			return err
		}
	}
	return nil // what was read is released when OnData returns
}

func (asyncHandler) OnClose(st *shmipc.Stream, err error) {
	if err != nil && !errors.Is(err, shmipc.ErrSessionClosed) {
		log.Printf("server: stream %d: %v", st.ID(), err)
	}
}

// writeReply builds the reply frame directly in shared memory and sends it.
func writeReply(st *shmipc.Stream, payload []byte) error {
	n := len(replyPrefix) + len(payload)
	buf, err := st.BufferWriter().Reserve(4 + n)
	if err != nil {
		return err
	}
	binary.BigEndian.PutUint32(buf, uint32(n))
	copy(buf[4+copy(buf[4:], replyPrefix):], payload)
	return st.Flush(false)
}

// ---------------------------------------------------------------------------
// Clients

func request(i int) []byte { return fmt.Appendf(nil, "request #%d", i) }

// writeRequest adds one request frame to the stream's pending message.
func writeRequest(st *shmipc.Stream, payload []byte) error {
	buf, err := st.BufferWriter().Reserve(4 + len(payload))
	if err != nil {
		return err
	}
	binary.BigEndian.PutUint32(buf, uint32(len(payload)))
	copy(buf[4:], payload)
	return nil
}

// readReply reads one reply frame and checks it answers payload.
func readReply(st *shmipc.Stream, payload []byte) error {
	r := st.BufferReader()
	hdr, err := r.ReadBytes(4)
	if err != nil {
		return err
	}
	reply, err := r.ReadBytes(int(binary.BigEndian.Uint32(hdr)))
	if err != nil {
		return err
	}
	if !bytes.HasPrefix(reply, replyPrefix) || !bytes.Equal(reply[len(replyPrefix):], payload) {
		return fmt.Errorf("stream %d: reply %q to %q", st.ID(), reply, payload)
	}
	return nil
}

// syncClient sends requests one at a time on one stream.
func syncClient(sock string, requests int) error {
	sess, err := shmipc.Dial("unix", sock, nil)
	if err != nil {
		return err
	}
	defer sess.Close()
	st, err := sess.OpenStream()
	if err != nil {
		return err
	}
	defer st.Close()
	st.SetDeadline(time.Now().Add(30 * time.Second))

	start := time.Now()
	for i := range requests {
		req := request(i)
		if err := writeRequest(st, req); err != nil {
			return err
		}
		if err := st.Flush(false); err != nil {
			return err
		}
		if err := readReply(st, req); err != nil {
			return err
		}
		st.BufferReader().ReleasePreviousRead() // the reply is checked: free its shared memory
	}
	elapsed := time.Since(start)
	fmt.Printf("sync client: %d request-response round trips on stream %d in %v (%v each)\n",
		requests, st.ID(), elapsed.Round(time.Millisecond), (elapsed / time.Duration(max(requests, 1))).Round(100*time.Nanosecond))
	return nil
}

// asyncClient runs workers that pipeline batches of requests on streams
// from a SessionManager.
func asyncClient(sock string, requests int) error {
	const workers, batch = 8, 16
	m, err := shmipc.NewSessionManager(shmipc.SessionManagerConfig{
		Network:    "unix",
		Address:    sock,
		SessionNum: 2,
	})
	if err != nil {
		return err
	}
	defer m.Close()

	var (
		mu      sync.Mutex
		streams = map[*shmipc.Stream]bool{}
		batches int
	)
	work := make(chan int)
	errs := make(chan error, workers)
	var wg sync.WaitGroup
	start := time.Now()
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for first := range work {
				if err := pipeline(m, first, min(batch, requests-first), func(st *shmipc.Stream) {
					mu.Lock()
					streams[st] = true
					batches++
					mu.Unlock()
				}); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	for first := 0; first < requests; first += batch {
		work <- first
	}
	close(work)
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return err
	}
	fmt.Printf("async client: %d requests in %d pipelined batches of up to %d, by %d goroutines, on %d pooled streams over 2 sessions, in %v\n",
		requests, batches, batch, workers, len(streams), time.Since(start).Round(time.Millisecond))
	fmt.Printf("async client: %d streams idle in the pool at the end\n", m.IdleStreams())
	return nil
}

// pipeline sends requests first..first+n-1 on one pooled stream, all in one
// message, then reads the n replies.
func pipeline(m *shmipc.SessionManager, first, n int, used func(*shmipc.Stream)) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := m.GetStreamContext(ctx) // waits while a lost session is re-dialed
	if err != nil {
		return err
	}
	used(st)
	st.SetDeadline(time.Now().Add(30 * time.Second))
	for i := first; i < first+n; i++ {
		if err := writeRequest(st, request(i)); err != nil {
			st.Close()
			return err
		}
	}
	if err := st.Flush(false); err != nil {
		st.Close()
		return err
	}
	for i := first; i < first+n; i++ {
		if err := readReply(st, request(i)); err != nil {
			st.Close() // never put back a stream in an unknown state
			return err
		}
	}
	m.PutBack(st) // every reply is read: the stream can carry the next batch
	return nil
}

// ---------------------------------------------------------------------------
// Demo

// demo runs each style with the server in a child process.
func demo(requests int) error {
	dir, err := os.MkdirTemp("", "shmipc-bp")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	for _, async := range []bool{false, true} {
		sock := filepath.Join(dir, fmt.Sprintf("bp-%v.sock", async))
		stop, err := startServer(sock, async)
		if err != nil {
			return err
		}
		if async {
			err = asyncClient(sock, requests)
		} else {
			err = syncClient(sock, requests)
		}
		if serr := stop(); err == nil {
			err = serr
		}
		if err != nil {
			return err
		}
	}
	fmt.Println("demo: done")
	return nil
}

// startServer starts this program as a server process and waits until it
// is ready. stop ends it with SIGTERM and waits for it.
func startServer(sock string, async bool) (stop func() error, err error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	args := []string{"-server", "-sock", sock}
	if async {
		args = append(args, "-async")
	}
	cmd := exec.Command(exe, args...)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} // dies with us
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	lines := bufio.NewScanner(out)
	if !lines.Scan() {
		cmd.Process.Kill()
		cmd.Wait()
		return nil, fmt.Errorf("server process did not start: %v", lines.Err())
	}
	fmt.Printf("server process %d: %s\n", cmd.Process.Pid, lines.Text())
	rest := make(chan struct{})
	go func() { // pass on the rest of its output
		for lines.Scan() {
			fmt.Printf("server process %d: %s\n", cmd.Process.Pid, lines.Text())
		}
		io.Copy(io.Discard, out)
		close(rest)
	}()
	return func() error {
		cmd.Process.Signal(syscall.SIGTERM)
		<-rest
		if err := cmd.Wait(); err != nil {
			return fmt.Errorf("server process: %w", err)
		}
		return nil
	}, nil
}

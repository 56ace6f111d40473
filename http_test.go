package shmipc

// net/http over shmipc across two processes: the child serves net/http on
// shmipc Listeners (a Listener is a net.Listener of Streams), the parent
// uses the standard http.Client with a Transport that dials by opening a
// stream on one shmipc session. This proves that *Stream is a complete
// net.Conn: concurrent Read and Close, deadlines that wake blocked calls and
// report timeouts as net.Error, and clean EOFs.

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

const (
	httpChildTest = "TestHTTPChild"
	httpRole      = "http-server"

	// The strict server's timeouts, which the deadline tests run into.
	// They leave room for a loaded machine running -race binaries, where a
	// goroutine may wait a few hundred milliseconds to run. (The test of
	// ReadHeaderTimeout checks that the server waits at least that long; a
	// loaded machine only makes it wait longer. With -short the parent has
	// the child use 200 ms: httpReadHeaderTimeout.)
	httpStrictReadHeader = 500 * time.Millisecond
	httpStrictWrite      = time.Second
	httpStrictIdle       = time.Second
)

// httpReadHeaderTimeout is the strict server's ReadHeaderTimeout for this
// run: httpStrictReadHeader, or 200 ms with -short. The parent passes it
// to the child as READ_HEADER.
func httpReadHeaderTimeout() time.Duration {
	return shortOr(httpStrictReadHeader, 200*time.Millisecond)
}

// httpPayload returns n deterministic bytes.
func httpPayload(n int, seed byte) []byte {
	p := make([]byte, n)
	x := uint32(seed) + 1
	for i := range p {
		x = x*1664525 + 1013904223
		p[i] = byte(x >> 24)
	}
	return p
}

func httpSum(p []byte) string {
	s := sha256.Sum256(p)
	return hex.EncodeToString(s[:])
}

// httpMux is the child's handler.
//
//	POST /echo            answers the body, with its sha256 in X-Body-Sha256
//	GET  /download?n=N    answers N bytes, with their sha256 in X-Body-Sha256
//	GET  /sleep?d=D       answers "slept" after D, or stops when the client goes
//	GET  /active          answers the number of /sleep handlers running
//	GET  /hello           answers "hello"
func httpMux() http.Handler {
	var active atomic.Int64
	mux := http.NewServeMux()
	mux.HandleFunc("POST /echo", func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		w.Header().Set("X-Body-Sha256", httpSum(body))
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		w.Write(body)
	})
	mux.HandleFunc("GET /download", func(w http.ResponseWriter, r *http.Request) {
		n, err := strconv.Atoi(r.URL.Query().Get("n"))
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		body := httpPayload(n, 42)
		w.Header().Set("X-Body-Sha256", httpSum(body))
		w.Write(body)
	})
	mux.HandleFunc("GET /sleep", func(w http.ResponseWriter, r *http.Request) {
		d, err := time.ParseDuration(r.URL.Query().Get("d"))
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		active.Add(1)
		defer active.Add(-1)
		select {
		case <-time.After(d):
			io.WriteString(w, "slept")
		case <-r.Context().Done():
		}
	})
	mux.HandleFunc("GET /active", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, active.Load())
	})
	mux.HandleFunc("GET /hello", func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "hello")
	})
	return mux
}

// TestHTTPChild is the child process: net/http on two shmipc listeners,
// one lenient (SOCK) and one with short timeouts (STRICT_SOCK), until the
// parent closes stdin.
func TestHTTPChild(t *testing.T) {
	if proctest.Role() != httpRole {
		t.Skip("runs only as the child process of the HTTP tests")
	}
	mux := httpMux()
	servers := []*http.Server{
		{Handler: mux, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 30 * time.Second},
		{Handler: mux, ReadHeaderTimeout: httpStrictReadHeader, WriteTimeout: httpStrictWrite, IdleTimeout: httpStrictIdle},
	}
	if a := proctest.Arg("READ_HEADER"); a != "" {
		d, err := time.ParseDuration(a)
		if err != nil {
			t.Fatal(err)
		}
		servers[1].ReadHeaderTimeout = d
	}
	errs := make(chan error, len(servers))
	for i, arg := range []string{"SOCK", "STRICT_SOCK"} {
		ln, err := Listen("unix", proctest.MustArg(t, arg), httpConfig())
		if err != nil {
			t.Fatal(err)
		}
		var _ net.Listener = ln
		go func() { errs <- servers[i].Serve(ln) }()
	}
	proctest.Ready()
	<-proctest.StdinClosed()
	for _, srv := range servers {
		srv.Close()
	}
	for range servers {
		if err := <-errs; !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("http.Server.Serve returned %v, want http.ErrServerClosed", err)
		}
	}
}

// httpConfig is the default configuration with a handshake timeout long
// enough for a loaded machine running -race binaries.
func httpConfig() *Config {
	conf := DefaultConfig()
	conf.InitializeTimeout = 10 * time.Second
	return conf
}

// httpClient is an http.Client whose connections are streams of one
// shmipc session.
type httpClient struct {
	*http.Client
	sess  *Session
	tr    *http.Transport
	dials atomic.Int64
}

func newHTTPClient(t testing.TB, sock string) *httpClient {
	t.Helper()
	sess, err := Dial("unix", sock, httpConfig())
	if err != nil {
		t.Fatal(err)
	}
	c := &httpClient{sess: sess}
	c.tr = &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			c.dials.Add(1)
			return sess.OpenStream()
		},
		MaxIdleConnsPerHost: 16,
		DisableCompression:  true,
	}
	c.Client = &http.Client{Transport: c.tr}
	t.Cleanup(func() {
		c.tr.CloseIdleConnections()
		sess.Close()
	})
	return c
}

// get fetches url and checks the status.
func (c *httpClient) get(url string) ([]byte, *http.Response, error) {
	resp, err := c.Get(url)
	if err != nil {
		return nil, nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, resp, err
	}
	if resp.StatusCode != http.StatusOK {
		return body, resp, fmt.Errorf("GET %s: %s: %s", url, resp.Status, body)
	}
	return body, resp, nil
}

// echo posts body to /echo and checks the answer and both digests.
func (c *httpClient) echo(body []byte) error {
	resp, err := c.Post("http://shmipc/echo", "application/octet-stream", bytes.NewReader(body))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	got, err := io.ReadAll(resp.Body)
	if err != nil {
		return fmt.Errorf("echo of %d bytes: reading the body: %w", len(body), err)
	}
	want := httpSum(body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("echo of %d bytes: %s", len(body), resp.Status)
	}
	if h := resp.Header.Get("X-Body-Sha256"); h != want {
		return fmt.Errorf("echo of %d bytes: the server got a body with sha256 %s, want %s", len(body), h, want)
	}
	if s := httpSum(got); s != want {
		return fmt.Errorf("echo of %d bytes: answer of %d bytes with sha256 %s, want %s", len(body), len(got), s, want)
	}
	return nil
}

func TestHTTP(t *testing.T) {
	waitsInParallel(t)
	dir := t.TempDir()
	sock, strict := filepath.Join(dir, "http.sock"), filepath.Join(dir, "strict.sock")
	child, _ := startChild(t, proctest.Config{
		TestName: httpChildTest,
		Role:     httpRole,
		Args:     map[string]string{"SOCK": sock, "STRICT_SOCK": strict, "READ_HEADER": httpReadHeaderTimeout().String()},
	})
	c := newHTTPClient(t, sock)

	t.Run("Concurrent", func(t *testing.T) {
		const requests, concurrency = 200, 16
		start := c.dials.Load()
		work := make(chan int)
		errs := make(chan error, requests)
		var wg sync.WaitGroup
		for range concurrency {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range work {
					var err error
					switch i % 4 {
					case 0:
						var body []byte
						if body, _, err = c.get("http://shmipc/hello"); err == nil && string(body) != "hello" {
							err = fmt.Errorf("GET /hello: %q", body)
						}
					default:
						err = c.echo(httpPayload(i*331%(64<<10), byte(i)))
					}
					if err != nil {
						errs <- fmt.Errorf("request %d: %w", i, err)
					}
				}
			}()
		}
		for i := range requests {
			work <- i
		}
		close(work)
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
		dials := c.dials.Load() - start
		t.Logf("%d requests, %d at a time, on %d streams", requests, concurrency, dials)
		if dials >= requests/2 {
			t.Errorf("%d streams for %d requests: keep-alive does not reuse connections", dials, requests)
		}
	})

	t.Run("KeepAlive", func(t *testing.T) {
		start := c.dials.Load()
		for range 20 {
			if _, _, err := c.get("http://shmipc/hello"); err != nil {
				t.Fatal(err)
			}
		}
		if d := c.dials.Load() - start; d > 1 {
			t.Errorf("20 sequential requests opened %d streams, want at most 1", d)
		}
	})

	t.Run("LargeBodies", func(t *testing.T) {
		for _, n := range []int{1 << 20, 8 << 20} {
			if err := c.echo(httpPayload(n, byte(n>>20))); err != nil {
				t.Error(err)
			}
			body, resp, err := c.get("http://shmipc/download?n=" + strconv.Itoa(n))
			if err != nil {
				t.Fatal(err)
			}
			if len(body) != n || httpSum(body) != resp.Header.Get("X-Body-Sha256") || httpSum(body) != httpSum(httpPayload(n, 42)) {
				t.Errorf("download of %d bytes: got %d bytes with sha256 %s, the server sent %s",
					n, len(body), httpSum(body), resp.Header.Get("X-Body-Sha256"))
			}
		}
	})

	t.Run("ClientTimeout", func(t *testing.T) {
		timeout := shortOr(200*time.Millisecond, 100*time.Millisecond)
		hc := &http.Client{Transport: c.tr, Timeout: timeout}
		start := time.Now()
		resp, err := hc.Get("http://shmipc/sleep?d=10s")
		elapsed := time.Since(start)
		if err == nil {
			resp.Body.Close()
			t.Fatalf("GET /sleep?d=10s with a %v timeout succeeded", timeout)
		}
		var ne net.Error
		if !errors.As(err, &ne) || !ne.Timeout() {
			t.Errorf("error %v (%T) is not a timeout", err, err)
		}
		if elapsed < timeout || elapsed > 10*time.Second { // the upper bound catches a hang
			t.Errorf("the request failed after %v with a %v timeout", elapsed, timeout)
		}
		// The Transport closed the stream; the server sees the close and
		// cancels the handler's context.
		deadline := time.Now().Add(5 * time.Second)
		for {
			body, _, err := c.get("http://shmipc/active")
			if err != nil {
				t.Fatal(err)
			}
			if string(body) == "0" {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s /sleep handlers still run 5s after the client gave up", body)
			}
			time.Sleep(20 * time.Millisecond)
		}
	})

	// The strict server's timeouts work through Stream deadlines.
	sc := newHTTPClient(t, strict)
	t.Run("ServerReadHeaderTimeout", func(t *testing.T) {
		st, err := sc.sess.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		start := time.Now()
		if _, err := io.WriteString(st, "GET /hello HTTP/1.1\r\nHost: shmipc\r\n"); err != nil { // no end of header
			t.Fatal(err)
		}
		st.SetReadDeadline(time.Now().Add(10 * time.Second))
		rest, err := io.ReadAll(st)
		elapsed := time.Since(start)
		if err != nil {
			t.Fatalf("the server did not close the stream: %v after %v", err, elapsed)
		}
		readHeader := httpReadHeaderTimeout()
		t.Logf("the server closed an incomplete request after %v (ReadHeaderTimeout %v); sent %q", elapsed, readHeader, rest)
		if elapsed < readHeader-50*time.Millisecond {
			t.Errorf("closed after %v, before ReadHeaderTimeout %v", elapsed, readHeader)
		}
	})
	t.Run("ServerIdleTimeout", func(t *testing.T) {
		if testing.Short() {
			t.Skip("-short: waits out a server timeout")
		}
		st, err := sc.sess.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		st.SetReadDeadline(time.Now().Add(10 * time.Second))
		br := bufio.NewReader(st)
		for i := range 3 { // keep-alive works before the idle timeout
			if _, err := io.WriteString(st, "GET /hello HTTP/1.1\r\nHost: shmipc\r\n\r\n"); err != nil {
				t.Fatal(err)
			}
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatalf("response %d: %v", i, err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if string(body) != "hello" {
				t.Fatalf("response %d: %q", i, body)
			}
		}
		start := time.Now()
		n, err := br.Read(make([]byte, 1))
		elapsed := time.Since(start)
		if n != 0 || err != io.EOF {
			t.Fatalf("read on an idle connection: %d, %v; want io.EOF when the server closes it", n, err)
		}
		t.Logf("the server closed the idle connection after %v (IdleTimeout %v)", elapsed, httpStrictIdle)
		if elapsed < httpStrictIdle-50*time.Millisecond || elapsed > 15*time.Second { // the upper bound catches a hang
			t.Errorf("idle connection closed after %v with IdleTimeout %v", elapsed, httpStrictIdle)
		}
	})
	t.Run("ServerWriteTimeout", func(t *testing.T) {
		if testing.Short() {
			t.Skip("-short: waits out a server timeout")
		}
		// Within the write timeout the answer comes; past it the server's
		// write fails and it drops the connection.
		if _, _, err := sc.get("http://shmipc/sleep?d=10ms"); err != nil {
			t.Fatal(err)
		}
		sc.tr.CloseIdleConnections() // a fresh connection: no retry by the Transport
		start := time.Now()
		body, _, err := sc.get(fmt.Sprintf("http://shmipc/sleep?d=%v", httpStrictWrite+500*time.Millisecond))
		if err == nil {
			t.Fatalf("a response %q came after the server's WriteTimeout", body)
		}
		t.Logf("past the WriteTimeout, after %v: %v", time.Since(start), err)
	})
	t.Run("StreamDeadlines", func(t *testing.T) {
		// The same as net.Conn deadlines: timeouts are net.Errors, a past
		// deadline wakes a blocked Read, and clearing it lets reads go on.
		st, err := c.sess.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		var conn net.Conn = st
		conn.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
		_, err = conn.Read(make([]byte, 1))
		var ne net.Error
		if !errors.As(err, &ne) || !ne.Timeout() {
			t.Fatalf("read past the deadline: %v, want a net.Error timeout", err)
		}
		readErr := make(chan error, 1)
		conn.SetReadDeadline(time.Time{})
		go func() {
			_, err := conn.Read(make([]byte, 1))
			readErr <- err
		}()
		time.Sleep(20 * time.Millisecond)
		conn.SetReadDeadline(time.Unix(1, 0)) // what http.Server does to abort a read
		select {
		case err := <-readErr:
			if !errors.Is(err, ErrTimeout) {
				t.Errorf("blocked read after a past deadline: %v, want ErrTimeout", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("a past deadline did not wake a blocked Read")
		}
		conn.SetDeadline(time.Time{})
		if _, err := io.WriteString(conn, "GET /hello HTTP/1.1\r\nHost: shmipc\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatalf("request after clearing the deadlines: %v", err)
		}
		resp.Body.Close()
	})

	c.tr.CloseIdleConnections()
	sc.tr.CloseIdleConnections()
	if err := child.Stop(20 * time.Second); err != nil {
		t.Errorf("child: %v\n%s", err, child.Output())
	}
}

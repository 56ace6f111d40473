package shmipc

// Ordering of a close after FallbackData, against a peer in another process
// that behaves as both reference implementations do: it writes a stream's
// last bytes as FallbackData on the socket, waits until the write has
// completed, then publishes the close as a queue element. Every byte must
// arrive, followed by exactly one clean end of stream.

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// orderingKit returns the conformance kit's directory (beside the repo, or
// $SHMIPC_KIT), and fails the test if it is missing: CI always has it.
func orderingKit(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("SHMIPC_KIT")
	if dir == "" {
		dir = filepath.Join("..", "shared", "conformance")
	}
	abs, err := filepath.Abs(dir)
	if err == nil {
		_, err = os.Stat(filepath.Join(abs, "shmpeer.py"))
	}
	if err != nil {
		t.Fatalf("the conformance kit's shmpeer.py is needed (set SHMIPC_KIT): %v", err)
	}
	return abs
}

// orderingPeer starts testdata/fallback_close_peer.py with args and waits
// for its first line.
func orderingPeer(t *testing.T, want string, args ...string) (*exec.Cmd, io.WriteCloser) {
	t.Helper()
	cmd := exec.Command("python3", append([]string{"testdata/fallback_close_peer.py"}, args...)...)
	cmd.Env = append(os.Environ(), "SHMIPC_KIT="+orderingKit(t))
	var stderr strings.Builder
	cmd.Stderr = &stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		stdin.Close()
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
		}
		if t.Failed() && stderr.Len() > 0 {
			t.Logf("peer stderr:\n%s", stderr.String())
		}
	})
	line := make(chan string, 1)
	go func() {
		s, _ := bufio.NewReader(stdout).ReadString('\n')
		line <- strings.TrimSpace(s)
		io.Copy(io.Discard, stdout)
	}()
	if want == "" {
		return cmd, stdin
	}
	select {
	case got := <-line:
		if got != want {
			t.Fatalf("peer said %q, want %q; stderr:\n%s", got, want, stderr.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("peer did not say %q; stderr:\n%s", want, stderr.String())
	}
	return cmd, stdin
}

// orderingPattern is the peer's byte sequence for stream id.
func orderingPattern(id uint32, size int) []byte {
	p := make([]byte, size)
	start := int(13*id) % 251
	for i := range p {
		p[i] = byte((start + i) % 251)
	}
	return p
}

// readToEnd reads a stream until it ends and checks it got exactly want,
// then a clean end of stream (and nothing after it).
func readToEnd(st *Stream, want []byte) error {
	st.SetReadDeadline(time.Now().Add(30 * time.Second))
	got := make([]byte, 0, len(want))
	buf := make([]byte, 256<<10)
	for {
		n, err := st.Read(buf)
		got = append(got, buf[:n]...)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("stream %d: after %d of %d bytes: %w", st.ID(), len(got), len(want), err)
		}
	}
	if len(got) != len(want) {
		return fmt.Errorf("stream %d: %d bytes then end of stream, want %d (lost %d)", st.ID(), len(got), len(want), len(want)-len(got))
	}
	if !bytes.Equal(got, want) {
		i := 0
		for got[i] == want[i] {
			i++
		}
		return fmt.Errorf("stream %d: byte %d is %d, want %d", st.ID(), i, got[i], want[i])
	}
	if n, err := st.Read(buf); n != 0 || !errors.Is(err, io.EOF) {
		return fmt.Errorf("stream %d: after the end of stream Read returned %d bytes, %v", st.ID(), n, err)
	}
	return nil
}

// Our client against a server that replies by FallbackData and then closes
// with a queue element, 100 times, with and without spinning.
func TestOrderingFallbackThenCloseClient(t *testing.T) {
	for _, spin := range []time.Duration{0, DefaultConfig().ConsumerSpinTime} {
		t.Run(fmt.Sprintf("spin=%v", spin), func(t *testing.T) {
			sock := filepath.Join(t.TempDir(), "peer.sock")
			orderingPeer(t, "ready", "server", sock)
			conf := DefaultConfig()
			conf.ConsumerSpinTime = spin
			conf.ShareMemoryPathPrefix = shmPrefix(t, "order")
			s, err := Dial("unix", sock, conf)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			for k := 0; k < 100; k++ {
				size := 1<<20 + k*(48<<10) // 1 to ~5.6 MiB, one to two frames each
				st, err := s.OpenStream()
				if err != nil {
					t.Fatal(err)
				}
				var req [8]byte
				binary.BigEndian.PutUint64(req[:], uint64(size))
				if _, err := st.Write(req[:]); err != nil {
					t.Fatal(err)
				}
				err = readToEnd(st, orderingPattern(st.ID(), size))
				st.Close()
				if err != nil {
					t.Fatalf("round %d: %v", k, err)
				}
			}
		})
	}
}

// Our server against a client that sends each stream's bytes by
// FallbackData and closes it with a queue element right after, 100 streams.
func TestOrderingFallbackThenCloseServer(t *testing.T) {
	for _, mode := range []string{"memfd", "file"} {
		t.Run(mode, func(t *testing.T) {
			const streams, size = 100, 1 << 20
			conf := DefaultConfig()
			conf.ShareMemoryPathPrefix = "/dev/shm/shmipc_order" // the peer's names
			ln, err := Listen("unix", filepath.Join(t.TempDir(), "srv.sock"), conf)
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			var mu sync.Mutex
			var errs []error
			var wg sync.WaitGroup
			wg.Add(streams)
			go func() {
				for k := 0; k < streams; k++ {
					st, err := ln.AcceptStream()
					if err != nil {
						mu.Lock()
						errs = append(errs, err)
						mu.Unlock()
						for ; k < streams; k++ {
							wg.Done()
						}
						return
					}
					go func(k int) {
						defer wg.Done()
						defer st.Close()
						// Streams are opened in order: the k-th has id k+2.
						if err := readToEnd(st, orderingPattern(st.ID(), size+37*int(st.ID()-2))); err != nil {
							mu.Lock()
							errs = append(errs, err)
							mu.Unlock()
						}
					}(k)
				}
			}()
			_, stdin := orderingPeer(t, "", "client", ln.Addr().String(), mode, fmt.Sprint(streams), fmt.Sprint(size))
			done := make(chan struct{})
			go func() { wg.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(2 * time.Minute):
				t.Fatal("the streams did not all end within 2 minutes")
			}
			stdin.Close()
			mu.Lock()
			defer mu.Unlock()
			for _, err := range errs {
				t.Error(err)
			}
		})
	}
}

// Command hotrestart shows a hot restart (docs/protocol.md §10): a client keeps
// sending echo requests through a SessionManager while server v1 hands its
// socket over to server v2, and not one request fails.
//
//	go run ./example/hotrestart
//
// The demo runs three processes: this one (the client and the operator), and
// the two servers, which are this program re-executed with HOTRESTART_ROLE
// set. The steps:
//
//  1. v1 listens on the socket path (shmipc.ListenTakeover) and serves.
//  2. The client starts a SessionManager and sends requests in a loop.
//  3. v2 starts and takes over the path: it binds a fresh socket and renames
//     it over the old one, so new connections reach v2 from then on.
//  4. The operator tells v1 (SIGUSR1, standing in for any out-of-band
//     channel) to hand over: v1 calls HotRestart(epoch), which sends a
//     HotRestart frame on every session; the SessionManager dials new
//     sessions (they reach v2), moves its traffic to them and acknowledges
//     on the old ones; WaitHotRestart returns when all acknowledged, and v1
//     closes its listener and exits.
//  5. The client goes on against v2; the demo prints what each side saw and
//     exits 0 if no request failed.
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/goshm/shmipc"
)

const epoch = 1

func main() {
	log.SetFlags(log.Lmicroseconds)
	if os.Getenv("HOTRESTART_ROLE") == "server" {
		serve(os.Getenv("HOTRESTART_SOCK"), os.Getenv("HOTRESTART_NAME"))
		return
	}
	if err := demo(); err != nil {
		log.Printf("demo failed: %v", err)
		os.Exit(1)
	}
}

// serve is a server process: it takes over sock, serves the echo, hands over
// on SIGUSR1 and exits on SIGTERM or after a hand-over.
func serve(sock, name string) {
	logf := func(format string, a ...any) {
		log.Printf("[%s pid %d] %s", name, os.Getpid(), fmt.Sprintf(format, a...))
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGUSR1, syscall.SIGTERM)
	ln, err := shmipc.ListenTakeover(sock, nil)
	if err != nil {
		logf("listen: %v", err)
		os.Exit(1)
	}
	var requests atomic.Int64
	go ln.Serve(func(st *shmipc.Stream) {
		hdr := make([]byte, 4)
		for {
			if _, err := io.ReadFull(st, hdr); err != nil {
				return
			}
			body, err := st.BufferReader().ReadBytes(int(binary.BigEndian.Uint32(hdr)))
			if err != nil {
				return
			}
			w := st.BufferWriter()
			w.WriteBytes(hdr)
			w.WriteBytes(body)
			if st.Flush(false) != nil {
				return
			}
			requests.Add(1)
		}
	})
	logf("listening on %s", sock)
	fmt.Println("ready")
	for sig := range sigs {
		if sig == syscall.SIGTERM {
			break
		}
		var err error
		for range 50 { // a handshake may be running: try again shortly
			if err = ln.HotRestart(epoch); !errors.Is(err, shmipc.ErrHotRestartHandshaking) {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		if err == nil {
			logf("HotRestart(%d) sent; waiting for the acknowledgements", epoch)
			err = ln.WaitHotRestart(context.Background())
		}
		if err != nil {
			logf("hot restart failed: %v", err)
			continue // keep serving; the operator may try again
		}
		logf("every session acknowledged epoch %d; closing", epoch)
		fmt.Println("handed-over")
		break
	}
	ln.Close()
	logf("served %d requests", requests.Load())
	fmt.Printf("served %d\n", requests.Load())
}

// server is a running server process.
type server struct {
	name  string
	cmd   *exec.Cmd
	lines chan string
}

func startServer(sock, name string) (*server, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), "HOTRESTART_ROLE=server", "HOTRESTART_SOCK="+sock, "HOTRESTART_NAME="+name)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	s := &server{name: name, cmd: cmd, lines: make(chan string, 16)}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			s.lines <- sc.Text()
		}
		close(s.lines)
	}()
	if _, err := s.expect("ready", 20*time.Second); err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return nil, err
	}
	return s, nil
}

// expect waits for a line starting with prefix.
func (s *server) expect(prefix string, d time.Duration) (string, error) {
	t := time.After(d)
	for {
		select {
		case line, ok := <-s.lines:
			if !ok {
				return "", fmt.Errorf("%s exited before printing %q", s.name, prefix)
			}
			if strings.HasPrefix(line, prefix) {
				return line, nil
			}
		case <-t:
			return "", fmt.Errorf("%s did not print %q within %v", s.name, prefix, d)
		}
	}
}

func demo() error {
	dir, err := os.MkdirTemp("", "shmipc-hotrestart-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "echo.sock")

	v1, err := startServer(sock, "server v1")
	if err != nil {
		return err
	}
	defer func() { v1.cmd.Process.Kill(); v1.cmd.Wait() }()

	m, err := shmipc.NewSessionManager(shmipc.SessionManagerConfig{Network: "unix", Address: sock, SessionNum: 2})
	if err != nil {
		return err
	}
	defer m.Close()

	var (
		stop     atomic.Bool
		ok, fail atomic.Int64
		wg       sync.WaitGroup
	)
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			msg := make([]byte, 4+256)
			binary.BigEndian.PutUint32(msg, 256)
			for i := 0; !stop.Load(); i++ {
				binary.BigEndian.PutUint64(msg[4:], uint64(w)<<32|uint64(i))
				if err := request(m, msg); err != nil {
					if fail.Add(1) <= 5 {
						log.Printf("[client] request failed: %v", err)
					}
				} else {
					ok.Add(1)
				}
				time.Sleep(500 * time.Microsecond)
			}
		}()
	}
	report := func(what string) { log.Printf("[client] %s: %d requests ok, %d failed", what, ok.Load(), fail.Load()) }

	time.Sleep(500 * time.Millisecond)
	report("against v1")
	v2, err := startServer(sock, "server v2")
	if err != nil {
		return err
	}
	defer func() { v2.cmd.Process.Kill(); v2.cmd.Wait() }()
	log.Printf("[operator] v2 has taken over %s; asking v1 to hand over", sock)
	if err := v1.cmd.Process.Signal(syscall.SIGUSR1); err != nil {
		return err
	}
	if _, err := v1.expect("handed-over", 10*time.Second); err != nil {
		return err
	}
	served1, err := v1.expect("served", 10*time.Second)
	if err != nil {
		return err
	}
	if err := v1.cmd.Wait(); err != nil {
		return fmt.Errorf("server v1: %w", err)
	}
	report("v1 has exited")
	mark := ok.Load()
	time.Sleep(time.Second)
	stop.Store(true)
	wg.Wait()
	report("done")
	completed, failed := m.HotRestarts()
	log.Printf("[client] hot restarts completed %d, timed out %d; %d requests after v1 exited", completed, failed, ok.Load()-mark)

	v2.cmd.Process.Signal(syscall.SIGTERM)
	served2, err := v2.expect("served", 10*time.Second)
	if err != nil {
		return err
	}
	if err := v2.cmd.Wait(); err != nil {
		return fmt.Errorf("server v2: %w", err)
	}
	log.Printf("[operator] v1 %s, v2 %s", served1, served2)
	switch {
	case fail.Load() != 0:
		return fmt.Errorf("%d requests failed", fail.Load())
	case completed != 1:
		return fmt.Errorf("the client completed %d hot restarts, want 1", completed)
	case ok.Load() == mark:
		return errors.New("no request after v1 exited")
	}
	log.Printf("OK: every request succeeded across the hand-over")
	return nil
}

// request sends one echo request on a pooled stream and checks the reply.
func request(m *shmipc.SessionManager, msg []byte) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := m.GetStreamContext(ctx)
	if err != nil {
		return err
	}
	st.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := st.Write(msg); err != nil {
		st.Close()
		return err
	}
	got, err := st.BufferReader().ReadBytes(len(msg))
	if err != nil {
		st.Close()
		return err
	}
	if !bytes.Equal(got, msg) {
		st.Close()
		return errors.New("echo differs")
	}
	m.PutBack(st)
	return nil
}

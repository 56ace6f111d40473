package main

// The server runs in a second process: this program (or the test binary)
// started again with roleEnv set. The parent passes its arguments in the
// environment, the child answers with one line "ready <addresses as JSON>"
// on stdout, serves until its stdin closes (a hard stop) or it receives
// SIGTERM (a graceful stop), and then exits.

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
)

// Environment of the child process.
const (
	roleEnv       = "SHMIPC_GRPC_EXAMPLE_ROLE" // "server" in the child
	dirEnv        = "SHMIPC_GRPC_EXAMPLE_DIR"  // where the sockets go
	optsEnv       = "SHMIPC_GRPC_EXAMPLE_OPTS" // option set name
	transportsEnv = "SHMIPC_GRPC_EXAMPLE_TRANSPORTS"
)

const roleServer = "server"

// childStartTimeout bounds the start of a server process: a race-enabled
// binary on a loaded two-core machine can be slow.
const childStartTimeout = 30 * time.Second

// runChildRole runs the role named in the environment, if any, and reports
// whether it did; the caller exits with code.
func runChildRole() (code int, ran bool) {
	if os.Getenv(roleEnv) != roleServer {
		return 0, false
	}
	if err := serveChild(); err != nil {
		fmt.Fprintln(os.Stderr, "server:", err)
		return 1, true
	}
	return 0, true
}

// serveChild is the server process: one gRPC server per transport.
func serveChild() error {
	opts, err := optionsByName(os.Getenv(optsEnv))
	if err != nil {
		return err
	}
	if path := os.Getenv(profileEnv); path != "" {
		stop, err := startCPUProfile(path)
		if err != nil {
			return err
		}
		defer stop()
	}
	dir := os.Getenv(dirEnv)
	addrs := map[string]string{}
	var servers []*grpc.Server
	impl := &echoServer{}
	serveErr := make(chan error, len(allTransports))
	for _, tr := range strings.Split(os.Getenv(transportsEnv), ",") {
		ln, addr, err := listen(tr, dir)
		if err != nil {
			return fmt.Errorf("listen %s: %w", tr, err)
		}
		srv := grpc.NewServer(opts.serverOptions(tr)...)
		srv.RegisterService(&echoServiceDesc, impl)
		servers = append(servers, srv)
		addrs[tr] = addr
		go func() { serveErr <- srv.Serve(ln) }()
	}
	line, _ := json.Marshal(addrs)
	fmt.Printf("ready %s\n", line)

	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM)
	stdinClosed := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		close(stdinClosed)
	}()
	select {
	case <-term:
		var wg sync.WaitGroup
		for _, srv := range servers {
			wg.Go(srv.GracefulStop)
		}
		wg.Wait()
		fmt.Println("stopped gracefully")
	case <-stdinClosed:
		for _, srv := range servers {
			srv.Stop()
		}
	case err := <-serveErr:
		return fmt.Errorf("serve: %w", err)
	}
	return nil
}

// serverProcess is a running server child.
type serverProcess struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	addrs map[string]string

	mu     sync.Mutex
	output bytes.Buffer // stdout after the ready line, and stderr
	done   chan struct{}
	err    error // of Wait, once done is closed
	killed bool  // by kill: stop reports no error
}

// startServer starts a server process serving transports with the option
// set opts, sockets in dir, and waits until it is ready.
func startServer(dir, opts string, transports []string) (*serverProcess, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	args := []string{}
	if strings.HasSuffix(exe, ".test") {
		args = append(args, "-test.run=^$") // a test binary runs no test in the child
	}
	cmd := exec.Command(exe, args...)
	cmd.Env = append(os.Environ(),
		roleEnv+"="+roleServer, dirEnv+"="+dir, optsEnv+"="+opts,
		transportsEnv+"="+strings.Join(transports, ","))
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	p := &serverProcess{cmd: cmd, done: make(chan struct{})}
	cmd.Stderr = &lockedWriter{p: p}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if p.stdin, err = cmd.StdinPipe(); err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	ready := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		first := true
		for sc.Scan() {
			if first {
				ready <- sc.Text()
				first = false
				continue
			}
			p.mu.Lock()
			p.output.WriteString(sc.Text() + "\n")
			p.mu.Unlock()
		}
		if first {
			close(ready)
		}
		err := cmd.Wait()
		p.mu.Lock()
		p.err = err
		p.mu.Unlock()
		close(p.done)
	}()
	select {
	case line, ok := <-ready:
		addrs, found := strings.CutPrefix(line, "ready ")
		if ok && found && json.Unmarshal([]byte(addrs), &p.addrs) == nil {
			return p, nil
		}
		p.kill()
		return nil, fmt.Errorf("server did not start (%q): %s", line, p.Output())
	case <-time.After(childStartTimeout):
		p.kill()
		return nil, fmt.Errorf("server not ready after %v: %s", childStartTimeout, p.Output())
	}
}

// lockedWriter appends to the process's output.
type lockedWriter struct{ p *serverProcess }

func (w *lockedWriter) Write(b []byte) (int, error) {
	w.p.mu.Lock()
	defer w.p.mu.Unlock()
	return w.p.output.Write(b)
}

// Output is what the process printed after its ready line.
func (p *serverProcess) Output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.output.String()
}

// wait waits for the process to exit and returns its exit error.
func (p *serverProcess) wait(timeout time.Duration) error {
	select {
	case <-p.done:
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.err
	case <-time.After(timeout):
		return errors.New("server process did not exit in time")
	}
}

// stop closes the process's stdin (a hard stop) and waits for it to exit;
// it kills it if it does not.
func (p *serverProcess) stop() error {
	p.mu.Lock()
	killed := p.killed
	p.mu.Unlock()
	if killed {
		return nil
	}
	p.stdin.Close()
	err := p.wait(10 * time.Second)
	if err != nil {
		p.kill()
	}
	return err
}

// terminate asks for a graceful stop.
func (p *serverProcess) terminate() error { return p.cmd.Process.Signal(syscall.SIGTERM) }

// kill kills the process and waits for it.
func (p *serverProcess) kill() {
	p.mu.Lock()
	p.killed = true
	p.mu.Unlock()
	_ = p.cmd.Process.Kill()
	<-p.done
}

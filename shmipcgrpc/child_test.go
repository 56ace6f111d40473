package shmipcgrpc_test

// The server runs in a second process: the test binary started again with
// roleEnv set. It serves the Echo service on every transport of
// transportsEnv, prints one line "ready <addresses as JSON>", and serves
// until its stdin closes.

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/goshm/shmipc"
	"github.com/goshm/shmipc/shmipcgrpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/local"
)

const (
	roleEnv       = "SHMIPCGRPC_TEST_ROLE" // "server" in the child
	dirEnv        = "SHMIPCGRPC_TEST_DIR"
	transportsEnv = "SHMIPCGRPC_TEST_TRANSPORTS"
)

// Transports a server process serves.
const (
	shmUnix = "shm-unix" // shmipc over a Unix socket, shmipcgrpc's options
	shmTCP  = "shm-tcp"  // shmipc over TCP loopback, shmipcgrpc's options
	uds     = "uds"      // a Unix socket, gRPC's defaults
)

func TestMain(m *testing.M) {
	if os.Getenv(roleEnv) == "server" {
		if err := serveChild(); err != nil {
			fmt.Fprintln(os.Stderr, "server:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	code := m.Run()
	stopBenchServer()
	os.Exit(code)
}

// serveChild is the server process.
func serveChild() error {
	dir := os.Getenv(dirEnv)
	addrs := map[string]string{}
	serveErr := make(chan error, 3)
	var servers []*grpc.Server
	for _, tr := range strings.Split(os.Getenv(transportsEnv), ",") {
		var ln net.Listener
		var err error
		opts := []grpc.ServerOption{grpc.Creds(local.NewCredentials())}
		switch tr {
		case shmUnix:
			ln, err = shmipc.Listen("unix", filepath.Join(dir, "shm.sock"), nil)
			opts = append(shmipcgrpc.ServerOptions(), opts...)
		case shmTCP:
			ln, err = shmipc.Listen("tcp", "127.0.0.1:0", nil)
			opts = append(shmipcgrpc.ServerOptions(), opts...)
		case uds:
			ln, err = net.Listen("unix", filepath.Join(dir, "grpc.sock"))
		default:
			err = fmt.Errorf("unknown transport %q", tr)
		}
		if err != nil {
			return err
		}
		srv := grpc.NewServer(opts...)
		srv.RegisterService(&echoDesc, nil)
		servers = append(servers, srv)
		addrs[tr] = ln.Addr().String()
		go func() { serveErr <- srv.Serve(ln) }()
	}
	line, err := json.Marshal(addrs)
	if err != nil {
		return err
	}
	fmt.Printf("ready %s\n", line)
	stdinClosed := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		close(stdinClosed)
	}()
	select {
	case <-stdinClosed:
	case err := <-serveErr:
		return fmt.Errorf("serve: %w", err)
	}
	for _, srv := range servers {
		srv.Stop()
	}
	return nil
}

// serverProcess is a running server child.
type serverProcess struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	dir   string
	addrs map[string]string
	done  chan error // the exit error, once it exited
}

// startServer starts a server process for transports and waits until it
// is ready.
func startServer(transports ...string) (*serverProcess, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	// Short: a Unix socket path is limited to 108 bytes.
	dir, err := os.MkdirTemp("", fmt.Sprintf("shmipcgrpc-%d-", os.Getpid()))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe, "-test.run=^$", "-test.bench=^$")
	cmd.Env = append(os.Environ(), roleEnv+"=server", dirEnv+"="+dir,
		transportsEnv+"="+strings.Join(transports, ","))
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	p := &serverProcess{cmd: cmd, dir: dir, done: make(chan error, 1)}
	stdout, err := cmd.StdoutPipe()
	if err == nil {
		p.stdin, err = cmd.StdinPipe()
	}
	if err == nil {
		err = cmd.Start()
	}
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	ready := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		if sc.Scan() {
			ready <- sc.Text()
		}
		close(ready)
		_, _ = io.Copy(io.Discard, stdout)
		p.done <- cmd.Wait()
	}()
	// Generous: a race-enabled binary on a loaded machine starts slowly.
	timeout := time.After(60 * time.Second)
	select {
	case line := <-ready:
		addrs, found := strings.CutPrefix(line, "ready ")
		if found && json.Unmarshal([]byte(addrs), &p.addrs) == nil {
			return p, nil
		}
		p.kill()
		return nil, fmt.Errorf("the server process did not start: %q", line)
	case <-timeout:
		p.kill()
		return nil, fmt.Errorf("the server process was not ready in time")
	}
}

// stop closes the process's stdin and waits for it to exit.
func (p *serverProcess) stop() error {
	p.stdin.Close()
	defer os.RemoveAll(p.dir)
	select {
	case err := <-p.done:
		return err
	case <-time.After(30 * time.Second):
		p.kill()
		return fmt.Errorf("the server process did not exit in time")
	}
}

func (p *serverProcess) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
	os.RemoveAll(p.dir)
}

// startTestServer starts a server process for a test and stops it at the
// test's end.
func startTestServer(t testing.TB, transports ...string) *serverProcess {
	t.Helper()
	p, err := startServer(transports...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.stop(); err != nil {
			t.Errorf("server process: %v", err)
		}
	})
	return p
}

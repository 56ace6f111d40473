package shmipc

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"go/build"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The programs under testdata are written for shmipc-go, with only the
// import path changed, in the shapes of its published examples.
var programs = []string{
	"helloworld_server", "helloworld_client",
	"sync_server", "sync_client",
	"callback_server", "callback_client",
	"hotrestart_server", "hotrestart_client",
}

// goTool returns the go command that built this test.
func goTool(t *testing.T) string {
	if p := filepath.Join(build.Default.GOROOT, "bin", "go"); build.Default.GOROOT != "" {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	p, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("no go command: %v", err)
	}
	return p
}

// buildPrograms vets the programs and builds them into a directory, which
// it returns.
func buildPrograms(t *testing.T) string {
	t.Helper()
	goCmd := goTool(t)
	var pkgs []string
	for _, p := range programs {
		pkgs = append(pkgs, "./testdata/"+p)
	}
	bin := t.TempDir()
	for _, args := range [][]string{append([]string{"vet"}, pkgs...), append([]string{"build", "-o", bin}, pkgs...)} {
		cmd := exec.Command(goCmd, args...)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go %s: %v\n%s", args[0], err, out)
		}
	}
	return bin
}

// server is a running example server.
type server struct {
	cmd   *exec.Cmd
	lines chan string
	all   bytes.Buffer
}

// startServer runs program in dir and waits for its "listening" line.
func startServer(t *testing.T, bin, dir, program string) *server {
	t.Helper()
	s := &server{cmd: exec.Command(filepath.Join(bin, program)), lines: make(chan string, 100)}
	s.cmd.Dir = dir
	// A hot restart's new server keeps the old one's stdout and stderr.
	s.cmd.WaitDelay = time.Second
	pipe, err := s.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	s.cmd.Stderr = &s.all
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.cmd.Process.Kill(); s.cmd.Wait() })
	go func() {
		sc := bufio.NewScanner(pipe)
		for sc.Scan() {
			s.lines <- sc.Text()
		}
		close(s.lines)
	}()
	s.expect(t, "listening")
	return s
}

// expect waits for a line of the server's that starts with prefix, and
// returns it.
func (s *server) expect(t *testing.T, prefix string) string {
	t.Helper()
	timeout := time.After(30 * time.Second)
	for {
		select {
		case line, ok := <-s.lines:
			if !ok {
				t.Fatalf("%s ended without printing %q\n%s", s.cmd.Path, prefix, s.all.String())
			}
			if strings.HasPrefix(line, prefix) {
				return line
			}
		case <-timeout:
			t.Fatalf("%s did not print %q", s.cmd.Path, prefix)
		}
	}
}

// runClient runs program in dir with args and returns its output.
func runClient(t *testing.T, bin, dir, program string, args ...string) string {
	t.Helper()
	cmd := exec.Command(filepath.Join(bin, program), args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", program, err, out)
	}
	return string(out)
}

// TestPrograms: the shmipc-go style programs build and vet, and each
// client/server pair works across processes, the hot restart pair through
// a restart.
func TestPrograms(t *testing.T) {
	bin := buildPrograms(t)
	t.Run("helloworld", func(t *testing.T) {
		dir := t.TempDir()
		srv := startServer(t, bin, dir, "helloworld_server")
		out := runClient(t, bin, dir, "helloworld_client")
		if strings.Count(out, "client receive response message:server hello world!!!") != 3 {
			t.Errorf("client output:\n%s", out)
		}
		for range 3 {
			srv.expect(t, "server receive request message:client say hello world!!!")
		}
		if line := srv.expect(t, "server stream ended:"); line != "server stream ended: true" {
			t.Errorf("server: %q", line)
		}
	})
	t.Run("sync", func(t *testing.T) {
		dir := t.TempDir()
		startServer(t, bin, dir, "sync_server")
		if out := runClient(t, bin, dir, "sync_client", "-n", "300"); !strings.Contains(out, "done 1200") {
			t.Errorf("client output:\n%s", out)
		}
	})
	t.Run("callback", func(t *testing.T) {
		dir := t.TempDir()
		srv := startServer(t, bin, dir, "callback_server")
		if out := runClient(t, bin, dir, "callback_client", "-n", "500"); !strings.Contains(out, "done 500 true") {
			t.Errorf("client output:\n%s", out)
		}
		srv.cmd.Process.Signal(syscall.SIGTERM)
		srv.expect(t, "OnShutdown reason:")
	})
	t.Run("hotrestart", func(t *testing.T) {
		dir := t.TempDir()
		srv := startServer(t, bin, dir, "hotrestart_server")
		cmd := exec.Command(filepath.Join(bin, "hotrestart_client"), "-d", "3s")
		cmd.Dir = dir
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Second)
		srv.cmd.Process.Signal(syscall.SIGUSR1)
		line := srv.expect(t, "listening 1 ")
		var pid int
		if _, err := fmt.Sscanf(line, "listening 1 %d", &pid); err != nil {
			t.Fatalf("%q: %v", line, err)
		}
		defer syscall.Kill(pid, syscall.SIGKILL)
		srv.expect(t, "hot restart done")
		if err := cmd.Wait(); err != nil {
			t.Fatalf("client: %v\n%s", err, out.String())
		}
		var requests, failures int
		if _, err := fmt.Sscanf(out.String(), "requests %d failures %d", &requests, &failures); err != nil || failures != 0 || requests < 100 {
			t.Errorf("client: %q", out.String())
		}
		if err := srv.cmd.Wait(); err != nil && !errors.Is(err, exec.ErrWaitDelay) {
			t.Errorf("old server: %v", err)
		}
		if err := syscall.Kill(pid, 0); err != nil {
			t.Errorf("new server gone: %v", err)
		}
	})
}

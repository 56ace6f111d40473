package interop

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// refProc is a running reference program, a child of the test process.
type refProc struct {
	t    *testing.T
	cmd  *exec.Cmd
	done chan struct{} // closed when the process has exited
	err  error         // its exit status, once done

	mu    sync.Mutex
	out   bytes.Buffer // everything it printed, stdout and stderr
	lines []string     // its stdout, line by line
	more  chan struct{}
}

// startRef starts bin with args and the environment the references need.
// The process is killed (by its pid) and waited for when the test ends.
func startRef(t *testing.T, bin string, args ...string) *refProc {
	t.Helper()
	cmd := exec.Command(bin, args...)
	// SHMIPC_DEBUG_MODE: both references refuse new streams for 30 s after
	// a session carried fallback data, unless it is set.
	cmd.Env = append(os.Environ(), "SHMIPC_DEBUG_MODE=1", "SHMIPC_LOG_LEVEL=4", "RUST_LOG=error")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	p := &refProc{t: t, cmd: cmd, done: make(chan struct{}), more: make(chan struct{})}
	cmd.Stderr = &lockedWriter{p}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", bin, err)
	}
	go func() {
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			p.mu.Lock()
			p.lines = append(p.lines, sc.Text())
			p.out.WriteString(sc.Text() + "\n")
			close(p.more)
			p.more = make(chan struct{})
			p.mu.Unlock()
		}
		p.err = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.kill()
		if t.Failed() {
			t.Logf("%s %s (pid %d) printed:\n%s", filepath.Base(bin), strings.Join(args, " "), p.pid(), p.output())
		}
	})
	return p
}

type lockedWriter struct{ p *refProc }

func (w *lockedWriter) Write(b []byte) (int, error) {
	w.p.mu.Lock()
	defer w.p.mu.Unlock()
	return w.p.out.Write(b)
}

func (p *refProc) pid() int { return p.cmd.Process.Pid }

func (p *refProc) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.String()
}

// kill ends the process with SIGKILL, by its pid, and waits for it.
func (p *refProc) kill() {
	select {
	case <-p.done:
		return
	default:
	}
	p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// waitLine waits for a stdout line for which match is true and returns it.
func (p *refProc) waitLine(timeout time.Duration, match func(string) bool) (string, error) {
	deadline := time.After(timeout)
	seen := 0
	for {
		p.mu.Lock()
		lines, more := p.lines, p.more
		p.mu.Unlock()
		for ; seen < len(lines); seen++ {
			if match(lines[seen]) {
				return lines[seen], nil
			}
		}
		select {
		case <-more:
		case <-p.done:
			p.mu.Lock()
			n := len(p.lines)
			p.mu.Unlock()
			if seen == n {
				return "", fmt.Errorf("the process exited (%v) without the line", p.err)
			}
		case <-deadline:
			return "", fmt.Errorf("no such line within %v", timeout)
		}
	}
}

// wait waits for the process to exit and returns its exit error.
func (p *refProc) wait(timeout time.Duration) error {
	select {
	case <-p.done:
		return p.err
	case <-time.After(timeout):
		p.kill()
		return fmt.Errorf("still running after %v: killed", timeout)
	}
}

// rss returns the resident set size of the process in bytes.
func (p *refProc) rss() (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.pid()))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb << 10, err
		}
	}
	return 0, fmt.Errorf("no VmRSS in /proc/%d/status", p.pid())
}

// names are the unique names of one cell: its socket, and the prefix of
// the shared-memory files its clients create, both with this process's pid
// and random bytes.
type names struct {
	dir    string // a temporary directory holding the socket
	sock   string
	prefix string // /dev/shm/<unique>
}

func newNames(t *testing.T) names {
	t.Helper()
	var b [4]byte
	rand.Read(b[:])
	tag := fmt.Sprintf("ipt%d_%s", os.Getpid(), hex.EncodeToString(b[:]))
	dir, err := os.MkdirTemp("", tag+"-")
	if err != nil {
		t.Fatal(err)
	}
	n := names{dir: dir, sock: filepath.Join(dir, "s.sock"), prefix: "/dev/shm/" + tag}
	t.Cleanup(func() {
		os.RemoveAll(dir)
		n.removeShm()
	})
	return n
}

func (n names) shmFiles() []string {
	files, _ := filepath.Glob(n.prefix + "*")
	return files
}

func (n names) removeShm() {
	for _, f := range n.shmFiles() {
		os.Remove(f)
	}
}

// expectNoShm checks that nothing named with the cell's prefix is left in
// /dev/shm, allowing the peers a moment to unlink their files after their
// sessions end.
func (n names) expectNoShm(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for {
		files := n.shmFiles()
		if len(files) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("left in /dev/shm: %v", files)
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

package proctest

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// ----------------------------------------------------------------------------
// Parent side

// Config describes a child to start.
type Config struct {
	// TestName is the test function of this binary that runs the role. It
	// is matched exactly (-test.run=^TestName$). Required.
	TestName string
	// Role is the value of RoleEnv in the child. Required.
	Role string
	// Args are passed to the child as the environment variables
	// ArgEnvPrefix+name; the child reads them with Arg.
	Args map[string]string
	// Env holds extra "KEY=value" environment entries for the child.
	Env []string
	// Timeout is the child's self-destruct timeout (-test.timeout). Zero
	// means DefaultTimeout.
	Timeout time.Duration
	// ExtraFiles are open files the child inherits as descriptors 3, 4 and
	// so on (exec.Cmd.ExtraFiles); the caller still owns and closes them.
	ExtraFiles []*os.File
	// Credential, if set, runs the child as that user and group (the parent
	// must be root). The test binary usually lies in a build directory only
	// its owner can enter, so Start then runs a copy of it from a fresh
	// directory anyone may read, which is also the child's working
	// directory, and removes it when the test ends.
	Credential *syscall.Credential
}

// Child is a running (or finished) child process.
type Child struct {
	t     testing.TB
	cfg   Config
	cmd   *exec.Cmd
	stdin io.WriteCloser
	start time.Time

	done    chan struct{} // closed once the child has exited and its output is in
	waitErr error         // cmd.Wait's result; set before done is closed

	mu      sync.Mutex
	stdout  bytes.Buffer // everything written to stdout
	stderr  bytes.Buffer // everything written to stderr
	partial []byte       // stdout bytes after the last newline
	lines   []string     // complete stdout lines
	next    int          // the next line ReadLine returns
	changed chan struct{}
	killed  bool
}

// Start starts the child described by cfg and registers a cleanup that
// kills it if it is still running when the test ends and, if the test
// failed, logs its output. A failure to start the child fails the test.
func Start(t testing.TB, cfg Config) *Child {
	t.Helper()
	if cfg.TestName == "" || cfg.Role == "" {
		t.Fatalf("proctest: Config needs a TestName and a Role")
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultTimeout
	}
	exe, err := os.Executable()
	if err != nil {
		exe = os.Args[0]
	}
	var dir string
	if cfg.Credential != nil {
		if dir, exe, err = publicCopy(t, exe); err != nil {
			t.Fatalf("proctest: %v", err)
		}
	}
	cmd := exec.Command(exe,
		"-test.run=^"+cfg.TestName+"$",
		"-test.count=1",
		"-test.timeout="+cfg.Timeout.String(),
	)
	env := make([]string, 0, len(os.Environ())+len(cfg.Args)+len(cfg.Env)+1)
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, RoleEnv+"=") || strings.HasPrefix(kv, ArgEnvPrefix) {
			continue // never pass on a role or arguments of our own
		}
		env = append(env, kv)
	}
	env = append(env, RoleEnv+"="+cfg.Role)
	for k, v := range cfg.Args {
		env = append(env, ArgEnvPrefix+k+"="+v)
	}
	cmd.Env = append(env, cfg.Env...)
	cmd.ExtraFiles = cfg.ExtraFiles
	if cfg.Credential != nil {
		cmd.Dir = dir
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cfg.Credential}
	}

	c := &Child{t: t, cfg: cfg, cmd: cmd, done: make(chan struct{}), changed: make(chan struct{})}
	cmd.Stdout = stdoutWriter{c}
	cmd.Stderr = stderrWriter{c}
	cmd.WaitDelay = waitDelay
	if c.stdin, err = cmd.StdinPipe(); err != nil {
		t.Fatalf("proctest: stdin pipe: %v", err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("proctest: start child %s (role %s): %v", exe, cfg.Role, err)
	}
	c.start = time.Now()
	go func() {
		err := cmd.Wait()
		c.mu.Lock()
		if len(c.partial) > 0 {
			c.lines = append(c.lines, string(c.partial))
			c.partial = nil
		}
		c.waitErr = err
		c.mu.Unlock()
		close(c.done)
	}()
	t.Cleanup(func() {
		if !c.exited() {
			_ = c.Kill()
			select {
			case <-c.done:
			case <-time.After(10 * time.Second):
				t.Errorf("proctest: child %d (role %s) did not exit after SIGKILL", c.Pid(), cfg.Role)
			}
		}
		if t.Failed() {
			t.Logf("proctest: output of child %d (role %s):\n%s", c.Pid(), cfg.Role, c.Output())
		}
	})
	return c
}

// publicCopy copies the executable exe into a new directory that every user
// may enter and returns both; the directory is removed when the test ends.
func publicCopy(t testing.TB, exe string) (dir, copied string, err error) {
	dir, err = os.MkdirTemp("", "proctest-")
	if err != nil {
		return "", "", err
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		return "", "", err
	}
	src, err := os.Open(exe)
	if err != nil {
		return "", "", err
	}
	defer src.Close()
	copied = filepath.Join(dir, filepath.Base(exe))
	dst, err := os.OpenFile(copied, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o755)
	if err != nil {
		return "", "", err
	}
	if _, err := io.Copy(dst, src); err != nil {
		dst.Close()
		return "", "", fmt.Errorf("copy %s: %w", exe, err)
	}
	if err := dst.Close(); err != nil {
		return "", "", err
	}
	return dir, copied, nil
}

type stdoutWriter struct{ c *Child }

func (w stdoutWriter) Write(p []byte) (int, error) {
	c := w.c
	c.mu.Lock()
	defer c.mu.Unlock()
	c.stdout.Write(p)
	c.partial = append(c.partial, p...)
	grew := false
	for {
		i := bytes.IndexByte(c.partial, '\n')
		if i < 0 {
			break
		}
		c.lines = append(c.lines, strings.TrimSuffix(string(c.partial[:i]), "\r"))
		c.partial = c.partial[i+1:]
		grew = true
	}
	if grew {
		close(c.changed)
		c.changed = make(chan struct{})
	}
	return len(p), nil
}

type stderrWriter struct{ c *Child }

func (w stderrWriter) Write(p []byte) (int, error) {
	w.c.mu.Lock()
	defer w.c.mu.Unlock()
	return w.c.stderr.Write(p)
}

// Pid returns the child's process id.
func (c *Child) Pid() int { return c.cmd.Process.Pid }

// Done returns a channel that is closed once the child has exited.
func (c *Child) Done() <-chan struct{} { return c.done }

func (c *Child) exited() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// ReadLine returns the next line the child printed on stdout, waiting up to
// timeout for it. It fails with io.EOF once the child has exited and every
// line has been read, and with an error wrapping ErrTimeout on timeout.
func (c *Child) ReadLine(timeout time.Duration) (string, error) {
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	for {
		c.mu.Lock()
		if c.next < len(c.lines) {
			line := c.lines[c.next]
			c.next++
			c.mu.Unlock()
			return line, nil
		}
		changed := c.changed
		c.mu.Unlock()
		if c.exited() {
			c.mu.Lock()
			more := c.next < len(c.lines)
			c.mu.Unlock()
			if more {
				continue
			}
			return "", fmt.Errorf("proctest: child exited (%v): %w", c.exitErr(), io.EOF)
		}
		select {
		case <-changed:
		case <-c.done:
		case <-timer.C:
			return "", fmt.Errorf("%w: no line on stdout within %v", ErrTimeout, timeout)
		}
	}
}

// WaitReady reads stdout lines until the child prints its ReadyLine, and
// returns the information that follows it on the line ("" if none). Other
// lines before it are skipped (they stay in Output). It fails if the child
// exits or timeout passes first.
func (c *Child) WaitReady(timeout time.Duration) (string, error) {
	deadline := time.Now().Add(timeout)
	for {
		line, err := c.ReadLine(time.Until(deadline))
		if err != nil {
			return "", fmt.Errorf("waiting for %q from child %d (role %s): %w", ReadyLine, c.Pid(), c.cfg.Role, err)
		}
		if line == ReadyLine {
			return "", nil
		}
		if info, ok := strings.CutPrefix(line, ReadyLine+" "); ok {
			return info, nil
		}
	}
}

// CloseStdin closes the child's stdin; a child waiting on StdinClosed then
// finishes.
func (c *Child) CloseStdin() error { return c.stdin.Close() }

// Signal sends sig to the child, unless it has already exited.
func (c *Child) Signal(sig os.Signal) error {
	if c.exited() {
		return nil
	}
	if sig == syscall.SIGKILL {
		c.mu.Lock()
		c.killed = true
		c.mu.Unlock()
	}
	err := c.cmd.Process.Signal(sig)
	if errors.Is(err, os.ErrProcessDone) {
		return nil
	}
	return err
}

// Kill kills the child with SIGKILL, unless it has already exited. It does
// not wait for it to exit; Wait does.
func (c *Child) Kill() error { return c.Signal(syscall.SIGKILL) }

// Wait waits up to timeout for the child to exit. It returns nil if the
// child exited with status 0, an error wrapping ErrTimeout if it is still
// running (it is left running), and otherwise an error saying how it ended.
func (c *Child) Wait(timeout time.Duration) error {
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-c.done:
		return c.exitErr()
	case <-t.C:
		return fmt.Errorf("%w: child %d (role %s) still running after %v", ErrTimeout, c.Pid(), c.cfg.Role, timeout)
	}
}

// Stop closes the child's stdin and waits up to timeout for it to exit with
// status 0. If it does not exit in time it is killed, and an error wrapping
// ErrTimeout is returned.
func (c *Child) Stop(timeout time.Duration) error {
	_ = c.CloseStdin()
	err := c.Wait(timeout)
	if errors.Is(err, ErrTimeout) {
		_ = c.Kill()
		<-c.done
	}
	return err
}

// exitErr describes how the exited child ended: nil for status 0.
func (c *Child) exitErr() error {
	c.mu.Lock()
	killed := c.killed
	c.mu.Unlock()
	if c.waitErr == nil {
		return nil
	}
	if killed {
		return fmt.Errorf("child %d (role %s) was killed: %w", c.Pid(), c.cfg.Role, c.waitErr)
	}
	return fmt.Errorf("child %d (role %s) failed: %w", c.Pid(), c.cfg.Role, c.waitErr)
}

// ExitCode returns the child's exit status, or -1 if it is still running or
// was ended by a signal.
func (c *Child) ExitCode() int {
	if !c.exited() {
		return -1
	}
	return c.cmd.ProcessState.ExitCode()
}

// Output returns what the child wrote so far, stdout then stderr, for
// failure messages.
func (c *Child) Output() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var b strings.Builder
	fmt.Fprintf(&b, "--- child %d, role %s, started %v ago", c.cmd.Process.Pid, c.cfg.Role, time.Since(c.start).Round(time.Millisecond))
	select {
	case <-c.done:
		fmt.Fprintf(&b, ", exited: %v", c.cmd.ProcessState)
	default:
		b.WriteString(", running")
	}
	b.WriteString("\n--- stdout:\n")
	b.Write(c.stdout.Bytes())
	b.WriteString("\n--- stderr:\n")
	b.Write(c.stderr.Bytes())
	b.WriteString("\n--- end of child output")
	return b.String()
}

// Lines returns every complete line the child printed on stdout so far.
func (c *Child) Lines() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.lines...)
}

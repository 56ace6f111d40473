package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"
)

// CPU hogs: with -hogs N, N child processes spin on a core each while the
// measurements run, so that the transports are compared on a machine
// whose cores are busy with other work, as on a loaded server. A hog is
// this program started again with the hidden first argument -hog; it runs
// one busy goroutine until its standard input ends (when this process
// stops it or dies) and gets SIGKILL from the kernel if this process dies.

// hogArg, as the first argument, makes the program a CPU hog.
const hogArg = "-hog"

// hog is a CPU hog child process.
type hog struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	once  sync.Once
}

// startHogs starts n CPU hogs and waits until each spins. If one fails to
// start, it stops those already started.
func startHogs(n int) ([]*hog, error) {
	var hogs []*hog
	for range n {
		h, err := startHog()
		if err != nil {
			stopHogs(hogs)
			return nil, fmt.Errorf("starting a CPU hog: %w", err)
		}
		hogs = append(hogs, h)
	}
	return hogs, nil
}

func startHog() (*hog, error) {
	cmd, err := selfCommand(syscall.SIGKILL, hogArg)
	if err != nil {
		return nil, err
	}
	cmd.Env = append(os.Environ(), "GOMAXPROCS=1")
	cmd.Stderr = os.Stderr
	h := &hog{cmd: cmd}
	if h.stdin, err = cmd.StdinPipe(); err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	track(h)
	// It says "spinning" once its loop runs.
	line := make(chan string, 1)
	go func() {
		var b [64]byte
		n, _ := io.ReadAtLeast(stdout, b[:], len("spinning\n"))
		line <- string(b[:n])
		io.Copy(io.Discard, stdout)
	}()
	select {
	case l := <-line:
		if strings.TrimSpace(l) == "spinning" {
			return h, nil
		}
		err = fmt.Errorf("it said %q", l)
	case <-time.After(10 * time.Second):
		err = errors.New("it did not report within 10 s")
	}
	h.stop()
	return nil, err
}

func (h *hog) pid() int { return h.cmd.Process.Pid }

// stop kills the hog and waits for it.
func (h *hog) stop() {
	h.once.Do(func() {
		h.cmd.Process.Kill()
		h.stdin.Close()
		h.cmd.Wait()
		untrack(h)
	})
}

func stopHogs(hogs []*hog) {
	for _, h := range hogs {
		h.stop()
	}
}

// hogsCPU is the CPU time the hogs have used altogether.
func hogsCPU(hogs []*hog) time.Duration {
	var sum time.Duration
	for _, h := range hogs {
		sum += procCPU(h.pid())
	}
	return sum
}

// hogMain is the CPU hog: it spins until its standard input ends.
func hogMain() {
	runtime.GOMAXPROCS(1)
	go func() {
		io.Copy(io.Discard, os.Stdin)
		os.Exit(0)
	}()
	fmt.Println("spinning")
	for n := uint64(1); ; n++ {
		if n%(1<<30) == 0 {
			runtime.Gosched() // not needed, but it keeps the loop's work visible to the compiler
		}
	}
}

// contention is the set of hogs of one run and what they used.
type contention struct {
	hogs  []*hog
	cpu0  time.Duration
	start time.Time
}

// startContention starts n hogs (none if n is 0).
func startContention(n int) (*contention, error) {
	hogs, err := startHogs(n)
	if err != nil {
		return nil, err
	}
	return &contention{hogs: hogs, cpu0: hogsCPU(hogs), start: time.Now()}, nil
}

// cores is how many cores' worth of CPU time the hogs have used so far.
func (c *contention) cores() float64 {
	if len(c.hogs) == 0 {
		return 0
	}
	return (hogsCPU(c.hogs) - c.cpu0).Seconds() / time.Since(c.start).Seconds()
}

// describe says how many hogs run, for the header.
func (c *contention) describe() string {
	if len(c.hogs) == 0 {
		return "no CPU hogs"
	}
	var pids []string
	for _, pid := range c.pids() {
		pids = append(pids, fmt.Sprint(pid))
	}
	if len(c.hogs) == 1 {
		return fmt.Sprintf("1 CPU hog (pid %s) competes for the cores", pids[0])
	}
	return fmt.Sprintf("%d CPU hogs (pids %s) compete for the cores", len(c.hogs), strings.Join(pids, ", "))
}

func (c *contention) stop() { stopHogs(c.hogs) }

// pids are the hogs' process ids.
func (c *contention) pids() []int {
	pids := make([]int, len(c.hogs))
	for i, h := range c.hogs {
		pids[i] = h.pid()
	}
	return pids
}

// summary says what the hogs got, for the last line ("" without hogs).
func (c *contention) summary(cores float64) string {
	if len(c.hogs) == 0 {
		return ""
	}
	return fmt.Sprintf(" · CPU time of the hogs: %.2f cores", cores)
}

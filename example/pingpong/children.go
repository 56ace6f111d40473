package main

import (
	"os"
	"os/exec"
	"sync"
	"syscall"
)

// The child processes this program starts (the echo server, CPU hogs) must
// not outlive it. Each is stopped by whoever started it, with a defer; an
// interrupt stops all that are still running (stopChildren); and every one
// gets a signal from the kernel when this process dies (Pdeathsig), in case
// it dies before it can do either.

// child is a process this program started.
type child interface {
	stop()
}

var (
	childrenMu sync.Mutex
	children   = map[child]struct{}{}
)

func track(c child) {
	childrenMu.Lock()
	children[c] = struct{}{}
	childrenMu.Unlock()
}

func untrack(c child) {
	childrenMu.Lock()
	delete(children, c)
	childrenMu.Unlock()
}

// stopChildren stops every child still running.
func stopChildren() {
	childrenMu.Lock()
	all := make([]child, 0, len(children))
	for c := range children {
		all = append(all, c)
	}
	childrenMu.Unlock()
	for _, c := range all {
		c.stop()
	}
}

// selfCommand is a command that runs this program again with args, and
// that the kernel sends sig if this process dies first.
func selfCommand(sig syscall.Signal, args ...string) (*exec.Cmd, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: sig}
	return cmd, nil
}

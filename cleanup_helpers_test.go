package shmipc

// Helpers of the cleanup tests, also used by other tests: snapshots of what
// the process holds (file descriptors, mappings, files under a prefix), an
// echo server in this process, and waiting for goroutines.

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// clSettle is how long a cleanup check polls before it fails: the server
// side tears its sessions down on its own goroutines.
const clSettle = 2 * time.Second

// clConfig is the configuration of the cleanup tests.
func clConfig(mode MemMapType, prefix string) *Config {
	conf := DefaultConfig()
	conf.MemMapType = mode
	conf.ShareMemoryPathPrefix = prefix
	conf.ShareMemoryBufferCap = 4 << 20 // many sessions at once: keep them small
	conf.BufferSliceSizes = ReferenceSliceSizes()
	// Three concurrent 1 MiB echoes hold more than such a region: each echo
	// server keeps its request while it writes the reply. Waiting for space
	// would deadlock until WriteSpaceTimeout; overflow goes as fallback data.
	conf.FallbackWhenFull = true
	return conf
}

// clFds returns the open file descriptors of process pid ("self" for this
// one) and what they refer to.
func clFds(pid string) (map[int]string, error) {
	dir := "/proc/" + pid + "/fd"
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	fds := make(map[int]string, len(ents))
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		target, err := os.Readlink(filepath.Join(dir, e.Name()))
		if err != nil {
			target = "(" + err.Error() + ")" // closed meanwhile, e.g. the ReadDir fd
		}
		fds[fd] = target
	}
	return fds, nil
}

// clMaps returns the lines of /proc/<pid>/maps that map a memfd of this
// package ("memfd:shmipc") and those that mention prefix (files under it, and
// memfds, which are named after it).
func clMaps(pid, prefix string) (memfd, ours []string, err error) {
	b, err := os.ReadFile("/proc/" + pid + "/maps")
	if err != nil {
		return nil, nil, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if strings.Contains(line, "memfd:"+memfdNamePrefix) {
			memfd = append(memfd, line)
		}
		if prefix != "" && strings.Contains(line, prefix) {
			ours = append(ours, line)
		}
	}
	return memfd, ours, nil
}

// clSnapshot is the state of this process's resources.
type clSnapshot struct {
	fds   map[int]string
	memfd []string // mappings of any shmipc memfd
	ours  []string // mappings naming the test's prefix
	files []string // files under the test's prefix
}

func clTake(t testing.TB, prefix string) clSnapshot {
	t.Helper()
	fds, err := clFds("self")
	if err != nil {
		t.Fatal(err)
	}
	memfd, ours, err := clMaps("self", prefix)
	if err != nil {
		t.Fatal(err)
	}
	return clSnapshot{fds: fds, memfd: memfd, ours: ours, files: shmFiles(prefix)}
}

// clWarmUp makes the runtime create what it creates once per process on
// first use of the network (the netpoller's epoll fd and its wake-up fd), so
// that it is part of a baseline taken afterwards.
func clWarmUp(t testing.TB) {
	t.Helper()
	ln, err := net.Listen("unix", filepath.Join(t.TempDir(), "warm.sock"))
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("unix", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	s, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	c.Close()
	ln.Close()
}

// clBaseline warms up, then returns the resources in use before the test
// does anything.
func clBaseline(t testing.TB, prefix string) clSnapshot {
	t.Helper()
	clWarmUp(t)
	base := clTake(t, prefix)
	if len(base.ours) > 0 || len(base.files) > 0 {
		t.Fatalf("prefix %s in use before the test: maps %q files %q", prefix, base.ours, base.files)
	}
	return base
}

// clCheckBack polls for up to clSettle until the fd count is back to the
// baseline, no mapping names the prefix, there are no more shmipc memfd
// mappings than at the baseline, and no file starts with the prefix. It
// reports what is left otherwise.
func clCheckBack(t testing.TB, what string, base clSnapshot, prefix string) {
	t.Helper()
	start := time.Now()
	deadline := start.Add(clSettle)
	var now clSnapshot
	for {
		now = clTake(t, prefix)
		if len(now.fds) <= len(base.fds) && len(now.ours) == 0 && len(now.memfd) <= len(base.memfd) && len(now.files) == 0 {
			t.Logf("%s: back to the baseline after %v", what, time.Since(start).Round(time.Millisecond))
			return
		}
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s: resources not released within %v:\n", what, clSettle)
	if len(now.fds) > len(base.fds) {
		fmt.Fprintf(&b, "  %d fds open, %d at the baseline; new or changed:\n", len(now.fds), len(base.fds))
		var fds []int
		for fd := range now.fds {
			fds = append(fds, fd)
		}
		sort.Ints(fds)
		for _, fd := range fds {
			if base.fds[fd] != now.fds[fd] {
				fmt.Fprintf(&b, "    fd %d -> %s\n", fd, now.fds[fd])
			}
		}
	}
	if len(now.ours) > 0 {
		fmt.Fprintf(&b, "  %d mappings of %s*:\n    %s\n", len(now.ours), prefix, strings.Join(now.ours, "\n    "))
	}
	if len(now.memfd) > len(base.memfd) {
		fmt.Fprintf(&b, "  %d memfd:shmipc mappings, %d at the baseline:\n    %s\n", len(now.memfd), len(base.memfd), strings.Join(now.memfd, "\n    "))
	}
	if len(now.files) > 0 {
		fmt.Fprintf(&b, "  files left: %q\n", now.files)
	}
	t.Error(b.String())
}

// clEchoServer serves the framed echo of mpServeEcho on a listener in this
// process and keeps track of its goroutines.
type clEchoServer struct {
	ln       *Listener
	streams  atomic.Int32 // streams accepted
	wg       sync.WaitGroup
	mu       sync.Mutex
	sessions map[*Session]bool
}

func clStartEcho(t testing.TB, sock string, conf *Config) *clEchoServer {
	t.Helper()
	ln, err := Listen("unix", sock, conf)
	if err != nil {
		t.Fatal(err)
	}
	e := &clEchoServer{ln: ln, sessions: make(map[*Session]bool)}
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		for {
			st, err := ln.AcceptStream()
			if err != nil {
				return
			}
			e.streams.Add(1)
			e.mu.Lock()
			e.sessions[st.Session()] = true
			e.mu.Unlock()
			e.wg.Add(1)
			go func() {
				defer e.wg.Done()
				_ = mpServeEcho(st)
			}()
		}
	}()
	return e
}

// serverSessions returns the server sessions that have carried a stream.
func (e *clEchoServer) serverSessions() []*Session {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []*Session
	for s := range e.sessions {
		out = append(out, s)
	}
	return out
}

// close closes the listener and its sessions and waits for every server
// goroutine.
func (e *clEchoServer) close(t testing.TB) {
	t.Helper()
	if err := e.ln.CloseAll(); err != nil {
		t.Errorf("Listener.CloseAll: %v", err)
	}
	if !clWaitGroup(&e.wg, 10*time.Second) {
		t.Errorf("echo server goroutines still running 10s after Listener.CloseAll")
	}
}

func clWaitGroup(wg *sync.WaitGroup, d time.Duration) bool {
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
		return true
	case <-time.After(d):
		return false
	}
}

// clPeerGone reports whether err is the error of a session whose peer
// closed the connection (EOF, or ECONNRESET when the peer closed its socket
// before reading everything sent to it).
func clPeerGone(err error) bool {
	return errors.Is(err, ErrSessionClosed) && errors.Is(err, ErrPeerClosed)
}

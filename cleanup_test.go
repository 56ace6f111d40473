package shmipc

// Resource cleanup: after sessions, streams and listeners are closed (or a
// handshake fails), no file descriptors, mappings or /dev/shm files of this
// package may be left behind. Every test uses its own ShareMemoryPathPrefix
// (/dev/shm/shmipc_cl_<pid>_<random>), so what it looks for is its own.
//
// These tests measure process-wide resources (/proc/self/fd, /proc/self/maps),
// so they must not run in parallel with other tests.

import (
	"bytes"
	"errors"
	"fmt"
	"io"
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

	"github.com/goshm/shmipc/internal/wire"
	"golang.org/x/sys/unix"
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

// TestCleanupShmFiles checks that no file under the prefix is left once the
// sessions, their streams and the listener are closed, whichever side goes
// first. In memfd mode no file may appear at all.
func TestCleanupShmFiles(t *testing.T) {
	for _, mode := range bothModes {
		for _, order := range []string{"client-first", "listener-first"} {
			t.Run(mode.String()+"/"+order, func(t *testing.T) {
				prefix := shmPrefix(t, "cl")
				conf := clConfig(mode, prefix)
				srv := clStartEcho(t, filepath.Join(t.TempDir(), "s.sock"), conf)
				defer srv.ln.Close()

				const nSessions, nStreams = 2, 3
				var sessions []*Session
				for range nSessions {
					s, err := Dial("unix", srv.ln.Addr().String(), conf)
					if err != nil {
						t.Fatal(err)
					}
					defer s.Close()
					sessions = append(sessions, s)
				}
				var streams []*Stream
				for i, s := range sessions {
					for j := range nStreams {
						st, err := s.OpenStream()
						if err != nil {
							t.Fatal(err)
						}
						defer st.Close()
						st.SetDeadline(time.Now().Add(20 * time.Second))
						for k, n := range []int{64, 4096, 300000} {
							if err := mpRoundTrip(st, mpPayload(n, uint64(i*100+j*10+k)), false); err != nil {
								t.Fatalf("session %d stream %d: %v", i, j, err)
							}
						}
						streams = append(streams, st)
					}
				}

				files := shmFiles(prefix)
				want := 0
				if mode == MemMapTypeDevShmFile {
					want = 2 * nSessions // a buffer and a queue file per session
				}
				if len(files) != want {
					t.Errorf("while the sessions run: %d files under the prefix, want %d: %q", len(files), want, files)
				}

				// Half the streams are closed by the server (zero-length
				// frame), the others by the client.
				for i, st := range streams {
					if i%2 == 0 {
						if err := mpCloseByServer(st); err != nil {
							t.Errorf("stream %d: %v", st.ID(), err)
						}
					}
					if err := st.Close(); err != nil {
						t.Errorf("stream %d: Close: %v", st.ID(), err)
					}
				}
				switch order {
				case "client-first":
					for _, s := range sessions {
						s.Close()
					}
					srv.close(t)
				case "listener-first":
					srv.close(t)
					for _, s := range sessions {
						waitSessionClosed(t, s, 5*time.Second)
						if err := s.Err(); !clPeerGone(err) {
							t.Errorf("client session after the listener closed: Err() = %v, want ErrSessionClosed wrapping io.EOF or ECONNRESET", err)
						}
						s.Close()
					}
				}

				deadline := time.Now().Add(clSettle)
				for len(shmFiles(prefix)) > 0 && time.Now().Before(deadline) {
					time.Sleep(10 * time.Millisecond)
				}
				if files := shmFiles(prefix); len(files) > 0 {
					t.Errorf("files left %v after everything was closed: %q", clSettle, files)
				}
			})
		}
	}
}

// TestCleanupFdsAndMappings opens five sessions with traffic on several
// streams (including messages too large for the buffer region, which go as
// fallback data), closes everything, and checks that the fd count, the
// shmipc mappings and the files are back to the baseline.
func TestCleanupFdsAndMappings(t *testing.T) {
	for _, mode := range bothModes {
		t.Run(mode.String(), func(t *testing.T) {
			prefix := shmPrefix(t, "cl")
			conf := clConfig(mode, prefix)
			sock := filepath.Join(t.TempDir(), "s.sock")
			base := clBaseline(t, prefix)

			srv := clStartEcho(t, sock, conf)
			const nSessions, nStreams = 5, 3
			sizes := []int{64, 4096, 300000, 1 << 20}
			var sessions []*Session
			for range nSessions {
				s, err := Dial("unix", sock, conf)
				if err != nil {
					t.Fatal(err)
				}
				sessions = append(sessions, s)
			}
			var wg sync.WaitGroup
			errs := make(chan error, nSessions*nStreams)
			for i, s := range sessions {
				for j := range nStreams {
					wg.Add(1)
					go func() {
						defer wg.Done()
						st, err := s.OpenStream()
						if err != nil {
							errs <- err
							return
						}
						defer st.Close()
						st.SetDeadline(time.Now().Add(20 * time.Second))
						sz := sizes
						if j == 0 && i%2 == 0 {
							sz = append(sizes[:len(sizes):len(sizes)], 6<<20) // larger than the region: fallback data
						}
						for k, n := range sz {
							if err := mpRoundTrip(st, mpPayload(n, uint64(i*1000+j*10+k)), k%2 == 1); err != nil {
								errs <- fmt.Errorf("session %d stream %d size %d: %w", i, j, n, err)
								return
							}
						}
						if j == 1 {
							if err := mpCloseByServer(st); err != nil {
								errs <- fmt.Errorf("session %d stream %d: %w", i, j, err)
							}
						}
					}()
				}
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}

			// The checks below must be able to see what they look for.
			mid := clTake(t, prefix)
			if len(mid.ours) == 0 {
				t.Errorf("no mapping in /proc/self/maps names %s while %d sessions are open", prefix, nSessions)
			}
			if mode == MemMapTypeMemFd && len(mid.memfd) <= len(base.memfd) {
				t.Errorf("no new memfd:shmipc mapping while %d sessions are open", nSessions)
			}
			// New fds, by number and target: fds of earlier tests' sessions
			// that close meanwhile (a shared memfd region stays open for
			// the sweeps after its last session, reclaimSweeps) must not
			// hide the sessions' own.
			added := 0
			for fd, target := range mid.fds {
				if base.fds[fd] != target {
					added++
				}
			}
			if added < 2*nSessions {
				t.Errorf("%d fds with %d sessions open, baseline %d, %d of them new: want at least a socket per side and session", len(mid.fds), nSessions, len(base.fds), added)
			}

			for _, s := range sessions {
				s.Close()
			}
			srv.close(t)
			clCheckBack(t, "after closing every session and the listener", base, prefix)
		})
	}
}

// TestCleanupFailedHandshake checks that failed handshakes, on either side,
// leave no fd, mapping or file behind, and that a listener keeps serving
// after clients that broke the handshake.
func TestCleanupFailedHandshake(t *testing.T) {
	for _, mode := range bothModes {
		t.Run("client/"+mode.String(), func(t *testing.T) {
			prefix := shmPrefix(t, "cl")
			conf := clConfig(mode, prefix)
			// Waited out by the dial of the silent server; the other dials
			// fail at once, or succeed (file mode has no answer to wait
			// for): 100 ms with -short.
			conf.InitializeTimeout = shortOr(300*time.Millisecond, 100*time.Millisecond)
			dir := t.TempDir()
			base := clBaseline(t, prefix)

			// A server that accepts and at once closes.
			closing, err := net.Listen("unix", filepath.Join(dir, "closing.sock"))
			if err != nil {
				t.Fatal(err)
			}
			var accWG sync.WaitGroup
			accWG.Add(1)
			go func() {
				defer accWG.Done()
				for {
					c, err := closing.Accept()
					if err != nil {
						return
					}
					c.Close()
				}
			}()
			for i := range 3 {
				s, err := Dial("unix", closing.Addr().String(), conf)
				if err == nil {
					// File mode (version 2) has no acknowledgement: the client
					// only learns of the failure when the socket closes.
					if mode != MemMapTypeDevShmFile {
						t.Fatalf("dial %d: handshake with a server that closes at once succeeded", i)
					}
					waitSessionClosed(t, s, 5*time.Second)
					if err := s.Err(); !errors.Is(err, ErrSessionClosed) {
						t.Errorf("dial %d: Err() = %v, want ErrSessionClosed", i, err)
					}
					s.Close()
				} else if !errors.Is(err, ErrHandshake) {
					t.Errorf("dial %d: error %v does not wrap ErrHandshake", i, err)
				}
			}
			closing.Close()
			accWG.Wait()

			// A server that accepts and says nothing: the handshake times out
			// (memfd mode waits for an answer; file mode expects none).
			if mode == MemMapTypeMemFd {
				silent, err := net.Listen("unix", filepath.Join(dir, "silent.sock"))
				if err != nil {
					t.Fatal(err)
				}
				held := make(chan net.Conn, 4)
				go func() {
					for {
						c, err := silent.Accept()
						if err != nil {
							close(held)
							return
						}
						held <- c
					}
				}()
				_, err = Dial("unix", silent.Addr().String(), conf)
				if !errors.Is(err, ErrHandshake) || !errors.Is(err, ErrTimeout) {
					t.Errorf("dial of a silent server: error %v, want ErrHandshake and ErrTimeout", err)
				}
				silent.Close()
				for c := range held {
					c.Close()
				}
			}
			// File mode: a real server that refuses the paths (they are not
			// in the directory of its own prefix) and hangs up. The version 2
			// handshake has no answer, so Dial succeeds and the session then
			// ends; the client must still remove its files.
			if mode == MemMapTypeDevShmFile {
				sconf := clConfig(mode, filepath.Join(dir, "elsewhere"))
				ln, err := Listen("unix", filepath.Join(dir, "picky.sock"), sconf)
				if err != nil {
					t.Fatal(err)
				}
				s, err := Dial("unix", ln.Addr().String(), conf)
				if err != nil {
					t.Fatalf("dial: %v", err)
				}
				waitSessionClosed(t, s, 5*time.Second)
				if err := s.Err(); !clPeerGone(err) {
					t.Errorf("session whose paths the server refused: Err() = %v, want the peer to have closed", err)
				}
				s.Close()
				if err := ln.Close(); err != nil {
					t.Error(err)
				}
			}
			clCheckBack(t, "after failed client handshakes", base, prefix)
		})
	}

	t.Run("server", func(t *testing.T) {
		prefix := shmPrefix(t, "cl")
		conf := clConfig(MemMapTypeMemFd, prefix)
		conf.InitializeTimeout = 500 * time.Millisecond
		sock := filepath.Join(t.TempDir(), "s.sock")
		base := clBaseline(t, prefix)
		srv := clStartEcho(t, sock, conf)

		bufPath, queuePath := prefix+"_x_buffer", prefix+"_x_queue_0"
		cases := []struct {
			name string
			run  func(c *net.UnixConn) error
			// vanish: the handshake succeeds and the client goes away
			// instead of waiting for the server to hang up.
			vanish bool
		}{
			{"garbage", func(c *net.UnixConn) error {
				_, err := c.Write([]byte("GET / HTTP/1.1\r\nHost: shmipc\r\n\r\n"))
				return err
			}, false},
			{"bad-version", func(c *net.UnixConn) error {
				_, err := c.Write(wire.AppendEvent(nil, 9, wire.TypeExchangeProtoVersion))
				return err
			}, false},
			{"silent", func(c *net.UnixConn) error { return nil }, false},
			{"v3-then-eof", func(c *net.UnixConn) error {
				if err := clExchange(c); err != nil {
					return err
				}
				return c.CloseWrite()
			}, false},
			{"truncated-paths", func(c *net.UnixConn) error {
				f, err := wire.AppendPaths(nil, wire.VersionFilePath, wire.TypeShareMemoryByFilePath, queuePath, bufPath)
				if err != nil {
					return err
				}
				if _, err := c.Write(f[:len(f)-5]); err != nil {
					return err
				}
				return c.CloseWrite()
			}, false},
			{"v2-missing-files", func(c *net.UnixConn) error {
				f, err := wire.AppendPaths(nil, wire.VersionFilePath, wire.TypeShareMemoryByFilePath, queuePath, bufPath)
				if err != nil {
					return err
				}
				_, err = c.Write(f)
				return err
			}, false},
			{"v2-outside-dir", func(c *net.UnixConn) error {
				f, err := wire.AppendPaths(nil, wire.VersionFilePath, wire.TypeShareMemoryByFilePath, "/etc/hostname", "/etc/passwd")
				if err != nil {
					return err
				}
				_, err = c.Write(f)
				return err
			}, false},
			{"v2-tiny-queue-file", func(c *net.UnixConn) error {
				// A valid buffer region, then a queue region too small to
				// be one: the server maps the buffer, then must let it go.
				if err := clWriteBufferFile(bufPath); err != nil {
					return err
				}
				if err := os.WriteFile(queuePath, make([]byte, 16), 0o600); err != nil {
					return err
				}
				f, err := wire.AppendPaths(nil, wire.VersionFilePath, wire.TypeShareMemoryByFilePath, queuePath, bufPath)
				if err != nil {
					return err
				}
				_, err = c.Write(f)
				return err
			}, false},
			{"memfd-one-fd", func(c *net.UnixConn) error {
				fd, err := clMemfd(bufPath, 1<<20, false)
				if err != nil {
					return err
				}
				defer unix.Close(fd)
				return clSendMemfds(c, queuePath, bufPath, fd)
			}, false},
			{"memfd-three-fds", func(c *net.UnixConn) error {
				var fds []int
				for i := range 3 {
					fd, err := clMemfd(fmt.Sprintf("%s_%d", bufPath, i), 1<<20, false)
					if err != nil {
						return err
					}
					defer unix.Close(fd)
					fds = append(fds, fd)
				}
				return clSendMemfds(c, queuePath, bufPath, fds...)
			}, false},
			{"memfd-tiny-queue", func(c *net.UnixConn) error {
				bfd, err := clMemfd(bufPath, 1<<20, true)
				if err != nil {
					return err
				}
				defer unix.Close(bfd)
				qfd, err := clMemfd(queuePath, 16, false)
				if err != nil {
					return err
				}
				defer unix.Close(qfd)
				return clSendMemfds(c, queuePath, bufPath, bfd, qfd)
			}, false},
			{"memfd-valid-then-vanish", func(c *net.UnixConn) error {
				bfd, err := clMemfd(bufPath, 1<<20, true)
				if err != nil {
					return err
				}
				defer unix.Close(bfd)
				qfd, err := clMemfd(queuePath, queueRegionSize(16), false)
				if err != nil {
					return err
				}
				defer unix.Close(qfd)
				mem, err := unix.Mmap(qfd, 0, queueRegionSize(16), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
				if err != nil {
					return err
				}
				initQueueRegion(mem, 16)
				if err := unix.Munmap(mem); err != nil {
					return err
				}
				if err := clSendMemfds(c, queuePath, bufPath, bfd, qfd); err != nil {
					return err
				}
				return clExpectFrame(c, wire.TypeAckShareMemory)
			}, true},
			{"memfd-not-a-region", func(c *net.UnixConn) error {
				// Two fds that are not regular files: a pipe's ends.
				r, w, err := os.Pipe()
				if err != nil {
					return err
				}
				defer r.Close()
				defer w.Close()
				return clSendMemfds(c, queuePath, bufPath, int(r.Fd()), int(w.Fd()))
			}, false},
		}
		for _, tc := range cases {
			raw, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: sock, Net: "unix"})
			if err != nil {
				t.Fatal(err)
			}
			if err := tc.run(raw); err != nil {
				t.Errorf("%s: client side: %v", tc.name, err)
			}
			// The server must drop the connection (at the latest after its
			// 500 ms handshake timeout).
			if !tc.vanish {
				if err := clExpectHangUp(raw, 5*time.Second); err != nil {
					t.Errorf("%s: %v", tc.name, err)
				}
			}
			raw.Close()
			for _, f := range []string{bufPath, queuePath} {
				_ = os.Remove(f)
			}
		}

		// The listener still serves real clients.
		for _, mode := range bothModes {
			cconf := clConfig(mode, prefix)
			s, err := Dial("unix", sock, cconf)
			if err != nil {
				t.Fatalf("%v dial after the bad clients: %v", mode, err)
			}
			st, err := s.OpenStream()
			if err != nil {
				t.Fatal(err)
			}
			st.SetDeadline(time.Now().Add(10 * time.Second))
			if err := mpRoundTrip(st, mpPayload(5000, 1), false); err != nil {
				t.Errorf("%v echo after the bad clients: %v", mode, err)
			}
			st.Close()
			s.Close()
		}
		srv.close(t)
		clCheckBack(t, "after failed server handshakes", base, prefix)
	})
}

// clExchange runs the version exchange of a version 3 handshake.
func clExchange(c *net.UnixConn) error {
	if _, err := c.Write(wire.AppendEvent(nil, wire.VersionMemfd, wire.TypeExchangeProtoVersion)); err != nil {
		return err
	}
	return clExpectFrame(c, wire.TypeExchangeProtoVersion)
}

func clExpectFrame(c *net.UnixConn, typ wire.Type) error {
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	defer c.SetReadDeadline(time.Time{})
	h := make(wire.Header, wire.HeaderSize)
	if _, err := io.ReadFull(c, h); err != nil {
		return fmt.Errorf("waiting for %v: %w", typ, err)
	}
	if h.Type() != typ || h.Length() != wire.HeaderSize {
		return fmt.Errorf("got %v, want an 8-byte %v", h, typ)
	}
	return nil
}

// clSendMemfds runs a version 3 memfd handshake up to the fd message, which
// carries fds.
func clSendMemfds(c *net.UnixConn, queuePath, bufPath string, fds ...int) error {
	if err := clExchange(c); err != nil {
		return err
	}
	f, err := wire.AppendPaths(nil, wire.VersionMemfd, wire.TypeShareMemoryByMemfd, queuePath, bufPath)
	if err != nil {
		return err
	}
	if _, err := c.Write(f); err != nil {
		return err
	}
	if err := clExpectFrame(c, wire.TypeAckReadyRecvFD); err != nil {
		return err
	}
	_, _, err = c.WriteMsgUnix([]byte{0}, unix.UnixRights(fds...), nil)
	return err
}

// clMemfd creates a memfd named like the package's own of size bytes,
// holding a valid buffer region if buffer is set.
func clMemfd(name string, size int, buffer bool) (int, error) {
	fd, err := unix.MemfdCreate(memfdNamePrefix+name, unix.MFD_CLOEXEC)
	if err != nil {
		return -1, err
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		unix.Close(fd)
		return -1, err
	}
	if buffer {
		if err := clInitBuffer(fd, size); err != nil {
			unix.Close(fd)
			return -1, err
		}
	}
	return fd, nil
}

// clWriteBufferFile creates a 1 MiB file holding a valid buffer region.
func clWriteBufferFile(path string) error {
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.Ftruncate(fd, 1<<20); err != nil {
		return err
	}
	return clInitBuffer(fd, 1<<20)
}

func clInitBuffer(fd, size int) error {
	plans, err := planLists(uint32(size), ReferenceSliceSizes())
	if err != nil {
		return err
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return err
	}
	initBufferRegion(mem, plans)
	return unix.Munmap(mem)
}

// clExpectHangUp reads from c until the server closes the connection.
func clExpectHangUp(c *net.UnixConn, d time.Duration) error {
	c.SetReadDeadline(time.Now().Add(d))
	var buf [256]byte
	var got []byte
	for {
		n, err := c.Read(buf[:])
		got = append(got, buf[:n]...)
		if err == nil {
			continue
		}
		if errors.Is(err, io.EOF) || errors.Is(err, unix.ECONNRESET) {
			return nil
		}
		return fmt.Errorf("server did not close the connection (read %d bytes %x): %w", len(got), got, err)
	}
}

// TestCleanupCloseSessionWithUnreadData closes a session while streams on
// both sides still hold unread data (and one holds a zero-copy slice it has
// read), then closes the streams: everything must go away. It also checks
// what the streams see in between.
func TestCleanupCloseSessionWithUnreadData(t *testing.T) {
	for _, mode := range bothModes {
		for _, closer := range []string{"client", "server"} {
			t.Run(mode.String()+"/"+closer+"-closes", func(t *testing.T) {
				prefix := shmPrefix(t, "cl")
				conf := clConfig(mode, prefix)
				sock := filepath.Join(t.TempDir(), "s.sock")
				base := clBaseline(t, prefix)

				ln, err := Listen("unix", sock, conf)
				if err != nil {
					t.Fatal(err)
				}
				defer ln.Close()
				sess, err := Dial("unix", sock, conf)
				if err != nil {
					t.Fatal(err)
				}
				defer sess.Close()

				const nStreams = 3
				toServer := []int{64, 20 << 10, 200 << 10} // three slice classes
				const toClient = 50 << 10
				var cs, ss []*Stream
				for i := range nStreams {
					st, err := sess.OpenStream()
					if err != nil {
						t.Fatal(err)
					}
					defer st.Close()
					for k, n := range toServer {
						if _, err := st.Write(mpPayload(n, uint64(i*10+k))); err != nil {
							t.Fatal(err)
						}
					}
					cs = append(cs, st)
				}
				for range nStreams {
					st := acceptWithin(t, ln, 10*time.Second)
					defer st.Close()
					if _, err := st.Write(mpPayload(toClient, uint64(st.ID()))); err != nil {
						t.Fatal(err)
					}
					ss = append(ss, st)
				}
				total := 0
				for _, n := range toServer {
					total += n
				}
				for _, st := range ss {
					clWaitLen(t, st, total)
				}
				for _, st := range cs {
					clWaitLen(t, st, toClient)
				}
				// The client reads part of stream 0 zero-copy and keeps
				// the slice: the mapping must outlive the session for it.
				want := mpPayload(toClient, uint64(cs[0].ID()))[:100]
				held, err := cs[0].BufferReader().ReadBytes(100)
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(held, want) {
					t.Fatalf("zero-copy read: got %x, want %x", held[:8], want[:8])
				}

				srvSess := ss[0].Session()
				var peer *Session
				switch closer {
				case "client":
					sess.Close()
					peer = srvSess
				case "server":
					srvSess.Close()
					peer = sess
				}
				waitSessionClosed(t, peer, 5*time.Second)
				if err := peer.Err(); !clPeerGone(err) {
					t.Errorf("%s session after its peer closed: Err() = %v, want ErrSessionClosed wrapping io.EOF or ECONNRESET", peer.role(), err)
				}

				if !bytes.Equal(held, want) {
					t.Errorf("zero-copy slice read before the session ended changed: got %x, want %x", held[:8], want[:8])
				}
				// A session ended by the peer leaves received data
				// readable; then reads fail with the session's error.
				peerStreams := ss
				if closer == "server" {
					peerStreams = cs[1:]
				}
				for _, st := range peerStreams {
					n := st.BufferReader().Len()
					if n == 0 {
						t.Errorf("%s stream %d: unread data dropped when the peer closed the session", peer.role(), st.ID())
						continue
					}
					if _, err := st.BufferReader().Discard(n); err != nil {
						t.Errorf("%s stream %d: reading the %d bytes left after the peer closed the session: %v", peer.role(), st.ID(), n, err)
					}
					if _, err := st.Read(make([]byte, 1)); !errors.Is(err, ErrSessionClosed) {
						t.Errorf("%s stream %d: read past the data left after the peer closed the session: %v, want ErrSessionClosed", peer.role(), st.ID(), err)
					}
				}

				for _, st := range append(cs, ss...) {
					if err := st.Close(); err != nil {
						t.Errorf("%s stream %d: Close after the session ended: %v", st.Session().role(), st.ID(), err)
					}
				}
				sess.Close()
				if err := ln.Close(); err != nil {
					t.Error(err)
				}
				clCheckBack(t, "after closing the sessions and then their streams", base, prefix)
			})
		}
	}
}

// clWaitLen waits until st has n unread bytes.
func clWaitLen(t testing.TB, st *Stream, n int) {
	t.Helper()
	waitUntil(t, fmt.Sprintf("%d bytes arrive on stream %d", n, st.ID()), 5*time.Second, func() bool { return st.BufferReader().Len() >= n })
}

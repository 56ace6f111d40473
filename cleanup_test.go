package shmipc

// Resource cleanup: after sessions, streams and listeners are closed (or a
// handshake fails), no file descriptors, mappings or /dev/shm files of this
// package may be left behind. Every test uses its own ShareMemoryPathPrefix
// (/dev/shm/shmipc_cl_<pid>_<random>), so what it looks for is its own.
//
// These tests measure process-wide resources (/proc/self/fd, /proc/self/maps),
// so they must not run in parallel with other tests.

import (
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

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

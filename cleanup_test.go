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
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
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

// Cleanup of a session closed while its streams still hold unread data.

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

// Slices of a message for a stream the server refuses go back to the buffer
// region: a client's sessions share one region (region_pool.go), so a slice
// lost with one session is lost to the others.

// TestRefusedChild is the server process of TestRefusedStreamFreesSlices: a
// listener on SOCK with Config.MaxPendingAccepts PENDING and MaxStreams
// STREAMS that accepts nothing until the file GO exists, then reads every
// stream to its end and closes it.
func TestRefusedChild(t *testing.T) {
	if proctest.Role() == "" {
		t.Skip("runs only as the child process of TestRefusedStreamFreesSlices")
	}
	conf := DefaultConfig()
	var err error
	if conf.MaxPendingAccepts, err = strconv.Atoi(proctest.MustArg(t, "PENDING")); err != nil {
		t.Fatal(err)
	}
	if conf.MaxStreams, err = strconv.Atoi(proctest.MustArg(t, "STREAMS")); err != nil {
		t.Fatal(err)
	}
	ln, err := Listen("unix", proctest.MustArg(t, "SOCK"), conf)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	gate := proctest.MustArg(t, "GO")
	go func() {
		for {
			if _, err := os.Stat(gate); err == nil {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		serveStreams(ln, func(st *Stream) {
			defer st.Close()
			_, _ = io.Copy(io.Discard, st)
		})
	}()
	proctest.Ready()
	<-proctest.StdinClosed()
}

// TestRefusedStreamFreesSlices: two sessions of this process share a buffer
// region with a server process; the first opens one stream more than the
// server takes (Config.MaxPendingAccepts, or MaxStreams), each with a
// message in shared memory, and the server ends that session. Once the
// server has read the streams it did take, every slice is free again, as
// the session that goes on sees it.
func TestRefusedStreamFreesSlices(t *testing.T) {
	for _, tc := range []struct {
		name             string
		pending, streams int
	}{
		{"MaxPendingAccepts", 2, 1 << 16},
		{"MaxStreams", 1 << 12, 1}, // more than twice 1 open
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			sock, gate := filepath.Join(dir, "refused.sock"), filepath.Join(dir, "go")
			c, _ := startChild(t, proctest.Config{TestName: "TestRefusedChild", Role: "server", Args: map[string]string{
				"SOCK": sock, "GO": gate, "PENDING": strconv.Itoa(tc.pending), "STREAMS": strconv.Itoa(tc.streams),
			}})
			defer c.Stop(10 * time.Second)
			conf := peerConfig(t, MemMapTypeMemFd, 0)
			conf.ShareMemoryBufferCap = 4 << 20
			a, err := Dial("unix", sock, conf)
			if err != nil {
				t.Fatal(err)
			}
			defer a.Close()
			b, err := Dial("unix", sock, conf)
			if err != nil {
				t.Fatal(err)
			}
			defer b.Close()
			if a.buf != b.buf {
				t.Fatal("the two sessions do not share a buffer region")
			}
			before := fmt.Sprint(freeCounts(b.buf))
			for i := range 3 {
				st, err := a.OpenStream()
				if err != nil {
					t.Fatal(err)
				}
				if _, err := st.Write([]byte("message on stream " + strconv.Itoa(i))); err != nil {
					t.Fatalf("write on stream %d: %v", i, err)
				}
			}
			waitUntil(t, "the server ends the session with one stream too many", 10*time.Second, a.IsClosed)
			if err := os.WriteFile(gate, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			a.Close()
			var after string
			deadline := time.Now().Add(5 * time.Second)
			for after != before && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
				after = fmt.Sprint(freeCounts(b.buf))
			}
			if after != before {
				t.Errorf("free slices of the shared region: %s before, %s after the refused session ended", before, after)
			}
			if b.IsClosed() {
				t.Errorf("the other session ended: %v", b.Err())
			}
		})
	}
}

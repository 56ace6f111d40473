package shmipc

// Cleanup after failed handshakes, with a raw peer that speaks the handshake
// frame by frame.

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/shm"
	"github.com/goshm/shmipc/internal/wire"
	"golang.org/x/sys/unix"
)

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
				qfd, err := clMemfd(queuePath, shm.QueueRegionSize(16), false)
				if err != nil {
					return err
				}
				defer unix.Close(qfd)
				mem, err := unix.Mmap(qfd, 0, shm.QueueRegionSize(16), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
				if err != nil {
					return err
				}
				shm.InitQueues(mem, 16)
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
	shm.InitBuffer(mem, plans)
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

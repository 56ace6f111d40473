package shmipc

// Behaviour across two real processes. The other process is this test binary
// re-executed by internal/proctest; it runs TestMultiProcessChild in the role
// the parent chose.
//
// Echo protocol used by every echo server here: read a u32 big-endian length
// n, then n bytes, and send both back as one message; n == 0 echoes the four
// bytes and closes the stream.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

// Roles of the child process.
const (
	mpChildTest = "TestMultiProcessChild"

	mpRoleEchoServer = "echo-server" // serves the echo until stdin closes
	mpRoleEchoClient = "echo-client" // runs mpEchoSuite against the parent
	mpRoleIdleClient = "idle-client" // opens a stream, sends 64 bytes, waits
)

// mpPayload returns n pseudo-random bytes determined by seed.
func mpPayload(n int, seed uint64) []byte {
	var key [32]byte
	binary.LittleEndian.PutUint64(key[:], seed)
	binary.LittleEndian.PutUint64(key[8:], uint64(n))
	p := make([]byte, n)
	_, _ = rand.NewChaCha8(key).Read(p)
	return p
}

// mpServeEcho serves the echo protocol on st until the client closes it,
// sends a zero-length frame, or something fails. It closes st.
func mpServeEcho(st *Stream) error {
	defer st.Close()
	hdr := make([]byte, 4)
	for {
		if _, err := io.ReadFull(st, hdr); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		n := int(binary.BigEndian.Uint32(hdr))
		body, err := st.BufferReader().ReadBytes(n) // zero-copy where it can
		if err != nil {
			return fmt.Errorf("reading %d bytes: %w", n, err)
		}
		w := st.BufferWriter()
		if _, err := w.WriteBytes(hdr); err != nil {
			return err
		}
		if _, err := w.WriteBytes(body); err != nil {
			return err
		}
		if err := st.Flush(false); err != nil {
			return err
		}
		if n == 0 {
			return nil
		}
	}
}

// mpRoundTrip sends payload as one echo frame and checks the echo, read
// with Read, or with ReadBytes if zeroCopy.
func mpRoundTrip(st *Stream, payload []byte, zeroCopy bool) error {
	n := len(payload)
	msg := make([]byte, 4+n)
	binary.BigEndian.PutUint32(msg, uint32(n))
	copy(msg[4:], payload)
	if _, err := st.Write(msg); err != nil {
		return fmt.Errorf("write %d bytes: %w", n, err)
	}
	hdr := make([]byte, 4)
	if _, err := io.ReadFull(st, hdr); err != nil {
		return fmt.Errorf("echo of %d bytes: reading the length: %w", n, err)
	}
	if got := binary.BigEndian.Uint32(hdr); got != uint32(n) {
		return fmt.Errorf("echo of %d bytes: length %d", n, got)
	}
	var got []byte
	if zeroCopy {
		var err error
		if got, err = st.BufferReader().ReadBytes(n); err != nil {
			return fmt.Errorf("echo of %d bytes: ReadBytes: %w", n, err)
		}
	} else {
		got = make([]byte, n)
		if _, err := io.ReadFull(st, got); err != nil {
			return fmt.Errorf("echo of %d bytes: Read: %w", n, err)
		}
	}
	if !bytes.Equal(got, payload) {
		i := 0
		for i < n && got[i] == payload[i] {
			i++
		}
		return fmt.Errorf("echo of %d bytes differs from byte %d on", n, i)
	}
	return nil
}

// mpCloseByServer sends the zero-length frame: the server echoes its four
// bytes and closes the stream, after which reads return io.EOF.
func mpCloseByServer(st *Stream) error {
	if _, err := st.Write(make([]byte, 4)); err != nil {
		return fmt.Errorf("zero-length frame: %w", err)
	}
	hdr := make([]byte, 4)
	if _, err := io.ReadFull(st, hdr); err != nil {
		return fmt.Errorf("zero-length frame: reading the echo: %w", err)
	}
	if !bytes.Equal(hdr, make([]byte, 4)) {
		return fmt.Errorf("zero-length frame: echo %x", hdr)
	}
	if n, err := st.Read(make([]byte, 16)); n != 0 || err != io.EOF {
		return fmt.Errorf("read after the server closed the stream: (%d, %v), want (0, io.EOF)", n, err)
	}
	return nil
}

// mpEchoSuite runs the echo checks on a client session: messages of 64 B to
// 4 MiB on one stream, byte-exact, then 16 streams at once, each ended by the
// server with a zero-length frame.
func mpEchoSuite(t testing.TB, sess *Session) {
	t.Helper()
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	st.SetDeadline(time.Now().Add(30 * time.Second))
	for i, n := range []int{64, 4 << 10, 300000, 1 << 20, 4 << 20} {
		if err := mpRoundTrip(st, mpPayload(n, uint64(i)), i%2 == 1); err != nil {
			t.Fatalf("%v stream %d: %v", sess.conf.MemMapType, st.ID(), err)
		}
	}
	if err := mpCloseByServer(st); err != nil {
		t.Errorf("%v stream %d: %v", sess.conf.MemMapType, st.ID(), err)
	}
	st.Close()

	const concurrent = 16
	var wg sync.WaitGroup
	errs := make(chan error, concurrent)
	for g := range concurrent {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, err := sess.OpenStream()
			if err != nil {
				errs <- err
				return
			}
			defer st.Close()
			st.SetDeadline(time.Now().Add(30 * time.Second))
			for i, n := range []int{64, 4 << 10, 300000, 64 << 10, 1} {
				if err := mpRoundTrip(st, mpPayload(n, uint64(100*g+i)), (g+i)%2 == 0); err != nil {
					errs <- fmt.Errorf("concurrent stream %d: %w", st.ID(), err)
					return
				}
			}
			if err := mpCloseByServer(st); err != nil {
				errs <- fmt.Errorf("concurrent stream %d: %w", st.ID(), err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("%v: %v", sess.conf.MemMapType, err)
	}
}

// mpConfig is the configuration of both processes.
func mpConfig(mode MemMapType, prefix string) *Config {
	conf := DefaultConfig()
	conf.MemMapType = mode
	conf.ShareMemoryPathPrefix = prefix
	return conf
}

func mpParseMode(t testing.TB, s string) MemMapType {
	for _, m := range bothModes {
		if m.String() == s {
			return m
		}
	}
	t.Fatalf("unknown mode %q", s)
	return 0
}

// TestMultiProcessChild is the body of the child processes. In a normal run
// it skips itself.
func TestMultiProcessChild(t *testing.T) {
	role := proctest.Role()
	if role == "" {
		t.Skip("runs only as the child process of the multi-process tests")
	}
	sock := proctest.MustArg(t, "SOCK")
	prefix := proctest.MustArg(t, "PREFIX")
	switch role {
	case mpRoleEchoServer:
		srv := clStartEcho(t, sock, mpConfig(MemMapTypeMemFd, prefix))
		proctest.Ready()
		<-proctest.StdinClosed()
		srv.close(t)

	case mpRoleEchoClient:
		sess, err := Dial("unix", sock, mpConfig(mpParseMode(t, proctest.MustArg(t, "MODE")), prefix))
		if err != nil {
			t.Fatal(err)
		}
		defer sess.Close()
		proctest.Ready()
		mpEchoSuite(t, sess)
		if err := sess.Close(); err != nil {
			t.Error(err)
		}

	case mpRoleIdleClient:
		sess, err := Dial("unix", sock, mpConfig(mpParseMode(t, proctest.MustArg(t, "MODE")), prefix))
		if err != nil {
			t.Fatal(err)
		}
		defer sess.Close()
		st, err := sess.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		if _, err := st.Write(mpPayload(64, 7)); err != nil {
			t.Fatal(err)
		}
		proctest.Ready()
		<-proctest.StdinClosed()

	default:
		t.Fatalf("unknown child role %q", role)
	}
}

// mpStart starts a child in role and waits for its ready line.
func mpStart(t *testing.T, role, sock, prefix string, mode MemMapType) *proctest.Child {
	t.Helper()
	c, _ := startChild(t, proctest.Config{
		TestName: mpChildTest,
		Role:     role,
		Args:     map[string]string{"SOCK": sock, "PREFIX": prefix, "MODE": mode.String()},
	})
	return c
}

// mpWaitGone polls for up to d until no file is under prefix and process
// pid ("self" or a number) maps nothing named after prefix.
func mpWaitGone(t testing.TB, what, pid, prefix string, d time.Duration) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		_, ours, err := clMaps(pid, prefix)
		if err != nil {
			t.Errorf("%s: %v", what, err)
			return
		}
		files := shmFiles(prefix)
		if len(ours) == 0 && len(files) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("%s: still there after %v: mappings in process %s:\n  %s\nfiles %q", what, d, pid, strings.Join(ours, "\n  "), files)
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestMultiProcessEchoServer: the child is an echo server, the parent dials
// it in each mapping mode and runs the echo suite. Afterwards the child must
// have released the session's fds and mappings, and exit cleanly.
func TestMultiProcessEchoServer(t *testing.T) {
	for _, mode := range bothModes {
		t.Run(mode.String(), func(t *testing.T) {
			prefix := shmPrefix(t, "mp")
			sock := filepath.Join(t.TempDir(), "s.sock")
			c := mpStart(t, mpRoleEchoServer, sock, prefix, mode)
			childPid := strconv.Itoa(c.Pid())
			childBase, err := clFds(childPid)
			if err != nil {
				t.Fatal(err)
			}

			sess, err := Dial("unix", sock, mpConfig(mode, prefix))
			if err != nil {
				t.Fatalf("dial the child: %v\n%s", err, c.Output())
			}
			defer sess.Close()
			mpEchoSuite(t, sess)
			if _, ours, _ := clMaps(childPid, prefix); len(ours) == 0 {
				t.Errorf("the server process maps nothing named %s* while the session is open", prefix)
			}
			if err := sess.Close(); err != nil {
				t.Error(err)
			}

			mpWaitGone(t, "regions after the client closed", childPid, prefix, 5*time.Second)
			mpWaitGone(t, "regions after the client closed", "self", prefix, clSettle)
			deadline := time.Now().Add(5 * time.Second)
			for {
				fds, err := clFds(childPid)
				if err != nil {
					t.Fatal(err)
				}
				if len(fds) <= len(childBase) {
					break
				}
				if time.Now().After(deadline) {
					t.Errorf("server process has %d fds 5s after the session closed, %d before it: %v", len(fds), len(childBase), fds)
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			if err := c.Stop(20 * time.Second); err != nil {
				t.Errorf("child server: %v\n%s", err, c.Output())
			}
		})
	}
}

// TestMultiProcessEchoClient is the reverse: the parent serves the echo and
// the child runs the echo suite as the client, in each mapping mode.
func TestMultiProcessEchoClient(t *testing.T) {
	for _, mode := range bothModes {
		t.Run(mode.String(), func(t *testing.T) {
			prefix := shmPrefix(t, "mp")
			sock := filepath.Join(t.TempDir(), "s.sock")
			srv := clStartEcho(t, sock, mpConfig(mode, prefix))
			defer srv.ln.Close()

			c := mpStart(t, mpRoleEchoClient, sock, prefix, mode)
			if err := c.Wait(40 * time.Second); err != nil {
				t.Fatalf("child client: %v\n%s", err, c.Output())
			}
			if n := srv.streams.Load(); n != 17 {
				t.Errorf("server accepted %d streams, want 17 (1 sequential, 16 concurrent)", n)
			}
			sessions := srv.serverSessions()
			if len(sessions) != 1 {
				t.Errorf("server saw streams on %d sessions, want 1", len(sessions))
			}
			for _, s := range sessions {
				waitSessionClosed(t, s, 5*time.Second)
				if err := s.Err(); !clPeerGone(err) {
					t.Errorf("server session after the client exited: Err() = %v, want ErrSessionClosed wrapping io.EOF or ECONNRESET", err)
				}
			}
			srv.close(t)
			mpWaitGone(t, "regions after the client exited", "self", prefix, clSettle)
		})
	}
}

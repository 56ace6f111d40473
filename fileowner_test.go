package shmipc

// Tests of file-mode ownership (issue 8, finding 3). Names in /dev/shm are
// public, so a client could name another client's buffer file; the server
// must map a named file only if the client naming it owns it, and share a
// cached mapping only between sessions of one client process. The clients
// here are real processes: the test binary re-executed by internal/proctest
// (TestFileOwnerChild), the attacker as another user.

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/goshm/shmipc/internal/proctest"
	"github.com/goshm/shmipc/internal/shm"
)

const (
	foChildTest = "TestFileOwnerChild"

	foRoleVictim   = "victim"   // our Dial in file mode; sends a secret, waits, then echoes
	foRoleAttacker = "attacker" // frame-level client naming another client's buffer file
	foRoleNamer    = "namer"    // frame-level client opening sessions on one buffer file

	// foAttackerUID is the user the attacker runs as: nobody.
	foAttackerUID = 65534
)

// TestFileOwnerChild runs the client roles of the tests below in a child
// process.
func TestFileOwnerChild(t *testing.T) {
	switch proctest.Role() {
	case "":
		t.Skip("helper process for the file-mode ownership tests")
	case foRoleVictim:
		foVictim(t)
	case foRoleAttacker:
		foAttacker(t)
	case foRoleNamer:
		foNamer(t)
	default:
		t.Fatalf("unknown role %q", proctest.Role())
	}
}

// foVictim dials the server in file mode, sends SECRET on a stream and
// tells the parent it is ready. Once the parent closes its stdin it checks
// that its session still works with one echo round trip.
func foVictim(t *testing.T) {
	conf := peerConfig(t, MemMapTypeDevShmFile, 0)
	sess, err := Dial(proctest.MustArg(t, "NET"), proctest.MustArg(t, "ADDR"), conf)
	if err != nil {
		t.Fatalf("victim Dial: %v", err)
	}
	defer sess.Close()
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := st.Write([]byte(proctest.MustArg(t, "SECRET"))); err != nil {
		t.Fatalf("victim writing its secret: %v", err)
	}
	proctest.Ready()
	<-proctest.StdinClosed()
	if err := echoRoundTrip(sess, "the victim, after the attack"); err != nil {
		t.Fatalf("the victim's session stopped working: %v", err)
	}
}

// foAttacker plays a client at the frame level. It creates its own queue
// file, but names the victim's buffer file BUF in the handshake. It then
// opens stream 2 with a FallbackData frame, which makes the server answer on
// that stream with FallbackData over the socket, where the attacker can
// read it without access to the buffer region. Once the echo of that frame
// is back it pushes a queue element pointing at the victim's slice (OFFSET),
// and prints what the server echoes: "echo <hex>", then "end <why>".
func foAttacker(t *testing.T) {
	conf := peerConfig(t, MemMapTypeDevShmFile, 0)
	own := createRawRegions(t, conf, MemMapTypeDevShmFile, rawLayout{})
	offset, err := strconv.ParseUint(proctest.MustArg(t, "OFFSET"), 10, 32)
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial(proctest.MustArg(t, "NET"), proctest.MustArg(t, "ADDR"))
	if err != nil {
		t.Fatalf("attacker dial: %v", err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(peerTimeout))
	const opener = "A"
	_, err = c.Write(append(rawPathFrame(2, 0, own.queuePath, proctest.MustArg(t, "BUF")), rawFallbackFrame(2, 0, 2, 0, opener)...))
	proctest.Ready()
	var echo []byte
	if err == nil {
		echo, err = foReadFallback(c, echo)
	}
	if err == nil && string(echo) == opener {
		half := len(own.queue.Mem()) / 2
		send := rawQueue{mem: own.queue.Mem()[:half], cap: conf.QueueCap}
		send.put(2, uint32(offset), 0)
		if _, err = c.Write(rawFrame(8, rawMagic, 2, 1)); err == nil {
			echo, err = foReadFallback(c, echo)
		}
	}
	proctest.Println("echo", hex.EncodeToString(echo))
	proctest.Println("end", err)
}

// foReadFallback reads frames from c up to the next FallbackData frame and
// appends its data to echo.
func foReadFallback(c net.Conn, echo []byte) ([]byte, error) {
	for {
		h, err := readN(c, 8)
		if err != nil {
			return echo, err
		}
		n := binary.BigEndian.Uint32(h)
		if n < 8 || n > 1<<20 {
			return echo, fmt.Errorf("frame header % x", h)
		}
		rest, err := readN(c, int(n)-8)
		if err != nil {
			return echo, err
		}
		if h[7] == 3 && len(rest) >= 8 {
			return append(echo, rest[8:]...), nil
		}
	}
}

// foNamer opens SESSIONS sessions, each with a queue file of its own, that
// all name one buffer file: BUF if given, else one it creates. This is what
// a reference Go client does (one buffer region per process). It prints the
// buffer path with its ready line and keeps the sessions until stdin closes.
func foNamer(t *testing.T) {
	conf := peerConfig(t, MemMapTypeDevShmFile, 0)
	n, err := strconv.Atoi(proctest.MustArg(t, "SESSIONS"))
	if err != nil {
		t.Fatal(err)
	}
	buf := proctest.Arg("BUF")
	for i := range n {
		r := createRawRegions(t, conf, MemMapTypeDevShmFile, rawLayout{})
		if buf == "" {
			buf = r.bufPath
		}
		c, err := net.Dial("unix", proctest.MustArg(t, "ADDR"))
		if err != nil {
			t.Fatalf("session %d: %v", i, err)
		}
		defer c.Close()
		if _, err := c.Write(rawPathFrame(2, 0, r.queuePath, buf)); err != nil {
			t.Fatalf("session %d: %v", i, err)
		}
	}
	proctest.Ready(buf)
	<-proctest.StdinClosed()
}

// ---- the parent: a server that reports the outcome of every handshake ----

// foListen listens on network ("unix" or "tcp") where a client running as
// another user can connect.
func foListen(t *testing.T, network string) (ln net.Listener, addr string) {
	t.Helper()
	var err error
	if network == "tcp" {
		ln, err = net.Listen("tcp", "127.0.0.1:0")
	} else {
		dir, derr := os.MkdirTemp("", fmt.Sprintf("shmipc-fo-%d-", os.Getpid()))
		if derr != nil {
			t.Fatal(derr)
		}
		t.Cleanup(func() { os.RemoveAll(dir) })
		if err := os.Chmod(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		sock := filepath.Join(dir, "s.sock")
		if ln, err = net.Listen("unix", sock); err == nil {
			err = os.Chmod(sock, 0o777)
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln, ln.Addr().String()
}

// foServe runs Server on every connection ln accepts and sends each outcome
// on the returned channel. Sessions nobody took are closed at the end.
func foServe(t *testing.T, ln net.Listener, conf *Config) <-chan handshakeResult {
	results := make(chan handshakeResult, 16)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				s, err := Server(c, conf)
				results <- handshakeResult{s: s, err: err}
			}()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		for {
			select {
			case r := <-results:
				if r.s != nil {
					closeWithin(t, r.s, peerTimeout)
				}
			default:
				return
			}
		}
	})
	return results
}

// foRequireRoot skips a test that must start a child as another user.
func foRequireRoot(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("running a child as another user needs root")
	}
}

// TestFileModeForeignBufferRefused reproduces issue 8, finding 3: a client
// running as another user names the victim's buffer file in the handshake,
// points a queue element at the slice holding the victim's message, and has
// the server echo it. The server must refuse that handshake with an error
// naming the ownership rule, nothing of the victim's message may come back
// to the attacker, and the victim's session must keep working. Over TCP
// the server finds the attacker's uid in /proc/net/tcp.
func TestFileModeForeignBufferRefused(t *testing.T) {
	foRequireRoot(t)
	for _, network := range []string{"unix", "tcp"} {
		t.Run(network, func(t *testing.T) {
			conf := peerConfig(t, MemMapTypeDevShmFile, 0)
			ln, addr := foListen(t, network)
			results := foServe(t, ln, conf)
			secret := fmt.Sprintf("the victim's secret %d %016x", os.Getpid(), rand.Uint64())

			victim, _ := startChild(t, proctest.Config{
				TestName: foChildTest,
				Role:     foRoleVictim,
				Args:     map[string]string{"NET": network, "ADDR": addr, "SECRET": secret},
			})
			vr := awaitHandshake(t, results, peerTimeout)
			if vr.err != nil {
				t.Fatalf("the victim's handshake failed: %v", vr.err)
			}
			vs := vr.s
			st, err := vs.AcceptStream()
			if err != nil {
				t.Fatal(err)
			}
			// Keep the victim's message unreleased, so that its slice holds
			// it for as long as the attack runs.
			msg, err := st.BufferReader().ReadBytes(len(secret))
			if err != nil || string(msg) != secret {
				t.Fatalf("the victim's message: %q, %v", msg, err)
			}
			go serveStreams(vs, echoStream)
			bufPath := vs.buf.Region().Path()
			offset := uintptr(unsafe.Pointer(&msg[0])) - uintptr(unsafe.Pointer(&vs.buf.Region().Mem()[0])) - shm.SliceHeaderSize

			attacker, _ := startChild(t, proctest.Config{
				TestName: foChildTest,
				Role:     foRoleAttacker,
				Args: map[string]string{
					"NET": network, "ADDR": addr, "BUF": bufPath,
					"OFFSET": strconv.FormatUint(uint64(offset), 10),
				},
				Credential: &syscall.Credential{Uid: foAttackerUID, Gid: foAttackerUID},
			})
			ar := awaitHandshake(t, results, peerTimeout)
			t.Logf("the attacker's handshake: %v", ar.err)
			if ar.err == nil {
				go serveStreams(ar.s, echoStream)
				t.Errorf("the server accepted a client of uid %d that named %s, a buffer file of uid 0", foAttackerUID, bufPath)
			} else {
				want := fmt.Sprintf("region file %s is owned by uid 0, the peer is uid %d", bufPath, foAttackerUID)
				if !errors.Is(ar.err, ErrHandshake) || !errors.Is(ar.err, shm.ErrRegionNotOwned) || !strings.Contains(ar.err.Error(), want) {
					t.Errorf("the attacker's handshake failed with %q;\nwant an ErrHandshake wrapping shm.ErrRegionNotOwned and saying %q", ar.err, want)
				}
			}
			if err := attacker.Wait(childStartTimeout); err != nil {
				t.Fatalf("attacker: %v", err)
			}
			echo, end := foAttackerResult(t, attacker.Lines())
			leaked := 0
			if bytes.Contains(echo, []byte(secret)) {
				leaked = len(secret)
			}
			t.Logf("the attacker got %d bytes echoed, %d of them the victim's %d-byte message (then: %s)", len(echo), leaked, len(secret), end)
			if leaked > 0 {
				t.Errorf("the attacker read the victim's message through the server: echo %q", echo)
			}
			if err := victim.Stop(childStartTimeout); err != nil {
				t.Errorf("victim: %v", err)
			}
		})
	}
}

// foAttackerResult parses the attacker's "echo" and "end" lines.
func foAttackerResult(t *testing.T, lines []string) (echo []byte, end string) {
	t.Helper()
	seen := false
	for _, l := range lines {
		if h, ok := strings.CutPrefix(l, "echo "); ok {
			b, err := hex.DecodeString(strings.TrimSpace(h))
			if err != nil {
				t.Fatalf("attacker output %q: %v", l, err)
			}
			echo, seen = b, true
		}
		if e, ok := strings.CutPrefix(l, "end "); ok {
			end = e
		}
	}
	if !seen {
		t.Fatalf("the attacker printed no echo line: %q", lines)
	}
	return echo, end
}

// TestFileModeOtherProcessMapsAnew checks the cache rule between processes
// of one user. Sessions of one client process that name one buffer file
// share the server's mapping of it. A second process of the same user that
// names that file passes the ownership check (its user owns the file), but
// gets a mapping of its own rather than the cached one. Same-user access is
// not a boundary the server can enforce: that process could open and map
// the file itself. The cache rule keeps one process's sessions from being
// handed state the server built for another process.
func TestFileModeOtherProcessMapsAnew(t *testing.T) {
	conf := peerConfig(t, MemMapTypeDevShmFile, 0)
	ln, addr := foListen(t, "unix")
	results := foServe(t, ln, conf)
	start := func(sessions int, buf string) (*proctest.Child, string) {
		return startChild(t, proctest.Config{
			TestName: foChildTest,
			Role:     foRoleNamer,
			Args:     map[string]string{"ADDR": addr, "SESSIONS": strconv.Itoa(sessions), "BUF": buf},
		})
	}
	await := func(who string) *Session {
		r := awaitHandshake(t, results, peerTimeout)
		if r.err != nil {
			t.Fatalf("handshake of %s failed: %v", who, r.err)
		}
		return r.s
	}

	owner, bufPath := start(2, "")
	s1, s2 := await("the owner's first session"), await("the owner's second session")
	if s1.buf != s2.buf {
		t.Errorf("two sessions of one process naming %s got separate mappings", bufPath)
	}
	if n := foMappings(t, bufPath); n != 1 {
		t.Errorf("after two sessions of one process, the server maps %s %d times, want 1", bufPath, n)
	}

	other, _ := start(1, bufPath)
	s3 := await("the other process's session")
	n := foMappings(t, bufPath)
	t.Logf("after a session of another process of the same user, the server maps %s %d times", bufPath, n)
	if s3.buf == s1.buf || n != 2 {
		t.Errorf("another process naming %s was handed the owner's cached mapping (%d mappings, want 2)", bufPath, n)
	}
	for _, c := range []*proctest.Child{owner, other} {
		if err := c.Stop(childStartTimeout); err != nil {
			t.Errorf("namer: %v", err)
		}
	}
}

// foMappings counts this process's mappings of the file path, as
// /proc/self/maps lists them: the areas that start at file offset 0 (the
// kernel may split one mapping into several areas, never merge two).
func foMappings(t *testing.T, path string) int {
	t.Helper()
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	n := 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if fields := strings.Fields(sc.Text()); len(fields) >= 6 && fields[5] == path && strings.Trim(fields[2], "0") == "" {
			n++
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return n
}

// cachedBuffers returns how many cached mappings are held under path, for
// any peer.
func cachedBuffers(path string) int {
	serverBuffers.Lock()
	defer serverBuffers.Unlock()
	n := 0
	for k := range serverBuffers.m {
		if k.path == path {
			n++
		}
	}
	return n
}

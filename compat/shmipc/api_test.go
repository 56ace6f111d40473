package shmipc

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	shm "github.com/goshm/shmipc"
	"golang.org/x/sys/unix"
)

// Values shmipc-go programs may compare with == stay comparable.
var _ = func(a, b *Listener) bool { return *a == *b }

// echoListener serves io.Copy echoes on the streams of Listen(sock).
func echoListener(t *testing.T, sock string) net.Listener {
	t.Helper()
	ln, err := Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			if _, ok := c.(*Stream); !ok {
				t.Errorf("Accept returned a %T", c)
			}
			go func() { defer c.Close(); io.Copy(c, c) }()
		}
	}()
	return ln
}

// TestListenAcceptAndErrors: Listen's Accept returns streams usable as
// net.Conn, in file mode too; the errors programs compare with == are
// returned as the variables themselves.
func TestListenAcceptAndErrors(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s.sock")
	echoListener(t, sock)
	if _, err := ListenWithBacklog(sock+"2", 0); err == nil {
		t.Error("ListenWithBacklog with backlog 0 succeeded")
	}
	conf := DefaultSessionManagerConfig()
	conf.Config = testConfig(testPrefix(t))
	conf.MemMapType = MemMapTypeDevShmFile
	conf.Address = sock
	sm, err := NewSessionManager(conf)
	if err != nil {
		t.Fatal(err)
	}
	defer sm.Close()
	st, err := sm.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	if got, err := st.BufferReader().ReadString(5); got != "hello" || err != nil {
		t.Fatalf("echo: %q, %v", got, err)
	}
	st.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	if _, err := st.BufferReader().ReadByte(); err != ErrTimeout {
		t.Errorf("read past the deadline: %v, want ErrTimeout", err)
	}
	var ne net.Error
	if !errors.As(ErrTimeout, &ne) || !ne.Timeout() {
		t.Error("ErrTimeout is not a net.Error timeout")
	}
	st.Close()
	if st.IsOpen() {
		t.Error("IsOpen after Close")
	}
	if _, err := st.Write([]byte("x")); err != ErrStreamClosed {
		t.Errorf("Write after Close: %v, want ErrStreamClosed", err)
	}
	if err := st.BufferWriter().WriteString("x"); err != nil {
		// Building a message needs no open stream; sending it does.
		t.Logf("WriteString after Close: %v", err)
	}
	if err := st.Flush(false); err != ErrStreamClosed {
		t.Errorf("Flush after Close: %v, want ErrStreamClosed", err)
	}
	if ErrEndOfStream != io.EOF {
		t.Error("ErrEndOfStream is not io.EOF")
	}
}

// TestPeerCloseEndsStream: a stream the server closes reads ErrEndOfStream
// after the data it sent, and then is not open; the server session's
// CloseChan closes when the client goes.
func TestPeerCloseEndsStream(t *testing.T) {
	prefix := testPrefix(t)
	sock := filepath.Join(t.TempDir(), "s.sock")
	ul, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer ul.Close()
	served := make(chan *Session, 1)
	go func() {
		conn, err := ul.Accept()
		if err != nil {
			return
		}
		sess, err := Server(conn, testConfig(prefix))
		if err != nil {
			t.Error(err)
			return
		}
		served <- sess
		st, err := sess.AcceptStream()
		if err != nil {
			return
		}
		b, _ := st.BufferReader().ReadBytes(3)
		st.Write(b)
		st.Close()
	}()
	conf := DefaultSessionManagerConfig()
	conf.Config = testConfig(prefix)
	conf.Address = sock
	sm, err := NewSessionManager(conf)
	if err != nil {
		t.Fatal(err)
	}
	st, err := sm.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	st.Write([]byte("abc"))
	if b, err := st.BufferReader().ReadBytes(3); string(b) != "abc" || err != nil {
		t.Fatalf("reply %q, %v", b, err)
	}
	if _, err := st.BufferReader().ReadByte(); err != ErrEndOfStream {
		t.Errorf("read after the peer closed: %v, want ErrEndOfStream", err)
	}
	if st.IsOpen() {
		t.Error("IsOpen after reading the end of the stream")
	}
	sess := <-served
	sm.Close()
	select {
	case <-sess.CloseChan():
	case <-time.After(5 * time.Second):
		t.Fatal("server session's CloseChan still open after the client closed")
	}
	if !sess.IsClosed() || sess.IsHealthy() || sess.Err() == nil {
		t.Errorf("ended session: IsClosed %v, IsHealthy %v, Err %v", sess.IsClosed(), sess.IsHealthy(), sess.Err())
	}
}

// TestVerifyConfig: bad configurations are refused with a reason.
func TestVerifyConfig(t *testing.T) {
	if err := VerifyConfig(DefaultConfig()); err != nil {
		t.Fatalf("DefaultConfig: %v", err)
	}
	c := DefaultConfig()
	c.MemMapType = MemMapTypeDevShmFile
	c.ShareMemoryPathPrefix = "/dev/shm/" + strings.Repeat("x", 300)
	if err := VerifyConfig(c); !errors.Is(err, ErrFileNameTooLong) || !errors.Is(err, shm.ErrInvalidConfig) {
		t.Errorf("long prefix: %v", err)
	}
	c = DefaultConfig()
	c.BufferSliceSizes = append(c.BufferSliceSizes, nil)
	if err := VerifyConfig(c); !errors.Is(err, shm.ErrInvalidConfig) {
		t.Errorf("nil size class: %v", err)
	}
	c = DefaultConfig()
	c.QueueCap = 10
	if err := VerifyConfig(c); !errors.Is(err, shm.ErrInvalidConfig) || errors.Is(err, ErrFileNameTooLong) {
		t.Errorf("QueueCap 10: %v", err)
	}
	if _, err := NewSessionManager(&SessionManagerConfig{Config: c, Address: "x"}); !errors.Is(err, shm.ErrInvalidConfig) {
		t.Errorf("NewSessionManager with QueueCap 10: %v", err)
	}
}

// syncBuffer is a bytes.Buffer safe for concurrent use.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) Len() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Len()
}

// TestLogOutputAndLevel: a failed handshake is logged to LogOutput at the
// default level, and not at all after SetLogLevel(5).
func TestLogOutputAndLevel(t *testing.T) {
	defer SetLogLevel(3)
	sock := filepath.Join(t.TempDir(), "s.sock")
	var logs syncBuffer
	conf := NewDefaultListenerConfig(sock, "unix")
	conf.LogOutput = &logs
	ln, err := NewListener(newCBServer(), conf)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go ln.Run()
	junk := func() {
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		c.Write(bytes.Repeat([]byte{0xff}, 64))
		c.Close()
	}
	junk()
	for deadline := time.Now().Add(5 * time.Second); logs.Len() == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("nothing logged for a failed handshake")
		}
	}
	SetLogLevel(5)
	n := logs.Len()
	junk()
	time.Sleep(300 * time.Millisecond)
	if logs.Len() != n {
		t.Errorf("logged after SetLogLevel(5): %q", logs.b.String()[n:])
	}
}

// TestListenerCloseLeavesStreams: Close stops accepting, calls OnShutdown
// and leaves accepted streams working.
func TestListenerCloseLeavesStreams(t *testing.T) {
	prefix := testPrefix(t)
	sock := filepath.Join(t.TempDir(), "s.sock")
	conf := NewDefaultListenerConfig(sock, "unix")
	conf.Config = testConfig(prefix)
	cb := newCBServer()
	ln, err := NewListener(cb, conf)
	if err != nil {
		t.Fatal(err)
	}
	go ln.Run()
	sconf := DefaultSessionManagerConfig()
	sconf.Config = testConfig(prefix)
	sconf.Address = sock
	sm, err := NewSessionManager(sconf)
	if err != nil {
		t.Fatal(err)
	}
	defer sm.Close()
	st, err := sm.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	if err := request(st, []byte("before")); err != nil {
		t.Fatal(err)
	}
	ln.Close()
	select {
	case <-cb.shutdown:
	case <-time.After(5 * time.Second):
		t.Fatal("no OnShutdown after Close")
	}
	if err := request(st, []byte("after")); err != nil {
		t.Errorf("request on an accepted stream after Close: %v", err)
	}
	if _, err := os.Stat(sock); err == nil {
		t.Error("socket file left after Close")
	}
}

// TestMemfdAndDebug: MemfdCreate gives a descriptor; the Debug functions
// print the file and the open sessions' regions.
func TestMemfdAndDebug(t *testing.T) {
	fd, err := MemfdCreate("compat-test", unix.MFD_CLOEXEC)
	if err != nil || fd < 0 {
		t.Fatalf("MemfdCreate: %d, %v", fd, err)
	}
	unix.Close(fd)
	sock := filepath.Join(t.TempDir(), "s.sock")
	echoListener(t, sock)
	conf := DefaultSessionManagerConfig()
	conf.Config = testConfig(testPrefix(t))
	conf.Address = sock
	sm, err := NewSessionManager(conf)
	if err != nil {
		t.Fatal(err)
	}
	defer sm.Close()
	st, err := sm.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	out := captureStdout(t, func() {
		DebugBufferListDetail(sock)
		DebugQueueDetail("/nonexistent")
	})
	for _, want := range []string{sock + ": 0 bytes", "session " + st.Session().ID() + ": buffer region of 33554432 bytes", "slices of 8172 bytes", "/nonexistent: stat", "queue region of"} {
		if !strings.Contains(out, want) {
			t.Errorf("Debug output lacks %q:\n%s", want, out)
		}
	}
}

// captureStdout returns what fn prints on os.Stdout.
func captureStdout(t *testing.T, fn func()) string {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	old := os.Stdout
	os.Stdout = w
	done := make(chan []byte)
	go func() { b, _ := io.ReadAll(r); done <- b }()
	fn()
	os.Stdout = old
	w.Close()
	return string(<-done)
}

package shmipc

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/goshm/shmipc/internal/proctest"
	"github.com/goshm/shmipc/internal/shm"
)

// One process listens, others serve: socket activation, a supervisor, a
// server that forks workers after listen(2). SO_PEERCRED then names the
// listening process for every session, whichever process serves it. A
// client's sessions to one server process share a buffer region
// (region_pool.go); sessions to two serving processes must not, or one
// server reads and breaks what the client sends the other.
//
// Here the test listens on two sockets and hands them to two children: an
// honest echo server on A, and on B a raw server that maps the client's
// buffer region, looks in it for what the client sent A, and then breaks
// its free lists.
func TestServingProcessesBehindOneListener(t *testing.T) {
	dir := t.TempDir()
	listen := func(name string) (string, *os.File) {
		path := filepath.Join(dir, name)
		ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
		if err != nil {
			t.Fatal(err)
		}
		f, err := ln.File()
		if err != nil {
			t.Fatal(err)
		}
		ln.SetUnlinkOnClose(false)
		ln.Close() // the children hold the socket now; this process stays the one that listened
		t.Cleanup(func() { f.Close() })
		return path, f
	}
	sockA, fileA := listen("a.sock")
	sockB, fileB := listen("b.sock")
	secret := fmt.Sprintf("secret-%d-%d", os.Getpid(), time.Now().UnixNano())
	startChild(t, proctest.Config{TestName: "TestServingProcessChild", Role: "echo",
		ExtraFiles: []*os.File{fileA}, Args: map[string]string{"PREFIX": shmPrefix(t, "served")}})
	raw, _ := startChild(t, proctest.Config{TestName: "TestServingProcessChild", Role: "raw",
		ExtraFiles: []*os.File{fileB}, Args: map[string]string{"SECRET": secret}})

	conf := DefaultConfig()
	conf.ShareMemoryBufferCap = 1 << 20
	conf.BufferSliceSizes = ReferenceSliceSizes()
	conf.QueueCap = 64
	conf.ShareMemoryPathPrefix = shmPrefix(t, "serving")
	dial := func(sock string) *Session {
		s, err := Dial("unix", sock, conf)
		if err != nil {
			t.Fatalf("dial %s: %v", filepath.Base(sock), err)
		}
		t.Cleanup(func() { s.Close() })
		return s
	}
	a1, a2, b := dial(sockA), dial(sockA), dial(sockB)
	for _, s := range []*Session{a1, a2, b} {
		if id, err := peerOf(s.ec.conn); err != nil || int(id.pid) != os.Getpid() {
			t.Fatalf("SO_PEERCRED of a session: %v, %v; want this process, which listened", id, err)
		}
	}
	if a1.buf != a2.buf {
		t.Errorf("two sessions to one server process have buffer regions %s and %s; want one", a1.buf.Region().Path(), a2.buf.Region().Path())
	}
	if a1.buf == b.buf {
		t.Errorf("sessions to two server processes share the buffer region %s", b.buf.Region().Path())
	}
	if err := echoRoundTrip(a1, secret); err != nil {
		t.Fatalf("echo on A: %v", err)
	}
	b.Close() // the raw server looks at its mapping once it reads the end of the connection
	line, err := raw.ReadLine(30 * time.Second)
	if err != nil {
		t.Fatalf("the raw server did not report: %v", err)
	}
	if line != "clean" {
		t.Errorf("the raw server on B reports %q: it saw what the client sent to A", line)
	}
	for _, s := range []*Session{a1, a2} {
		if err := echoRoundTrip(s, "after B broke its region"); err != nil {
			t.Errorf("echo on A after B broke the region it was given: %v", err)
		}
	}
}

// TestServingProcessChild is a child of TestServingProcessesBehindOneListener:
// role "echo" serves the listening socket it inherits (descriptor 3) with a
// Listener; role "raw" accepts one client on it and plays the raw server.
func TestServingProcessChild(t *testing.T) {
	if !proctest.IsChild() {
		t.Skip("a child of TestServingProcessesBehindOneListener")
	}
	l, err := net.FileListener(os.NewFile(3, "listener"))
	if err != nil {
		t.Fatal(err)
	}
	switch proctest.Role() {
	case "echo":
		conf := DefaultConfig()
		conf.ShareMemoryPathPrefix = proctest.MustArg(t, "PREFIX")
		ln := NewListener(l, conf)
		defer ln.Close()
		go serveStreams(ln, echoStream)
		proctest.Ready()
		<-proctest.StdinClosed()
	case "raw":
		secret := []byte(proctest.MustArg(t, "SECRET"))
		proctest.Ready()
		c, err := l.(*net.UnixListener).AcceptUnix()
		if err != nil {
			t.Fatal(err)
		}
		buf, _, _, err := serveRawHandshake(c, MemMapTypeMemFd)
		if err != nil {
			t.Fatal(err)
		}
		var b [256]byte
		for {
			if _, err := c.Read(b[:]); err != nil {
				break
			}
		}
		seen := bytes.Contains(buf, secret)
		for _, l := range rawLists(buf) {
			*(*uint32)(unsafe.Pointer(&buf[l.header+listHeadOff])) = 0xFFFFFFF0
		}
		if seen {
			proctest.Println("seen")
		} else {
			proctest.Println("clean")
		}
		<-proctest.StdinClosed()
	default:
		t.Fatalf("unknown role %q", proctest.Role())
	}
}

// TestHandshakeRepliesFromTwoProcesses: this process answers the version
// exchange, another process holding the same socket sends AckReadyRecvFD.
// The client chose its buffer region for the first; it must not send the
// region's descriptors to the second.
func TestHandshakeRepliesFromTwoProcesses(t *testing.T) {
	conf := peerConfig(t, MemMapTypeMemFd, 0)
	ln, sock := listenRaw(t)
	dialed := startHandshake(func() (*Session, error) { return Dial("unix", sock, conf) })
	c := acceptRaw(t, ln)
	c.SetDeadline(time.Now().Add(peerTimeout))
	if _, err := readN(c, 8); err != nil { // ExchangeProtoVersion
		t.Fatal(err)
	}
	if _, err := c.Write(rawFrame(8, rawMagic, 3, 4)); err != nil {
		t.Fatal(err)
	}
	h, err := readN(c, 8) // ShareMemoryByMemfd
	if err != nil {
		t.Fatal(err)
	}
	if _, err := readN(c, int(binary.BigEndian.Uint32(h))-8); err != nil {
		t.Fatal(err)
	}
	f, err := c.File()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	child, _ := startChild(t, proctest.Config{TestName: "TestHandshakeRepliesChild", Role: "ack", ExtraFiles: []*os.File{f}})
	res := awaitHandshake(t, dialed, 3*peerTimeout)
	if res.err == nil {
		res.s.Close()
		t.Fatal("Dial succeeded with AckReadyRecvFD from another process")
	}
	if !strings.Contains(res.err.Error(), "sent by process") {
		t.Errorf("Dial: %v; want it to name the two processes", res.err)
	}
	line, err := child.ReadLine(30 * time.Second)
	if err != nil {
		t.Fatalf("the child did not report: %v", err)
	}
	if !strings.HasPrefix(line, "fds 0") {
		t.Errorf("the process that sent AckReadyRecvFD reports %q; want no descriptors", line)
	}
}

// TestHandshakeRepliesChild is the child of
// TestHandshakeRepliesFromTwoProcesses: it sends AckReadyRecvFD on the
// connection it inherits and reports the descriptors it then receives.
func TestHandshakeRepliesChild(t *testing.T) {
	if !proctest.IsChild() {
		t.Skip("a child of TestHandshakeRepliesFromTwoProcesses")
	}
	fc, err := net.FileConn(os.NewFile(3, "conn"))
	if err != nil {
		t.Fatal(err)
	}
	c := fc.(*net.UnixConn)
	proctest.Ready()
	if _, err := c.Write(rawFrame(8, rawMagic, 3, 7)); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(3 * time.Second))
	fds, err := rawRecvFds(c)
	shm.CloseFds(fds...)
	proctest.Println(fmt.Sprintf("fds %d %v", len(fds), err))
	<-proctest.StdinClosed()
}

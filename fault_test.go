package shmipc

import (
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/shm"
	"golang.org/x/sys/unix"
)

// TestShrunkRegionFaultsAreErrors truncates a file-mode buffer region after
// the handshake, as a peer that created it could. Touching the lost pages
// must end the sessions with an error naming a memory fault, not crash the
// process, and other sessions must keep working.
func TestShrunkRegionFaultsAreErrors(t *testing.T) {
	conf := DefaultConfig()
	conf.MemMapType = MemMapTypeDevShmFile
	conf.ShareMemoryBufferCap = 4 << 20
	conf.BufferSliceSizes = ReferenceSliceSizes()
	conf.ShareMemoryPathPrefix = shmPrefix(t, "fault")
	ln := startEchoListener(t, conf)
	good, err := Dial("unix", ln.Addr().String(), conf)
	if err != nil {
		t.Fatal(err)
	}
	defer good.Close()
	before, _ := filepath.Glob(conf.ShareMemoryPathPrefix + "_*_buffer")

	victim, err := Dial("unix", ln.Addr().String(), conf)
	if err != nil {
		t.Fatal(err)
	}
	defer victim.Close()
	after, _ := filepath.Glob(conf.ShareMemoryPathPrefix + "_*_buffer")
	victimBuf := added(before, after)
	if victimBuf == "" {
		t.Fatalf("cannot tell the victim's buffer file among %v", after)
	}
	// A version-2 client does not wait for the server to map the regions:
	// one round trip first, so that the server has them when they shrink.
	st, err := victim.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	st.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := st.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(st, make([]byte, 4)); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(victimBuf, 4096); err != nil {
		t.Fatal(err)
	}
	msg := bytes.Repeat([]byte("x"), 300000)
	st.SetDeadline(time.Now().Add(5 * time.Second))
	_, werr := st.Write(msg)
	var rerr error
	if werr == nil {
		_, rerr = io.ReadFull(st, make([]byte, len(msg)))
	}
	err = errors.Join(werr, rerr)
	if err == nil {
		t.Fatal("writing into a shrunk region succeeded")
	}
	if !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "memory fault") {
		t.Fatalf("error %v does not wrap ErrProtocol naming a memory fault", err)
	}
	st.Close()

	// The other session is unaffected.
	gst, err := good.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer gst.Close()
	gst.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := gst.Write([]byte("still here")); err != nil {
		t.Fatal(err)
	}
	reply := make([]byte, 10)
	if _, err := io.ReadFull(gst, reply); err != nil || string(reply) != "still here" {
		t.Fatalf("other session: %q, %v", reply, err)
	}
}

// TestSpinningLoopFault: a reader polling its session's queue when the
// peer shrinks the queue region ends the session with a memory-fault
// error, which that reader gets, and gives its spinning slot back, so
// that other sessions still spin.
func TestSpinningLoopFault(t *testing.T) {
	conf := DefaultConfig()
	conf.MemMapType = MemMapTypeDevShmFile
	conf.ShareMemoryPathPrefix = shmPrefix(t, "spinfault")
	s := spinningClient(t, conf) // its reader polls until the fault
	queues, _ := filepath.Glob(conf.ShareMemoryPathPrefix + "_*_queue_0")
	if len(queues) != 1 {
		t.Fatalf("queue files %v, want the session's one", queues)
	}
	st, err := s.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	st.SetDeadline(time.Now().Add(4 * peerTimeout))

	const active = 0 // spinningClient
	if _, err := st.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(st, make([]byte, 4)); err != nil {
		t.Fatal(err)
	}
	// This reader waits for a reply that never comes, and polls the queue.
	read := readerSpunFor(t, st, active)
	if err := os.Truncate(queues[0], 0); err != nil {
		t.Fatal(err)
	}
	var rerr error
	select {
	case rerr = <-read:
	case <-time.After(peerTimeout):
		t.Fatal("the reader did not return after its queue region shrank")
	}
	if !errors.Is(rerr, ErrProtocol) || !strings.Contains(rerr.Error(), "memory fault") {
		t.Fatalf("the reader got %v, want an error wrapping ErrProtocol naming a memory fault", rerr)
	}
	waitUntil(t, "the spinning slot is given back", peerTimeout, func() bool { return spinning.active.Load() == active })
}

// added returns a name of after that is not in before, or "".
func added(before, after []string) string {
	for _, f := range after {
		if !contains(before, f) {
			return f
		}
	}
	return ""
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// TestRequireSealedMemory checks that a server with RequireSealedMemory
// accepts this package's sealed memfds and refuses file-mode regions.
func TestRequireSealedMemory(t *testing.T) {
	dir := t.TempDir()
	srv := DefaultConfig()
	srv.RequireSealedMemory = true
	ln, err := Listen("unix", filepath.Join(dir, "s.sock"), srv)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	sess, err := Dial("unix", filepath.Join(dir, "s.sock"), nil)
	if err != nil {
		t.Fatalf("sealed memfds refused: %v", err)
	}
	sess.Close()

	conf := DefaultConfig()
	conf.MemMapType = MemMapTypeDevShmFile
	conf.ShareMemoryBufferCap = 2 << 20
	conf.BufferSliceSizes = ReferenceSliceSizes()
	conf.ShareMemoryPathPrefix = shmPrefix(t, "seal")
	sess, err = Dial("unix", filepath.Join(dir, "s.sock"), conf)
	if err != nil {
		t.Fatal(err) // version 2 has no reply: the client learns when the session ends
	}
	defer sess.Close()
	select {
	case <-sess.closed:
	case <-time.After(5 * time.Second):
		t.Fatal("a file-mode session to a server requiring sealed memory stayed up")
	}
}

// A client that shrinks and regrows its buffer file while the server maps
// it makes the server's reading of the headers fault now and then. Each
// such handshake fails, and must not keep the mapping or the descriptor it
// took: a client repeating it would run the server out of descriptors.
func TestServerBufferMapFaultKeepsNothing(t *testing.T) {
	p := filepath.Join(t.TempDir(), "buf")
	plans, err := planLists(1<<20, ReferenceSliceSizes())
	if err != nil {
		t.Fatal(err)
	}
	size := int(bufferRegionSize(plans))
	r, fd, err := createRegion(MemMapTypeDevShmFile, p, size)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Release()
	defer shm.CloseFds(fd)
	shm.InitBuffer(r.Mem(), plans)
	stop := make(chan struct{})
	flipped := make(chan struct{})
	go func() {
		defer close(flipped)
		for {
			select {
			case <-stop:
				return
			default:
			}
			_ = unix.Ftruncate(fd, 0)
			_ = unix.Ftruncate(fd, int64(size))
			shm.Quietly(func() { shm.InitBuffer(r.Mem(), plans) }) // valid again for the next look
		}
	}()
	fds := func() int {
		ents, err := os.ReadDir("/proc/self/fd")
		if err != nil {
			t.Fatal(err)
		}
		return len(ents)
	}
	before := fds()
	faults := 0
	for range 3000 {
		func() {
			defer func() {
				if rec := recover(); rec != nil {
					_ = shm.FaultError(rec) // re-panics anything but a memory fault
					faults++
				}
			}()
			defer debug.SetPanicOnFault(debug.SetPanicOnFault(true)) // as the handshake does
			m, err := mapServerBuffer(p, fd, false, peerID{})
			if err == nil {
				m.Region().Release()
			}
		}()
	}
	close(stop)
	<-flipped
	t.Logf("%d of 3000 mappings faulted", faults)
	if after := fds(); after > before {
		t.Errorf("%d descriptors more after %d faults", after-before, faults)
	}
}

// A writer waiting its turn for room faults when the region shrinks under
// it: it must leave the queue of writers waiting for room, or every later
// writer of its size class would wait behind it.
func TestWriterFaultLeavesSpaceQueue(t *testing.T) {
	conf := peerConfig(t, MemMapTypeDevShmFile, 0)
	conf.WriteSpaceTimeout = 3 * time.Second
	ln, err := Listen("unix", filepath.Join(t.TempDir(), "a.sock"), conf)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go serveStreams(ln, func(*Stream) {}) // never reads: the slices stay held
	c, err := Dial("unix", ln.Addr().String(), conf)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	st, err := c.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		msg := make([]byte, 4000)
		for {
			if _, err := st.Write(msg); err != nil {
				done <- err
				return
			}
		}
	}()
	waitUntil(t, "the writer waits for room", peerTimeout, func() bool { return c.buf.Space().Waiting() })
	bufs, _ := filepath.Glob(conf.ShareMemoryPathPrefix + "_*_buffer")
	if len(bufs) != 1 {
		t.Fatalf("buffer files %v", bufs)
	}
	if err := os.Truncate(bufs[0], 0); err != nil {
		t.Fatal(err)
	}
	if err := <-done; !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "memory fault") {
		t.Fatalf("write error %v, want a memory fault wrapping ErrProtocol", err)
	}
	if c.buf.Space().Waiting() {
		t.Error("writers still counted as waiting for room after the fault")
	}
}

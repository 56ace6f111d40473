package shmipc

// Isolation: a peer can hurt only its own session. Each test plays a hostile
// client (the raw peer of rawpeer_test.go) against a real server and checks that
// the server process survives, that the victim session ends with an error
// naming what went wrong, and that a well-behaved session of the same
// process keeps working.

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/shm"
)

// isoServer is a server whose streams are handled by handle, with a good
// client session for checking that the process still serves others.
type isoServer struct {
	testServer
	goodSrv atomic.Pointer[Session] // the server side of good
}

func isoStartServer(t *testing.T, conf *Config, handle func(*Stream)) *isoServer {
	t.Helper()
	ln, err := Listen("unix", filepath.Join(t.TempDir(), "iso.sock"), conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	e := &isoServer{testServer: testServer{conf: conf, ln: ln, addr: ln.Addr().String()}}
	go serveStreams(ln, func(st *Stream) {
		if st.Session() == e.goodSrv.Load() {
			echoStream(st)
		} else {
			handle(st)
		}
	})
	return e
}

// dialGood opens the well-behaved session, whose streams the server
// echoes.
func (e *isoServer) dialGood(t *testing.T) {
	t.Helper()
	before := e.sessionSet()
	good, err := Dial("unix", e.addr, peerConfig(t, MemMapTypeMemFd, 0))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { good.Close() })
	e.good = good
	e.goodSrv.Store(e.waitSession(t, before))
}

// connect makes a hostile client of mode with valid regions and returns it
// with its regions and the server session it got.
func (e *isoServer) connect(t *testing.T, mode MemMapType) (*rawPeer, *rawRegions, *Session) {
	t.Helper()
	return connectRawClientRegions(t, &e.testServer, mode)
}

// isoReadMethods are the ways an application can wait for data. Each reads
// the 5-byte greeting, then waits for more and returns that wait's error.
var isoReadMethods = map[string]func(st *Stream) error{
	"Read": func(st *Stream) error {
		p := make([]byte, 5)
		if _, err := io.ReadFull(st, p); err != nil {
			return fmt.Errorf("greeting: %w", err)
		}
		_, err := st.Read(p)
		return err
	},
	"ReadBytes": func(st *Stream) error {
		r := st.BufferReader()
		if _, err := r.ReadBytes(5); err != nil {
			return fmt.Errorf("greeting: %w", err)
		}
		_, err := r.ReadBytes(1)
		return err
	},
	"Peek": func(st *Stream) error {
		r := st.BufferReader()
		if _, err := r.ReadBytes(5); err != nil {
			return fmt.Errorf("greeting: %w", err)
		}
		_, err := r.Peek(1)
		return err
	},
	"Discard": func(st *Stream) error {
		r := st.BufferReader()
		if _, err := r.Discard(5); err != nil {
			return fmt.Errorf("greeting: %w", err)
		}
		_, err := r.Discard(1)
		return err
	},
	"ReadByte": func(st *Stream) error {
		r := st.BufferReader()
		if _, err := r.Discard(5); err != nil {
			return fmt.Errorf("greeting: %w", err)
		}
		_, err := r.ReadByte()
		return err
	},
	"netpoll.Until": func(st *Stream) error {
		r := st.NetpollReader()
		if err := r.Skip(5); err != nil {
			return fmt.Errorf("greeting: %w", err)
		}
		_, err := r.Until('\n')
		return err
	},
	"netpoll.ReadBinary": func(st *Stream) error {
		r := st.NetpollReader()
		if err := r.Skip(5); err != nil {
			return fmt.Errorf("greeting: %w", err)
		}
		_, err := r.ReadBinary(1)
		return err
	},
	"netpoll.ReadString": func(st *Stream) error {
		r := st.NetpollReader()
		if err := r.Skip(5); err != nil {
			return fmt.Errorf("greeting: %w", err)
		}
		_, err := r.ReadString(1)
		return err
	},
	"netpoll.Slice": func(st *Stream) error {
		r := st.NetpollReader()
		if err := r.Skip(5); err != nil {
			return fmt.Errorf("greeting: %w", err)
		}
		_, err := r.Slice(1)
		return err
	},
	"netpoll.Skip": func(st *Stream) error {
		r := st.NetpollReader()
		if err := r.Skip(5); err != nil {
			return fmt.Errorf("greeting: %w", err)
		}
		return r.Skip(1)
	},
}

// A client shrinks its buffer region file while a server-side reader waits
// for data, then publishes a message in the part that is gone. Whatever the
// reader waits in, the fault must end that session only, with an error, and
// Close must not hang.
func TestIsolationFaultWhileReaderWaits(t *testing.T) {
	for name, read := range isoReadMethods {
		t.Run(name, func(t *testing.T) {
			conf := peerConfig(t, MemMapTypeMemFd, readerSpin)
			readErr := make(chan error, 1)
			srv := isoStartServer(t, conf, func(st *Stream) {
				defer st.Close()
				readErr <- read(st)
			})
			srv.dialGood(t)
			p, r, victim := srv.connect(t, MemMapTypeDevShmFile)
			p.publish(2, p.msg("hello"), shm.StatusOpened)
			// A slice near the end of the region, for the message that will
			// lie beyond the file's new end.
			var far uint32
			for {
				li, off, err := p.bm.Alloc(100, false, false)
				if err != nil || li < 0 {
					t.Fatalf("no slice to spare: %d %v", li, err)
				}
				if off > 64<<10 {
					far = off
					break
				}
			}
			copy(p.bm.SliceData(0, far), "lost")
			p.bm.LinkSlice(far, 4, 0)
			time.Sleep(20 * time.Millisecond) // let the reader consume the greeting and wait
			if err := os.Truncate(r.bufPath, 4096); err != nil {
				t.Fatal(err)
			}
			p.publish(2, far, shm.StatusOpened)
			select {
			case err := <-readErr:
				if err == nil || !errors.Is(err, ErrSessionClosed) {
					t.Fatalf("the waiting %s returned %v, want the session's error", name, err)
				}
			case <-time.After(peerTimeout):
				t.Fatalf("the waiting %s did not return within %v", name, peerTimeout)
			}
			err := waitSessionClosed(t, victim, peerTimeout)
			if !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "memory fault") {
				t.Errorf("victim session error %v, want a memory fault wrapping ErrProtocol", err)
			}
			closeWithin(t, victim, peerTimeout)
			srv.checkGood(t)
		})
	}
}

// Stats (and so AggregateStats and PublishExpvar) reads the queue
// counters in shared memory: a truncated queue file must end that session,
// not the process.
func TestIsolationFaultDuringStats(t *testing.T) {
	conf := peerConfig(t, MemMapTypeMemFd, 0)
	srv := isoStartServer(t, conf, echoStream)
	srv.dialGood(t)
	_, r, victim := srv.connect(t, MemMapTypeDevShmFile)
	mapped := foMappings(t, r.queuePath) // the server's mapping and the raw client's
	if err := os.Truncate(r.queuePath, 0); err != nil {
		t.Fatal(err)
	}
	st := victim.Stats()
	if st.SendQueueDepth != 0 || st.RecvQueueDepth != 0 || st.Lists != nil {
		t.Errorf("Stats of a session whose queue vanished: %+v, want zero gauges", st)
	}
	_ = AggregateStats()
	err := waitSessionClosed(t, victim, peerTimeout)
	if !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "memory fault") {
		t.Errorf("victim session error %v, want a memory fault wrapping ErrProtocol", err)
	}
	closeWithin(t, victim, peerTimeout)
	// The end of the session is complete although the queue faults: the
	// server unmaps it and the listener forgets the session.
	waitUntil(t, "the server unmaps the faulting queue and forgets the session", peerTimeout, func() bool {
		return foMappings(t, r.queuePath) < mapped && !srv.sessionSet()[victim]
	})
	srv.checkGood(t)
}

// Once Close has returned, nothing more is taken from the queue or handed
// to a stream, however busy the peer and the readers are.
func TestIsolationNoDeliveryAfterClose(t *testing.T) {
	conf := peerConfig(t, MemMapTypeMemFd, readerSpin)
	var got bytes.Buffer
	var gotMu sync.Mutex
	readDone := make(chan struct{})
	srv := isoStartServer(t, conf, func(st *Stream) {
		defer close(readDone)
		defer st.Close()
		p := make([]byte, 4096)
		for {
			n, err := st.Read(p)
			gotMu.Lock()
			got.Write(p[:n])
			gotMu.Unlock()
			if err != nil {
				return
			}
		}
	})
	victimPeer, _, victim := srv.connect(t, MemMapTypeMemFd)
	stop := make(chan struct{})
	var sent atomic.Int64
	flooding := make(chan struct{})
	go func() { // publish "abcd" messages as fast as the region and queue allow
		defer close(flooding)
		for {
			select {
			case <-stop:
				return
			default:
			}
			li, off, err := victimPeer.bm.Alloc(4, false, false)
			if err != nil || li < 0 || victimPeer.send.tail()-victimPeer.send.head() >= int64(victimPeer.send.cap) {
				if li >= 0 && err == nil {
					victimPeer.bm.Push(li, off)
				}
				time.Sleep(10 * time.Microsecond)
				continue
			}
			copy(victimPeer.bm.SliceData(li, off), "abcd")
			victimPeer.bm.LinkSlice(off, 4, 0)
			victimPeer.publish(2, off, shm.StatusOpened)
			sent.Add(1)
		}
	}()
	deadline := time.Now().Add(peerTimeout)
	for sent.Load() < 200 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	closeWithin(t, victim, peerTimeout)
	after := victim.Stats().MessagesIn
	time.Sleep(100 * time.Millisecond)
	if later := victim.Stats().MessagesIn; later != after {
		t.Errorf("%d more messages were taken from the queue after Close returned", later-after)
	}
	close(stop)
	<-flooding
	select {
	case <-readDone:
	case <-time.After(peerTimeout):
		t.Fatal("the reader still runs after Close")
	}
	gotMu.Lock()
	defer gotMu.Unlock()
	if b := got.Bytes(); !bytes.Equal(b, bytes.Repeat([]byte("abcd"), len(b)/4)) || len(b)%4 != 0 {
		t.Errorf("the reader got %d bytes that are not the messages sent: %.64q", len(b), b)
	}
}

// A chain that links a slice to itself is refused; its slices are freed at
// most once (not once per link followed), so the list never counts more
// free slices than it has.
func TestIsolationCyclicChainFreesNothingTwice(t *testing.T) {
	conf := peerConfig(t, MemMapTypeMemFd, 0)
	srv := isoStartServer(t, conf, echoStream)
	srv.dialGood(t)
	for _, size := range []int{0, 3} {
		t.Run(fmt.Sprintf("size%d", size), func(t *testing.T) {
			p, _, victim := srv.connect(t, MemMapTypeMemFd)
			li, off, err := p.bm.Alloc(4, false, false)
			if err != nil || li < 0 {
				t.Fatal("no slice")
			}
			p.bm.LinkSlice(off, size, 0)
			p.link(off, off) // next = itself, HAS_NEXT
			l := p.list(li)
			p.publish(2, off, shm.StatusOpened)
			err = waitSessionClosed(t, victim, peerTimeout)
			if !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "twice") {
				t.Errorf("victim session error %v, want ErrProtocol naming the slice linked twice", err)
			}
			closeWithin(t, victim, peerTimeout)
			free := freeCounts(p.bm)[li]
			if free > int32(l.count) {
				t.Errorf("list of %d-byte slices counts %d free slices, it has %d: a slice was freed more than once", l.sliceCap, free, l.count)
			}
			srv.checkGood(t)
		})
	}
}

package shmipc

import (
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/goshm/shmipc/internal/shm"
	"golang.org/x/sys/unix"
)

// clientBuffers pools the buffer regions of a client's sessions: as in the
// Shmipc design, a client process gives all its sessions one buffer region
// (each has a queue region of its own), and servers recognise a region they
// have mapped by its path (docs/protocol.md §5; serverBuffers below). Sessions share
// a region when they have the same layout, prefix and mapping mode, and
// talk to the same server process (the one that sends the handshake
// frames, peekSender, not the one that listens).
//
// Only memfd regions are shared: in file mode a server removes the buffer
// file when its last session on it ends (docs/protocol.md §11.3, pitfall 12), and a
// client cannot tell whether it has. Per server process, because a killed
// server frees nothing, and what it held cannot be told from what others
// hold: once it is gone the region is retired, to go with its last session.
var clientBuffers = struct {
	sync.Mutex
	m map[poolKey]*pooledBuffer
}{m: make(map[poolKey]*pooledBuffer)}

// poolKey says which sessions may share a buffer region.
type poolKey struct {
	size   uint32
	layout string // the slice sizes and counts
	prefix string
	server int32 // the server's pid
}

// pooledBuffer is a shared client buffer region.
type pooledBuffer struct {
	m      *shm.Buffer
	prefix string // the region's names: prefix+"_buffer", prefix+"_queue_<n>"
	queues int    // queue regions named so far
	server int    // pidfd of the server process, to notice its death
}

// serverGone reports whether the process behind pidfd has exited.
func serverGone(pidfd int) bool {
	fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
	n, err := unix.Poll(fds, 0)
	return err == nil && n > 0
}

// poolKeyFor returns the pool key of a client session with server process
// server (0 when unknown), or false if its region is not to be shared.
func poolKeyFor(conf *Config, server int32) (poolKey, bool) {
	if conf.MemMapType != MemMapTypeMemFd || server <= 0 {
		return poolKey{}, false
	}
	plans, err := planLists(conf.ShareMemoryBufferCap, conf.BufferSliceSizes)
	if err != nil {
		return poolKey{}, false
	}
	var b strings.Builder
	for _, p := range plans {
		fmt.Fprintf(&b, "%d:%d,", p.SliceCap, p.Count)
	}
	return poolKey{size: conf.ShareMemoryBufferCap, layout: b.String(), prefix: conf.ShareMemoryPathPrefix, server: server}, true
}

var pid = os.Getpid()

// newRegionPrefix returns a fresh name prefix for a client's regions.
func newRegionPrefix(conf *Config) string {
	return fmt.Sprintf("%s_%d_%016x", conf.ShareMemoryPathPrefix, pid, rand.Uint64())
}

// circulationPeriods are the timing of the circulation control of the
// buffer regions this process creates.
var circulationPeriods = shm.DefaultPeriods()

// createBuffer creates and lays out a buffer region named bufPath
// (shm.CreateBuffer) and returns its manager, holding one reference.
func createBuffer(conf *Config, bufPath string) (*shm.Buffer, error) {
	plans, err := planLists(conf.ShareMemoryBufferCap, conf.BufferSliceSizes)
	if err != nil {
		return nil, err
	}
	return shm.CreateBuffer(conf.MemMapType == MemMapTypeMemFd, bufPath, int(conf.ShareMemoryBufferCap), uint32(conf.ShareMemoryFileMode), plans, circulationPeriods)
}

// sharedBuffer returns the pooled buffer region for key, with a reference
// taken, creating it if there is none (or the one there serves a server
// that has died), and the name of a new queue region for the session.
func sharedBuffer(conf *Config, key poolKey) (m *shm.Buffer, queuePath string, err error) {
	clientBuffers.Lock()
	defer clientBuffers.Unlock()
	p := clientBuffers.m[key]
	if p != nil && serverGone(p.server) {
		retireLocked(key, p)
		p = nil
	}
	if p != nil && p.m.Region().Acquire() {
		p.queues++
		return p.m, p.prefix + "_queue_" + strconv.Itoa(p.queues-1), nil
	}
	pidfd, err := unix.PidfdOpen(int(key.server), 0)
	if err != nil {
		return nil, "", fmt.Errorf("watch server process %d: %w", key.server, err)
	}
	defer func() {
		if m == nil {
			unix.Close(pidfd) // after an error, or a fault unwinding from createBuffer
		}
	}()
	prefix := newRegionPrefix(conf)
	if m, err = createBuffer(conf, prefix+"_buffer"); err != nil {
		return nil, "", err
	}
	p = &pooledBuffer{m: m, prefix: prefix, queues: 1, server: pidfd}
	m.OnLastRelease(func() {
		clientBuffers.Lock()
		retireLocked(key, p)
		clientBuffers.Unlock()
	})
	clientBuffers.m[key] = p
	return m, prefix + "_queue_0", nil
}

// retireLocked takes p out of the pool: no new session will use it. The
// region stays mapped for the sessions using it.
func retireLocked(key poolKey, p *pooledBuffer) {
	if clientBuffers.m[key] == p {
		delete(clientBuffers.m, key)
	}
	if p.server >= 0 {
		unix.Close(p.server)
		p.server = -1
	}
}

// reclaimSweeps are the pauses before the sweeps of a receive queue after a
// session's teardown (reclaimUnconsumed).
var reclaimSweeps = []time.Duration{10 * time.Millisecond, 100 * time.Millisecond}

// reclaimUnconsumed frees the messages left on this side's receive queue at
// teardown, once the receive loop (its only consumer) has stopped: they
// would stay allocated in a shared region that outlives the session. The
// peer may still publish for a moment, so a shared region's queue is swept
// again after each of reclaimSweeps.
func (s *Session) reclaimUnconsumed() {
	if s.recvQ == nil || s.buf == nil || s.access(s.freeUnconsumed) != nil ||
		s.buf.Region().RemovesFile() || s.queueRegion.RemovesFile() || s.buf.Sessions() < 2 {
		return
	}
	if !s.queueRegion.Acquire() {
		return
	}
	if !s.buf.Region().Acquire() {
		s.queueRegion.Release()
		return
	}
	s.sweepLater(0)
}

// sweepLater sweeps the receive queue after reclaimSweeps[i] and the ones
// after it, then drops the references reclaimUnconsumed took.
func (s *Session) sweepLater(i int) {
	if i == len(reclaimSweeps) {
		s.buf.Region().Release()
		s.queueRegion.Release()
		return
	}
	time.AfterFunc(reclaimSweeps[i], func() {
		if s.access(s.freeUnconsumed) != nil {
			i = len(reclaimSweeps) - 1
		}
		s.sweepLater(i + 1)
	})
}

// freeUnconsumed frees the messages named on the receive queue: at most as
// many as the queue holds, so that a peer that keeps publishing cannot keep
// it going. It runs inside an access, as the queue's only consumer.
func (s *Session) freeUnconsumed() error {
	for range s.recvQ.Cap() {
		e, ok, err := s.recvQ.Peek()
		if err != nil || !ok {
			return err
		}
		s.recvQ.Skip()
		if e.Status&shm.StatusMask != shm.StatusOpened || e.Offset == 0 {
			continue
		}
		slices, err := s.buf.ReadChain(s.scratch[:0], e.Offset)
		if err != nil {
			return err
		}
		s.scratch = slices
		if err := s.freeSegments(slices); err != nil {
			return err
		}
	}
	return nil
}

// serverBuffers caches the buffer regions servers in this process have
// mapped: every session of one client process names the same buffer
// region. Unlike the other implementations, which key the cache by path
// alone, a mapping is shared only with a session of the same peer process
// (pid and uid from SO_PEERCRED; never when the pid is unknown) that names
// the same path, and only if the descriptor is the same file. Everyone else
// maps the file anew, after the ownership checks of shm.OpenRegionFile. A
// reused pid gains nothing: the uid and file checks still hold.
var serverBuffers = struct {
	sync.Mutex
	m map[bufferKey]*shm.Buffer
}{m: make(map[bufferKey]*shm.Buffer)}

// bufferKey identifies a cached buffer mapping.
type bufferKey struct {
	path string
	uid  uint32
	pid  int32
}

// mapServerBuffer returns the buffer manager for the region open at fd,
// which peer named path, from serverBuffers if it may. file says whether
// the region is a file the server removes on the last release.
func mapServerBuffer(path string, fd int, file bool, peer peerID) (m *shm.Buffer, err error) {
	st, err := shm.StatRegular(fd)
	if err != nil {
		return nil, fmt.Errorf("buffer region %s: %w", path, err)
	}
	key := bufferKey{path: path, uid: peer.uid, pid: peer.pid}
	shared := peer.pid != 0
	serverBuffers.Lock()
	defer serverBuffers.Unlock()
	if c := serverBuffers.m[key]; shared && c != nil && c.Region().Backs(&st) && c.Region().Acquire() {
		return c, nil
	}
	r, err := shm.MapRegion(fd, path, minPeerBufferSize, maxPeerBufferSize)
	if err != nil {
		return nil, err
	}
	// Deferred: a fault in the headers (a client shrinking its file), which
	// the handshake recovers, must not keep the mapping and descriptor.
	defer func() {
		if m == nil {
			r.Release()
		}
	}()
	if err := r.KeepFd(fd); err != nil {
		return nil, err
	}
	if m, err = shm.NewBuffer(r, false); err != nil {
		return nil, fmt.Errorf("buffer region %s: %w", path, err)
	}
	if file {
		r.RemoveOnRelease()
	}
	if !shared {
		return m, nil
	}
	r.OnLastRelease(func() {
		serverBuffers.Lock()
		if serverBuffers.m[key] == m {
			delete(serverBuffers.m, key)
		}
		serverBuffers.Unlock()
	})
	serverBuffers.m[key] = m
	return m, nil
}

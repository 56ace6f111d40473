package shmipc

import (
	"fmt"
	"sync"

	"github.com/goshm/shmipc/internal/shm"
)

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

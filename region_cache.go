package shmipc

import (
	"fmt"
	"sync"
)

// serverBuffers caches the buffer regions servers in this process have
// mapped, as the other implementations do: every session of one client
// process names the same buffer region, and they share one mapping.
//
// The other implementations key the cache by path alone, so any client that
// names a path gets the mapping cached under it. Here a cached mapping is
// shared only with a session of the same peer process (same pid and uid
// from SO_PEERCRED) that names the same path, and only if the new
// descriptor is the same file (device and inode). Everyone else maps the
// file anew, after the ownership checks of openRegionFile; a file mapped
// twice is fine, as both mappings see the same memory. A peer whose pid is
// unknown (TCP) never shares. A pid is reused only once its process is gone,
// and the uid and file checks still hold for the reuser, so a reused pid
// gains nothing that its owner's uid could not open anyway.
var serverBuffers = struct {
	sync.Mutex
	m map[bufferKey]*bufferManager
}{m: make(map[bufferKey]*bufferManager)}

// bufferKey identifies a cached buffer mapping: the path a peer process
// named.
type bufferKey struct {
	path string
	uid  uint32
	pid  int32
}

// mapServerBuffer returns the buffer manager for the region open at fd,
// which peer named path: the cached one if the same peer process already
// mapped this file under this path, otherwise a new mapping (cached if the
// peer's pid is known). file says whether the region is a file the server
// removes on the last release.
func mapServerBuffer(path string, fd int, file bool, peer peerID) (*bufferManager, error) {
	_, dev, ino, err := fdInfo(fd)
	if err != nil {
		return nil, fmt.Errorf("buffer region %s: %w", path, err)
	}
	key := bufferKey{path: path, uid: peer.uid, pid: peer.pid}
	shared := peer.pid != 0
	serverBuffers.Lock()
	defer serverBuffers.Unlock()
	if m := serverBuffers.m[key]; shared && m != nil && m.region.dev == dev && m.region.ino == ino && m.region.acquire() {
		return m, nil
	}
	r, err := mapRegion(fd, path, minPeerBufferSize, maxPeerBufferSize)
	if err != nil {
		return nil, err
	}
	mapped := false
	defer func() {
		// Deferred, so that it runs when a fault in the headers (a client
		// shrinking its file meanwhile) unwinds from here too: the
		// handshake recovers it, and every such attempt kept a mapping and
		// a descriptor.
		if !mapped {
			r.release()
		}
	}()
	if err := r.keepFd(fd); err != nil {
		return nil, err
	}
	m, err := newBufferManager(r, false)
	if err != nil {
		return nil, fmt.Errorf("buffer region %s: %w", path, err)
	}
	mapped = true
	if file {
		r.file = path
	}
	if !shared {
		return m, nil
	}
	r.onLastRelease = func() {
		serverBuffers.Lock()
		if serverBuffers.m[key] == m {
			delete(serverBuffers.m, key)
		}
		serverBuffers.Unlock()
	}
	serverBuffers.m[key] = m
	return m, nil
}

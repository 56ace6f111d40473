package shmipc

import (
	"fmt"
	"sync"
)

// serverBuffers caches the buffer regions servers in this process have
// mapped, by path, as the other implementations do: every session of one
// client names the same buffer region. A cached mapping is reused only if
// the new descriptor is the same file.
var serverBuffers = struct {
	sync.Mutex
	m map[string]*bufferManager
}{m: make(map[string]*bufferManager)}

func mapServerBuffer(path string, fd int, file bool) (*bufferManager, error) {
	_, dev, ino, err := fdInfo(fd)
	if err != nil {
		return nil, fmt.Errorf("buffer region %s: %w", path, err)
	}
	serverBuffers.Lock()
	defer serverBuffers.Unlock()
	if m := serverBuffers.m[path]; m != nil && m.region.dev == dev && m.region.ino == ino && m.region.acquire() {
		return m, nil
	}
	r, err := mapRegion(fd, path, minPeerBufferSize, maxPeerBufferSize)
	if err != nil {
		return nil, err
	}
	m, err := newBufferManager(r, false)
	if err != nil {
		r.release()
		return nil, fmt.Errorf("buffer region %s: %w", path, err)
	}
	if file {
		r.file = path
	}
	r.onLastRelease = func() {
		serverBuffers.Lock()
		if serverBuffers.m[path] == m {
			delete(serverBuffers.m, path)
		}
		serverBuffers.Unlock()
	}
	serverBuffers.m[path] = m
	return m, nil
}

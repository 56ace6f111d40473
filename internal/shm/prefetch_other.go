//go:build !amd64

package shm

// PrefetchForWrite does nothing on this architecture.
func PrefetchForWrite(p []byte) {}

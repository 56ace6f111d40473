//go:build !amd64

package shmipc

// prefetchForWrite does nothing on this architecture.
func prefetchForWrite(p []byte) {}

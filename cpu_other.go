//go:build !amd64

package shmipc

// currentCPU returns 0: this architecture has no cheap way to read the
// processor's number, and every thread shares one set of local slices.
func currentCPU() int { return 0 }

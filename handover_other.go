//go:build !amd64

package shmipc

// countHolders: see handoverMutex.
const countHolders = true

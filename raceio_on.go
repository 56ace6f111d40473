//go:build race

package shmipc

import "sync/atomic"

// ioSync tells the race detector what a socket tells it: whatever a process
// did before it sent data happens before what it does after data came back.
// A reply arrives only after the peer received the request, which the
// detector cannot see through shared memory (another process). The syscall
// package does the same for every read and write of a file descriptor, so
// code such as gRPC's, correct over a socket, is not reported over shmipc.
var ioSync atomic.Uint64

// raceReleaseIO is called before a message is sent.
func raceReleaseIO() { ioSync.Add(1) }

// raceAcquireIO is called when received data is handed to a reader.
func raceAcquireIO() { ioSync.Load() }

// Package shm is shmipc's shared-memory layer: creating, sealing and
// mapping regions (Region); the buffer region's layout, its lock-free free
// lists, allocation by size class and the chains of slices that carry a
// message (Buffer); the IO queue and its layouts (Queue); circulation
// control and giving idle pages back; and the atomics on shared memory.
// Everything read from a region is checked against the mapping, and every
// malformed value is an error wrapping ErrProtocol.
//
// It knows nothing of sessions, streams, sockets or the handshake: the
// package above decides which regions a connection uses, when to touch
// them, and how a fault in a region becomes that connection's error
// (FaultError, Quietly).
package shm

//go:build !race || !amd64

package shm

import "sync/atomic"

// Atomic operations on words of shared memory. Outside race-detector
// builds they are sync/atomic's; see atomic_race_amd64.go for why race
// builds on amd64 have their own.

func shmLoadInt32(p *int32) int32                  { return atomic.LoadInt32(p) }
func shmLoadUint32(p *uint32) uint32               { return atomic.LoadUint32(p) }
func shmLoadInt64(p *int64) int64                  { return atomic.LoadInt64(p) }
func shmStoreUint32(p *uint32, v uint32)           { atomic.StoreUint32(p, v) }
func shmStoreInt64(p *int64, v int64)              { atomic.StoreInt64(p, v) }
func shmAddInt32(p *int32, d int32) int32          { return atomic.AddInt32(p, d) }
func shmCASUint32(p *uint32, old, new uint32) bool { return atomic.CompareAndSwapUint32(p, old, new) }

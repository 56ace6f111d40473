//go:build race && amd64

package shm

// Atomic operations on words of shared memory, for race-detector builds.
// There sync/atomic runs the operation in the race runtime's C code on the
// system stack, where a fault (a peer that truncated the region) crashes
// the process instead of becoming a panic for access to recover. So these
// are plain instructions on the goroutine's stack. For Go heap memory, which
// tests use as a region, they also tell the race detector what sync/atomic
// would (runtime.RaceAcquire and RaceReleaseMerge ignore other addresses);
// happens-before through mapped memory is modelled by raceReleaseIO and
// raceAcquireIO.

import (
	"runtime"
	"unsafe"
)

func shmLoadInt32(p *int32) int32 {
	v := shmLoadInt32Asm(p)
	runtime.RaceAcquire(unsafe.Pointer(p))
	return v
}

func shmLoadUint32(p *uint32) uint32 {
	v := shmLoadUint32Asm(p)
	runtime.RaceAcquire(unsafe.Pointer(p))
	return v
}

func shmLoadInt64(p *int64) int64 {
	v := shmLoadInt64Asm(p)
	runtime.RaceAcquire(unsafe.Pointer(p))
	return v
}

func shmStoreUint32(p *uint32, v uint32) {
	runtime.RaceReleaseMerge(unsafe.Pointer(p))
	shmStoreUint32Asm(p, v)
}

func shmStoreInt64(p *int64, v int64) {
	runtime.RaceReleaseMerge(unsafe.Pointer(p))
	shmStoreInt64Asm(p, v)
}

func shmAddInt32(p *int32, d int32) int32 {
	runtime.RaceReleaseMerge(unsafe.Pointer(p))
	v := shmAddInt32Asm(p, d)
	runtime.RaceAcquire(unsafe.Pointer(p))
	return v
}

func shmCASUint32(p *uint32, old, new uint32) bool {
	runtime.RaceReleaseMerge(unsafe.Pointer(p))
	ok := shmCASUint32Asm(p, old, new)
	runtime.RaceAcquire(unsafe.Pointer(p))
	return ok
}

// The operations themselves (atomic_race_amd64.s).

//go:noescape
func shmLoadInt32Asm(p *int32) int32

//go:noescape
func shmLoadUint32Asm(p *uint32) uint32

//go:noescape
func shmLoadInt64Asm(p *int64) int64

//go:noescape
func shmStoreUint32Asm(p *uint32, v uint32)

//go:noescape
func shmStoreInt64Asm(p *int64, v int64)

//go:noescape
func shmAddInt32Asm(p *int32, d int32) int32

//go:noescape
func shmCASUint32Asm(p *uint32, old, new uint32) bool

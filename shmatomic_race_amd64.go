//go:build race && amd64

package shmipc

// Atomic operations on words of shared memory, for race-detector builds.
//
// With the race detector on, sync/atomic's functions do not run the atomic
// instruction in the caller's goroutine: for an address outside the Go heap
// they touch it once, then switch to the system stack and have the race
// runtime's C code perform the operation. A peer that truncates the region
// between the two makes that C code fault on the system stack, where the
// fault cannot become a panic for access (shmaccess.go) to recover: the
// process crashed in a test that truncates the region under traffic
// ("unexpected return pc for runtime.sigpanic"). The race detector does not
// track memory outside the heap anyway (happens-before through shared
// memory is modelled by raceReleaseIO and raceAcquireIO), so these are
// plain instructions on the goroutine's stack, as sync/atomic's are without
// the race detector. For memory of the Go heap, which tests use as a
// region, each operation also tells the race detector what sync/atomic's
// would (runtime.RaceAcquire and RaceReleaseMerge ignore other addresses).

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

// The operations themselves (shmatomic_race_amd64.s).

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

package shm

import (
	"errors"
	"fmt"
	"runtime/debug"
)

// The trust boundary. Regions are writable by the peer, which can also
// shrink a region it created (file regions, and memfds it did not seal); a
// page that cannot be committed (a full tmpfs, a memory cgroup at its
// limit) is lost the same way. Touching such a page raises SIGBUS or
// SIGSEGV. Values read from the regions are checked where they are read;
// faults are caught by the caller, which runs every code path that touches
// a region with debug.SetPanicOnFault set and turns the recovered fault
// into an error (FaultError), or, outside any connection, inside Quietly.
// Such code must not be half-way through updating a lock, a token or a
// counter outside the region when it touches the region.

// ErrProtocol is wrapped by the errors for values in shared memory that
// break the protocol, and for faults in a shared region.
var ErrProtocol = errors.New("shmipc: protocol violation")

// FaultError makes a recovered memory fault an error; other panics go on.
func FaultError(r any) error {
	f, ok := r.(interface{ Addr() uintptr })
	if !ok {
		panic(r)
	}
	return fmt.Errorf("%w: memory fault at %#x in a shared region (did the peer shrink it, or could a page not be committed?)", ErrProtocol, f.Addr())
}

// Quietly runs f, which touches a shared region outside any connection's
// guarded access, ending f silently on a memory fault; other panics go on.
func Quietly(f func()) {
	defer func() {
		if r := recover(); r != nil {
			_ = FaultError(r) // re-panics anything but a memory fault
		}
	}()
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	f()
}

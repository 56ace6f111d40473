package shmipc

import (
	"fmt"
	"runtime/debug"
)

// The trust boundary.
//
// A session's regions are writable by the peer, and a peer that created a
// region can also shrink it under us (file regions, and memfds it did not
// seal); a page that cannot be committed (a full tmpfs, a memory cgroup at
// its limit) is lost the same way. Touching such a page raises SIGBUS or
// SIGSEGV. Values read from the regions are checked where they are read
// (buffer.go, queue.go); faults are caught here.
//
// Every code path that reads or writes a region runs inside access: the
// receive loop's handling of a frame, stream reads, writes, flushes and
// closes, releases of received slices, the netpoll adapters, Stats, and
// teardown. The handshake (handshake.go) uses the same faultError for the
// regions it maps before a session exists.
//
// A method that is one access from its first line to its last may instead
// begin with
//
//	defer s.endAccess(&err, debug.SetPanicOnFault(true))
//
// which is the same thing (the netpoll writer methods do this).
//
// access turns a fault into an ErrProtocol error that ends the session and
// returns it to the caller. The fault is recovered inside access itself, so
// it never unwinds through a caller's frame: a caller may hold its own locks
// around an access and releases them on its normal path, and access holds
// no state of its own that a fault could leave behind. Code inside an access
// must keep its own invariants across a fault in the same way: it must not
// be half-way through updating a lock, a token or a counter that lives
// outside the region (the regions' own contents are the peer's to ruin).
//
// Work on a region that belongs to no session's access (circulation
// control, and the kept slices a session returns as it ends) runs inside
// quietly instead: a fault ends that work and is dropped, since the
// sessions using the region meet it in their own accesses.
//
// What access cannot cover is memory handed to the application: a slice
// returned by ReadBytes, Peek or Reserve is read and written by application
// code. Config.RequireSealedMemory keeps such faults from happening.

// access runs f, which touches the session's shared regions, with memory
// faults turned into the session's error.
func (s *Session) access(f func() error) (err error) {
	defer s.endAccess(&err, debug.SetPanicOnFault(true))
	return f()
}

// endAccess restores the goroutine's fault setting and, after a fault, ends
// the session. Any other panic goes on.
func (s *Session) endAccess(err *error, old bool) {
	debug.SetPanicOnFault(old)
	r := recover()
	if r == nil {
		return
	}
	s.closeWithError(faultError(r))
	*err = s.closedErr()
}

// faultError turns the recovered value of a memory fault into an error; any
// other panic goes on.
func faultError(r any) error {
	f, ok := r.(interface{ Addr() uintptr })
	if !ok {
		panic(r)
	}
	return fmt.Errorf("%w: memory fault at %#x in a shared region (did the peer shrink it, or could a page not be committed?)", ErrProtocol, f.Addr())
}

// quietly runs f, which touches a shared region outside any session's
// access, with a memory fault ending f silently. Any other panic goes on.
func quietly(f func()) {
	defer func() {
		if r := recover(); r != nil {
			_ = faultError(r) // re-panics anything but a memory fault
		}
	}()
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	f()
}

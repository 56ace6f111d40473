package shmipc

import (
	"fmt"
	"runtime/debug"
)

// The trust boundary. A session's regions are writable by the peer, which
// can also shrink a region it created (file regions, and memfds it did not
// seal); a page that cannot be committed (a full tmpfs, a memory cgroup at
// its limit) is lost the same way. Touching such a page raises SIGBUS or
// SIGSEGV. Values read from the regions are checked where they are read;
// faults are caught here.
//
// Every code path that touches a region runs inside access (or, in a method
// that is one access from its first line to its last, begins with
// `defer s.endAccess(&err, debug.SetPanicOnFault(true))`), which turns a
// fault into an ErrProtocol error that ends the session. The fault is
// recovered inside access, so a caller may hold locks around an access;
// code inside one must not be half-way through updating a lock, a token or
// a counter outside the region when it touches the region. Work outside
// any session (circulation control, the kept slices a session returns as it
// ends) runs inside quietly instead, and the handshake uses faultError.
//
// Slices handed to the application (ReadBytes, Peek, Reserve) are touched
// outside access; Config.RequireSealedMemory keeps such faults away.

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

package shmipc

import (
	"fmt"
	"os"

	shm "github.com/goshm/shmipc"
	"golang.org/x/sys/unix"
)

// MemfdCreate creates an anonymous memory file (memfd_create(2)) and
// returns its descriptor.
func MemfdCreate(name string, flags int) (fd int, err error) {
	return unix.MemfdCreate(name, flags)
}

// DebugBufferListDetail prints on os.Stdout the size of the file at path,
// then the slices and free slices per size class of the buffer region of
// each open session of this process, as the session sees them.
func DebugBufferListDetail(path string) {
	debugRegionFile(path)
	forSessions(func(s *Session, st shm.Stats) {
		fmt.Printf("session %s: buffer region of %d bytes, %d in use\n", s.ID(), st.Buffer.Size, st.Buffer.InUse)
		for _, l := range st.Lists {
			fmt.Printf("  slices of %d bytes: %d, %d free\n", l.SliceSize, l.Slices, l.Free)
		}
	})
}

// DebugQueueDetail prints on os.Stdout the size of the file at path, then
// the IO queues of each open session of this process.
func DebugQueueDetail(path string) {
	debugRegionFile(path)
	forSessions(func(s *Session, st shm.Stats) {
		fmt.Printf("session %s: queue region of %d bytes, %d elements to send, %d received\n",
			s.ID(), st.Queue.Size, st.SendQueueDepth, st.RecvQueueDepth)
	})
}

// debugRegionFile prints what the file system says of path.
func debugRegionFile(path string) {
	if fi, err := os.Stat(path); err != nil {
		fmt.Printf("%s: %v\n", path, err)
	} else {
		fmt.Printf("%s: %d bytes\n", path, fi.Size())
	}
}

// forSessions calls fn with each open session and its Stats.
func forSessions(fn func(*Session, shm.Stats)) {
	sessions.m.Range(func(_, v any) bool {
		s := v.(*Session)
		if !s.IsClosed() {
			fn(s, s.s.Stats())
		}
		return true
	})
}

package shmipc

import (
	"fmt"
	"io"
	"os"

	shm "github.com/goshm/shmipc"
	"golang.org/x/sys/unix"
)

// MemfdCreate creates an anonymous memory file (memfd_create(2)) and
// returns its descriptor.
func MemfdCreate(name string, flags int) (fd int, err error) {
	return unix.MemfdCreate(name, flags)
}

// DebugBufferListDetail prints, on os.Stdout, the size of the region file
// at path and then the size classes of the buffer region of every open
// session of this process that the package has handed out: slices and
// free slices per class. It reads the sessions' own view of their regions
// (the root package's Session.Stats), not the file's contents.
func DebugBufferListDetail(path string) {
	debugRegionFile(os.Stdout, path)
	forSessions(func(s *Session, st shm.Stats) {
		fmt.Printf("session %s: buffer region of %d bytes, %d in use\n", s.ID(), st.Buffer.Size, st.Buffer.InUse)
		for _, l := range st.Lists {
			fmt.Printf("  slices of %d bytes: %d, %d free\n", l.SliceSize, l.Slices, l.Free)
		}
	})
}

// DebugQueueDetail prints, on os.Stdout, the size of the region file at
// path and then the IO queues of every open session of this process that
// the package has handed out: the queue region's size and the elements
// waiting in each direction.
func DebugQueueDetail(path string) {
	debugRegionFile(os.Stdout, path)
	forSessions(func(s *Session, st shm.Stats) {
		fmt.Printf("session %s: queue region of %d bytes, %d elements to send, %d received\n",
			s.ID(), st.Queue.Size, st.SendQueueDepth, st.RecvQueueDepth)
	})
}

// debugRegionFile prints what the file system says of path.
func debugRegionFile(w io.Writer, path string) {
	fi, err := os.Stat(path)
	if err != nil {
		fmt.Fprintf(w, "%s: %v\n", path, err)
		return
	}
	fmt.Fprintf(w, "%s: %d bytes\n", path, fi.Size())
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

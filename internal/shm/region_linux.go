package shm

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

const (
	// memfdNamePrefix is put before the region path to name a memfd, as the
	// other implementations do; the name only shows in /proc/<pid>/fd.
	memfdNamePrefix = "shmipc"
	maxMemfdName    = 249 // Linux's limit on a memfd name
)

// Region is one mapped shared-memory region: a buffer region or a queue
// region. It is reference counted; the last release unmaps it and, for a
// file this process is responsible for, removes the file.
type Region struct {
	mem      []byte
	path     string // the name on the wire
	file     string // file to remove on the last release, or ""
	dev, ino uint64 // identity of the backing file, for the mapping cache
	refs     atomic.Int32
	// fd is a descriptor of the region kept open (see KeepFd), valid when
	// hasFd is set: for statistics, and for giving memory back.
	fd            int
	hasFd         bool
	onLastRelease func() // see OnLastRelease
	mapped        bool   // mem is a mapping of this Region's, to unmap
}

// RegionOf makes a Region of memory its caller mapped itself, or of Go
// memory laid out as a region, holding one reference. Releasing it never
// unmaps mem.
func RegionOf(mem []byte) *Region {
	r := &Region{mem: mem}
	r.refs.Store(1)
	return r
}

// Acquire takes a reference; it fails once the region has been released.
func (r *Region) Acquire() bool {
	for {
		n := r.refs.Load()
		if n <= 0 {
			return false
		}
		if r.refs.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// Release drops a reference and unmaps the region when it was the last.
func (r *Region) Release() {
	if r.refs.Add(-1) != 0 {
		return
	}
	if r.onLastRelease != nil {
		r.onLastRelease()
	}
	if r.file != "" && sameFile(r.file, r.dev, r.ino) {
		_ = unix.Unlink(r.file)
	}
	if r.mapped {
		_ = unix.Munmap(r.mem)
	}
	r.mem = nil
	if r.hasFd {
		unix.Close(r.fd)
		r.hasFd = false
	}
}

// KeepFd keeps a duplicate of the region's fd open until it is unmapped.
func (r *Region) KeepFd(fd int) error {
	kept, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("keep region %s open: %w", r.path, err)
	}
	r.fd, r.hasFd = kept, true
	return nil
}

// Mem is the mapped region, valid until the last release.
func (r *Region) Mem() []byte { return r.mem }

// Path is the region's name on the wire.
func (r *Region) Path() string { return r.path }

// Fd is the descriptor KeepFd kept open, to be passed to the peer.
func (r *Region) Fd() int { return r.fd }

// RemoveOnRelease makes the last release remove the region's file, which
// this process is responsible for.
func (r *Region) RemoveOnRelease() { r.file = r.path }

// RemovesFile reports whether the last release removes a file.
func (r *Region) RemovesFile() bool { return r.file != "" }

// Backs reports whether st, from StatRegular, is the region's file.
func (r *Region) Backs(st *unix.Stat_t) bool { return r.dev == st.Dev && r.ino == st.Ino }

// OnLastRelease has the last release run f, under no lock, then unmap.
func (r *Region) OnLastRelease(f func()) { r.onLastRelease = f }

// Committed returns how many bytes of the region are backed by memory now,
// for statistics. With a kept descriptor that is the allocated size of the
// file (what Shmem in /proc/meminfo counts, pages reserved but not yet
// touched included); otherwise the pages in the page cache (mincore).
func (r *Region) Committed() uint64 {
	if r.hasFd {
		var st unix.Stat_t
		if unix.Fstat(r.fd, &st) == nil {
			return uint64(st.Blocks) * 512
		}
	}
	var n uint64
	for _, v := range residentPages(r.mem) {
		n += uint64(v & 1)
	}
	return n * uint64(pageSize)
}

// CreateRegion creates a zero-filled shared region of size bytes: a sealed
// memfd named after path, or a new file at path with permissions perm,
// which the last release removes. It returns the region
// (one reference) and the open fd, which the caller closes once it has been
// passed to the peer. The region is sparse, so memory follows traffic: a
// page that cannot be committed when first written faults inside an access
// (slices handed to the application are committed first, commitPages).
func CreateRegion(memfd bool, path string, size int, perm uint32) (*Region, int, error) {
	var fd int
	var err error
	fail := func(err error) (*Region, int, error) {
		unix.Close(fd)
		if !memfd {
			_ = unix.Unlink(path)
		}
		return nil, -1, err
	}
	if memfd {
		name := memfdNamePrefix + path
		if len(name) > maxMemfdName {
			name = name[len(name)-maxMemfdName:]
		}
		fd, err = unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
		if err != nil {
			return nil, -1, fmt.Errorf("memfd_create %q: %w", name, err)
		}
	} else {
		fd, err = unix.Open(path, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_CLOEXEC|unix.O_NOFOLLOW, perm)
		if err != nil {
			return nil, -1, fmt.Errorf("create %s: %w", path, err)
		}
		if err := unix.Fchmod(fd, perm); err != nil { // exactly perm, whatever the umask
			return fail(fmt.Errorf("chmod %s: %w", path, err))
		}
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		return fail(fmt.Errorf("size %s to %d bytes: %w", path, size, err))
	}
	if memfd {
		seals := unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, seals); err != nil {
			return fail(fmt.Errorf("seal memfd %s: %w", path, err))
		}
	}
	r, err := MapRegion(fd, path, int64(size), int64(size))
	if err != nil {
		return fail(err)
	}
	if !memfd {
		r.file = path
	}
	return r, fd, nil
}

// ErrRegionNotOwned is wrapped by the error for a region file that the
// client naming it does not own.
var ErrRegionNotOwned = errors.New("a client may name only region files it owns")

// OpenRegionFile opens a region file named by a client in file mode, whose
// user id is owner. Only a regular file directly inside allowedDir, owned by
// owner, is accepted, and symbolic links are not followed, so a client
// cannot make the server map (and later remove) a file that is not its own.
func OpenRegionFile(path, allowedDir string, owner uint32) (int, error) {
	clean := filepath.Clean(path)
	if clean != path || !filepath.IsAbs(path) || filepath.Dir(path) != filepath.Clean(allowedDir) {
		return -1, fmt.Errorf("region path %q is not a file directly inside %s", path, allowedDir)
	}
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if err != nil {
		return -1, fmt.Errorf("open %s: %w", path, err)
	}
	if err := checkRegionFile(fd, path, owner); err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

// checkRegionFile checks the file open at fd, opened as path: it must be a
// regular file owned by owner, and path must still name it. The owner is
// read from the descriptor, so it is the owner of what will be mapped. The
// name is checked too because the server records it with the mapping (for
// its cache, its errors and the removal of the file): a file renamed or
// swapped in under it since the open is refused.
func checkRegionFile(fd int, path string, owner uint32) error {
	st, err := StatRegular(fd)
	if err != nil {
		return fmt.Errorf("region file %s: %w", path, err)
	}
	if st.Uid != owner {
		return fmt.Errorf("region file %s is owned by uid %d, the peer is uid %d: %w", path, st.Uid, owner, ErrRegionNotOwned)
	}
	if !sameFile(path, st.Dev, st.Ino) {
		return fmt.Errorf("region file %s was replaced while the server opened it", path)
	}
	return nil
}

// StatRegular fstats fd, which must be a regular file (memfds are).
func StatRegular(fd int) (unix.Stat_t, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return st, fmt.Errorf("fstat: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return st, fmt.Errorf("region is not a regular file (mode %#o)", st.Mode)
	}
	return st, nil
}

// MapRegion maps all of fd, which must hold between minSize and maxSize
// bytes. It does not close fd.
func MapRegion(fd int, path string, minSize, maxSize int64) (*Region, error) {
	st, err := StatRegular(fd)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if st.Size < minSize || st.Size > maxSize {
		return nil, fmt.Errorf("%s: size %d is outside [%d, %d]", path, st.Size, minSize, maxSize)
	}
	mem, err := unix.Mmap(fd, 0, int(st.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("map %s (%d bytes): %w", path, st.Size, err)
	}
	r := &Region{mem: mem, path: path, dev: st.Dev, ino: st.Ino, mapped: true}
	r.refs.Store(1)
	return r, nil
}

// sameFile reports whether path still names the file (dev, ino), so that a
// region never removes a file that has replaced its own.
func sameFile(path string, dev, ino uint64) bool {
	var st unix.Stat_t
	return unix.Lstat(path, &st) == nil && st.Dev == dev && st.Ino == ino
}

// CheckSealed fails unless fd is sealed against shrinking.
func CheckSealed(fd int) error {
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return fmt.Errorf("read seals: %w", err)
	}
	if seals&unix.F_SEAL_SHRINK == 0 {
		return fmt.Errorf("region is not sealed against shrinking (seals %#x) and RequireSealedMemory is set", seals)
	}
	return nil
}

// CloseFds closes every fd in fds that is not negative.
func CloseFds(fds ...int) {
	for _, fd := range fds {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
}

var errNoSpace = errors.New("no space for the region")

// CheckFreeSpace fails early when dir's file system lacks size free bytes.
func CheckFreeSpace(dir string, size uint64) error {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return fmt.Errorf("statfs %s: %w", dir, err)
	}
	if free := st.Bavail * uint64(st.Bsize); free < size {
		return fmt.Errorf("%w: %s has %d bytes free, %d needed", errNoSpace, dir, free, size)
	}
	return nil
}

var pageSize = os.Getpagesize()

// residentPages returns one byte per page of mem, bit 0 set for a page in
// memory (mincore), or nil.
func residentPages(mem []byte) []byte {
	if len(mem) == 0 {
		return nil
	}
	vec := make([]byte, (len(mem)+pageSize-1)/pageSize)
	_, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&mem[0])), uintptr(len(mem)), uintptr(unsafe.Pointer(&vec[0])))
	if errno != 0 {
		return nil
	}
	return vec
}

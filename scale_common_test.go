package shmipc

// Shared helpers of the scale_* tests: many real client and server
// processes coming and going, some crashing, against one process whose
// resources must come back to a baseline.

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"testing"
	"time"
)

// scSock returns a unique socket path (pid + random) in the test's temp dir.
func scSock(t testing.TB) string {
	return filepath.Join(t.TempDir(), fmt.Sprintf("sc_%d_%08x.sock", os.Getpid(), rand.Uint32()))
}

// scConfig is the configuration of both sides of the scale tests: a small
// region so that dozens of sessions at once stay cheap.
func scConfig(mode MemMapType, prefix string) *Config {
	conf := DefaultConfig()
	conf.MemMapType = mode
	conf.ShareMemoryPathPrefix = prefix
	conf.ShareMemoryBufferCap = 4 << 20
	conf.BufferSliceSizes = ReferenceSliceSizes()
	return conf
}

// scState is a snapshot of a process's resources.
type scState struct {
	goroutines int
	fds        int
	memfdMaps  int // mappings of any shmipc memfd
	prefixMaps int // mappings naming the prefix
	files      int // files under the prefix
	rss        uint64
	rssShmem   uint64
	live       int // registry.live (sessions of this package alive)
	srvBufs    int // serverBuffers cache entries
	cliBufs    int // clientBuffers pool entries
}

func (s scState) String() string {
	return fmt.Sprintf("goroutines=%d fds=%d memfdMaps=%d prefixMaps=%d files=%d rss=%dKiB rssShmem=%dKiB liveSessions=%d serverBufCache=%d clientBufPool=%d",
		s.goroutines, s.fds, s.memfdMaps, s.prefixMaps, s.files, s.rss>>10, s.rssShmem>>10, s.live, s.srvBufs, s.cliBufs)
}

// scProcStatus reads "Field: N kB" from /proc/<pid>/status, in bytes.
func scProcStatus(pid, field string) uint64 {
	b, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		name, rest, ok := strings.Cut(line, ":")
		if !ok || name != field {
			continue
		}
		num, _, _ := strings.Cut(strings.TrimSpace(rest), " ")
		v, _ := strconv.ParseUint(num, 10, 64)
		return v << 10
	}
	return 0
}

// scTakeSelf snapshots this process.
func scTakeSelf(prefix string) scState {
	runtime.GC()
	debug.FreeOSMemory()
	var s scState
	s.goroutines = runtime.NumGoroutine()
	fds, _ := clFds("self")
	s.fds = len(fds)
	memfd, ours, _ := clMaps("self", prefix)
	s.memfdMaps, s.prefixMaps = len(memfd), len(ours)
	if prefix != "" {
		s.files = len(shmFiles(prefix))
	}
	s.rss = scProcStatus("self", "VmRSS")
	s.rssShmem = scProcStatus("self", "RssShmem")
	registry.Lock()
	s.live = len(registry.live)
	registry.Unlock()
	serverBuffers.Lock()
	s.srvBufs = len(serverBuffers.m)
	serverBuffers.Unlock()
	clientBuffers.Lock()
	s.cliBufs = len(clientBuffers.m)
	clientBuffers.Unlock()
	return s
}

// scSettle polls take until ok holds or within passes; it returns the last
// snapshot and whether ok held.
func scSettle(within time.Duration, take func() scState, ok func(scState) bool) (scState, bool) {
	deadline := time.Now().Add(within)
	for {
		s := take()
		if ok(s) {
			return s, true
		}
		if time.Now().After(deadline) {
			return s, false
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// scCPUTicks returns utime+stime of process pid, in clock ticks.
func scCPUTicks(pid int) uint64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	f := strings.Fields(s[i+2:])
	// f[0] is state (field 3); utime is field 14, stime 15.
	u, _ := strconv.ParseUint(f[11], 10, 64)
	st, _ := strconv.ParseUint(f[12], 10, 64)
	return u + st
}

// scFrame builds an echo frame (mpServeEcho protocol) with payload p.
func scFrame(p []byte) []byte {
	msg := make([]byte, 4+len(p))
	binary.BigEndian.PutUint32(msg, uint32(len(p)))
	copy(msg[4:], p)
	return msg
}

// scEchoCheck opens a stream on sess, runs echo round trips of several
// sizes, and closes the stream.
func scEchoCheck(sess *Session, seed uint64) error {
	st, err := sess.OpenStream()
	if err != nil {
		return fmt.Errorf("OpenStream: %w", err)
	}
	defer st.Close()
	st.SetDeadline(time.Now().Add(20 * time.Second))
	for i, n := range []int{1, 64, 8 << 10, 100 << 10, 300 << 10} {
		if err := mpRoundTrip(st, mpPayload(n, seed+uint64(i)), i%2 == 0); err != nil {
			return err
		}
	}
	return nil
}

// scStacks returns the stacks of every goroutine, grouped crudely.
func scStacks(buf []byte) string {
	n := runtime.Stack(buf, true)
	return string(buf[:n])
}

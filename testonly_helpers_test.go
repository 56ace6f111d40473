package shmipc

import (
	"fmt"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/shm"
)

// Library helpers that only tests use.

// createRegion is shm.CreateRegion with permissions 0o600.
func createRegion(mode MemMapType, path string, size int) (*shm.Region, int, error) {
	return shm.CreateRegion(mode == MemMapTypeMemFd, path, size, 0o600)
}

// bufferRegionSize is the space a region of plans occupies.
func bufferRegionSize(plans []shm.ListPlan) uint64 {
	n := uint64(shm.BufferHeaderSize)
	for _, p := range plans {
		n += shm.ListHeaderSize + uint64(p.Count)*(uint64(p.SliceCap)+shm.SliceHeaderSize)
	}
	return n
}

// Offsets in the shared-memory layouts (docs/protocol.md §6, §7), as a peer
// writing raw bytes sees them, and the name memfds are given before the
// region path.
const (
	listFreeOff, listCountOff, listHeadOff, listTailOff, listCapOff         = 0, 4, 8, 12, 16
	sliceCapOff, sliceSizeOff, sliceStartOff, sliceNextOff, sliceFlagsOff   = 0, 4, 8, 12, 16
	flagHasNext, flagInUse                                                  = 0x01, 0x02
	queueHeaderSize, queueElemSize, elemIDOff, elemOffsetOff, elemStatusOff = 24, 12, 0, 4, 8
	queueCapOff                                                             = 0
	memfdNamePrefix                                                         = "shmipc"
)

// The queue header's other fields: on arm64 its 64-bit counters are 8-byte
// aligned.
var queueHeadOff, queueTailOff, queueFlagOff = func() (int, int, int) {
	if runtime.GOARCH == "arm64" {
		return 8, 16, 4
	}
	return 4, 12, 20
}()

// refCount is 1 while r is referenced and 0 once it has been released.
func refCount(r *shm.Region) int32 {
	if !r.Acquire() {
		return 0
	}
	r.Release()
	return 1
}

// maxSliceCap is the data capacity of the largest slice of m that can be
// handed out (a list keeps its last slice).
func maxSliceCap(m *shm.Buffer) int {
	most := 0
	for _, l := range m.Lists() {
		if l.Count >= 2 {
			most = max(most, int(l.SliceCap))
		}
	}
	return most
}

// freeCounts returns the free slices of each list of m: those on the free
// list and those this process has parked.
func freeCounts(m *shm.Buffer) []int32 {
	var free []int32
	for _, l := range m.Lists() {
		free = append(free, l.Free)
	}
	return free
}

// free reports whether enter would find a slot now.
func (g *spinGovernor) free() bool {
	return g.active.Load() < g.slots.Load() && g.offUntil.Load() == 0
}

// failure is why this side ended the stream (fail), or nil.
func (st *Stream) failure() error {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.failErr
}

// The quick form of the suite (go test -short): long tests (soak, scale,
// multi-process churn, time-boxed loops) run shorter, or on one mapping
// mode, so that the whole suite stays under a minute on two cores.

// shortOr returns full, or short with -short.
func shortOr[T any](full, short T) T {
	if testing.Short() {
		return short
	}
	return full
}

// testModes is bothModes, or memfd alone (the default mode) with -short.
func testModes() []MemMapType {
	return shortOr(bothModes, []MemMapType{MemMapTypeMemFd})
}

// waitBlocked waits until n goroutines started by the calling goroutine
// are parked in fn (a function as stacks name it, e.g.
// "(*Stream).awaitReadable"), and fails the test if they are not within
// peerTimeout. A test that must act on calls already blocked waits for
// that, instead of sleeping and hoping they are.
func waitBlocked(t testing.TB, fn string, n int) {
	t.Helper()
	creator := goroutineID()
	deadline := time.Now().Add(peerTimeout)
	for {
		count := blockedIn(fn, creator)
		if count >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d goroutines blocked in %s after %v", count, n, fn, peerTimeout)
		}
		time.Sleep(time.Millisecond)
	}
}

// blockedIn returns how many goroutines started by goroutine creator are
// parked (neither running nor runnable) with fn on their stacks.
func blockedIn(fn string, creator uint64) int {
	by := fmt.Sprintf(" in goroutine %d\n", creator)
	buf := make([]byte, 1<<20)
	size := runtime.Stack(buf, true)
	for size == len(buf) {
		buf = make([]byte, 2*len(buf))
		size = runtime.Stack(buf, true)
	}
	count := 0
	for _, g := range strings.Split(string(buf[:size]), "\n\n") {
		header, _, _ := strings.Cut(g, "\n")
		if strings.Contains(header, "[running") || strings.Contains(header, "[runnable") {
			continue
		}
		if strings.Contains(g, fn) && strings.Contains(g+"\n", by) {
			count++
		}
	}
	return count
}

// waitsInParallel lets t run in parallel with the other tests that call it,
// after the package's other tests. It is for tests that spend most of
// their time waiting (a timer of the library, such as peerGoneGrace,
// refusedMinAge or the quiet give-back, a waited-out timeout, or a child
// process), and that were checked to use no process-global state: they set
// no package variable and install no hook (consumeHook, tcpDiagOff,
// fallbackFrameData, circulationPeriods...), assert nothing process-wide
// (goroutines, fds, mappings, heap, RSS, Shmem, AggregateStats), and share
// no buffer region with another test's sessions (theirs have a private
// prefix, or a server in another process). Their assertions hold on a
// loaded machine: they bound times from below, or generously from above.
func waitsInParallel(t *testing.T) {
	t.Parallel()
}

// raceEnabled reports whether the race detector is on (the test binary's
// -race build setting): it multiplies the memory a process uses, so memory
// bounds on this process are not checked.
var raceEnabled = func() bool {
	bi, ok := debug.ReadBuildInfo()
	return ok && slices.ContainsFunc(bi.Settings, func(s debug.BuildSetting) bool { return s.Key == "-race" && s.Value == "true" })
}()

package shmipc

// The quick form of the suite (go test -short): long tests (soak, scale,
// multi-process churn, time-boxed loops) run shorter, or on one mapping
// mode, so that the whole suite stays under a minute on two cores.

import (
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"
)

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
// fallbackFrameData, giveBackPeriod...), assert nothing process-wide
// (goroutines, fds, mappings, heap, RSS, Shmem, AggregateStats), and share
// no buffer region with another test's sessions (theirs have a private
// prefix, or a server in another process). Their assertions hold on a
// loaded machine: they bound times from below, or generously from above.
func waitsInParallel(t *testing.T) {
	t.Parallel()
}

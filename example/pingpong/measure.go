package main

// One measurement: round trips on an open connection, timed, with the CPU
// and the wake-ups both processes spent on them.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"runtime"
	"time"
)

// iterations is the number of timed round trips at a message size: n up to
// 4 KiB, then n·√(4 KiB/size) so that large sizes do not take minutes, but
// never fewer than 200 (or n, if smaller).
func iterations(n, size int) int {
	if size <= 4<<10 {
		return n
	}
	k := int(float64(n) * math.Sqrt(float64(4<<10)/float64(size)))
	return max(k, min(n, 200))
}

// pinger does one round trip on an open connection. With verify set it
// changes the payload first and checks that the echo matches.
type pinger interface {
	roundTrip(verify bool) error
}

// measure warms up, then times round trips and the CPU both processes use.
//
// It does n round trips (see iterations), and more if they take less than
// opts.minRun: the kernel brings the CPU time of a thread that keeps
// running on another core up to date only at scheduler ticks (4 ms at
// HZ=250), so reading another process's CPU clock, or one of our threads
// that spins, can be that much behind. Over a second that is under 1 %.
func measure(transport string, size int, p pinger, opts options, serverPID int) (summary, error) {
	n := iterations(opts.n, size)
	warm := min(max(n/10, 20), 2000)
	warmStart := time.Now()
	done := 0
	for ; done < warm && (done < 5 || time.Since(warmStart) < opts.maxRun/4); done++ {
		if err := p.roundTrip(done < 3); err != nil {
			return summary{}, fmt.Errorf("%s warm-up: %w", fmtSize(size), err)
		}
	}
	// Room for n round trips, or for as many as fit in 1.5·minRun at the
	// warm-up's pace, up to 4 million (32 MB of samples).
	perOp := time.Since(warmStart) / time.Duration(done)
	room := n
	if perOp > 0 && opts.minRun > 0 {
		room = max(n, min(int(opts.minRun*3/2/perOp), 4<<20))
	}
	lat := make([]time.Duration, room)
	runtime.GC() // not during the timed loop, which allocates nothing
	c0, s0, w0 := selfCPU(), procCPU(serverPID), wakeupsOf(p)
	start := time.Now()
	i := 0
	for i < room {
		t := time.Now()
		if err := p.roundTrip(false); err != nil {
			return summary{}, fmt.Errorf("%s round trip %d: %w", fmtSize(size), i, err)
		}
		lat[i] = time.Since(t)
		i++
		if elapsed := t.Sub(start); elapsed > opts.maxRun || i >= n && elapsed >= opts.minRun {
			break
		}
	}
	c1, s1, w1 := selfCPU(), procCPU(serverPID), wakeupsOf(p)
	if err := p.roundTrip(true); err != nil {
		return summary{}, fmt.Errorf("%s after timing: %w", fmtSize(size), err)
	}
	s := summarize(transport, size, lat[:i], c1-c0, s1-s0)
	s.Wakeups = perRoundTrip(w0, w1, i)
	return s, nil
}

// newPayload returns size bytes of a pattern that differs per size.
func newPayload(size int) []byte {
	p := make([]byte, size)
	for i := range p {
		p[i] = byte(i*131 + size)
	}
	return p
}

// bump changes the payload's first and last byte, so that a verified round
// trip cannot pass on a stale echo.
func bump(p []byte) {
	p[0]++
	p[len(p)-1]--
}

var errMismatch = errors.New("the echo differs from what was sent")

// sizeHeader is the 4-byte big-endian message size that starts a connection.
func sizeHeader(size int) []byte {
	return binary.BigEndian.AppendUint32(nil, uint32(size))
}

// wakeupsOf is p's wake-up count, or -1 for a transport without them.
func wakeupsOf(p pinger) int64 {
	if w, ok := p.(interface{ wakeups() int64 }); ok {
		return w.wakeups()
	}
	return -1
}

// perRoundTrip is the wake-ups between counts w0 and w1 per round trip, or
// nil for a transport without them.
func perRoundTrip(w0, w1 int64, n int) *float64 {
	if w0 < 0 {
		return nil
	}
	v := float64(w1-w0) / float64(n)
	return &v
}

// fmtWakeups formats a wake-up rate, "-" for a transport without them.
func fmtWakeups(w *float64) string {
	if w == nil {
		return "-"
	}
	return fmt.Sprintf("%.3f", *w)
}

package shmipc

// CPU hogs: child processes that spin while a benchmark run with -hogs N
// measures.

import (
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

// ---- CPU hogs ----------------------------------------------------------------

// benchHogRole is the proctest role of a CPU hog child.
const benchHogRole = "cpu-hog"

// startBenchHogs starts n CPU hogs, child processes that spin on one core
// each, and stops them when b ends.
func startBenchHogs(b *testing.B, n int) {
	for range n {
		c, _ := startChild(b, proctest.Config{
			TestName: "TestBenchHogChild",
			Role:     benchHogRole,
			Timeout:  24 * time.Hour, // a full benchmark run takes long; Stop and the parent's death end it
		})
		b.Cleanup(func() {
			if err := c.Stop(10 * time.Second); err != nil {
				b.Errorf("CPU hog: %v\n%s", err, c.Output())
			}
		})
	}
}

// TestBenchHogChild is the CPU hog of the contended benchmarks: started by
// startBenchHogs, it spins until its stdin closes.
func TestBenchHogChild(t *testing.T) {
	if proctest.Role() != benchHogRole {
		t.Skip("helper process: a CPU hog for the ping-pong benchmarks run with -hogs")
	}
	stop := proctest.StdinClosed()
	proctest.Ready()
	for {
		select {
		case <-stop:
			return
		default:
		}
		for range 1 << 20 {
			hogSink++
		}
	}
}

// hogSink is what the CPU hog computes, kept so that its loop stays.
var hogSink uint64

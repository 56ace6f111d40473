package shmipc

import (
	"sync/atomic"
	"time"

	shm "github.com/goshm/shmipc"
)

// Monitor receives the metrics of the sessions of every Config it is set
// in: OnEmitSessionMetrics for each session every 30 s and once more when
// the session has ended (before its CloseChan is closed), each followed
// by Flush. The calls come from one
// goroutine of the package, one at a time.
type Monitor interface {
	OnEmitSessionMetrics(PerformanceMetrics, StabilityMetrics, ShareMemoryMetrics, *Session)
	Flush() error
}

// PerformanceMetrics are a session's traffic since its previous report;
// the queue counts are current.
type PerformanceMetrics struct {
	ReceiveSyncEventCount uint64 // wake-ups received from the peer
	SendSyncEventCount    uint64 // wake-ups sent to the peer
	OutFlowBytes          uint64 // payload bytes sent
	InFlowBytes           uint64 // payload bytes received
	SendQueueCount        uint64 // elements sent and not yet taken by the peer
	ReceiveQueueCount     uint64 // elements received and not yet taken
}

// StabilityMetrics are a session's events since its previous report; the
// stream count is current. AllocShmErrorCount counts writes that found no
// room in shared memory or the peer's queue and waited (this library
// waits rather than falling back), so QueueFullErrorCount is 0. The hot
// restart counts are those of the session's listener or manager, each
// reported by one of its sessions.
type StabilityMetrics struct {
	AllocShmErrorCount     uint64
	FallbackWriteCount     uint64 // messages sent over the socket
	FallbackReadCount      uint64 // fallback frames received
	EventConnErrorCount    uint64 // 1 in the report of a session that ended by an error
	QueueFullErrorCount    uint64
	ActiveStreamCount      uint64 // open streams
	HotRestartSuccessCount uint64
	HotRestartErrorCount   uint64
}

// ShareMemoryMetrics describe a session's buffer region.
type ShareMemoryMetrics struct {
	CapacityOfShareMemoryInBytes uint64 // its size
	AllInUsedShareMemoryInBytes  uint64 // bytes of the slices in use by either side
}

// How often watch looks for ended sessions, and how often it reports to
// monitors.
const watchInterval = 20 * time.Millisecond

var monitorInterval atomic.Int64 // a time.Duration

func init() { monitorInterval.Store(int64(30 * time.Second)) }

// watch runs while sessions holds any: it closes the CloseChan of ended
// sessions and forgets them, and reports to their monitors.
func watch() {
	t := time.NewTicker(watchInterval)
	defer t.Stop()
	lastReport := time.Now()
	for range t.C {
		report := time.Since(lastReport) >= time.Duration(monitorInterval.Load())
		if report {
			lastReport = time.Now()
		}
		if watchOnce(report) == 0 {
			// A session stored meanwhile found watch running: look again.
			sessions.watched.Store(false)
			if empty() || !sessions.watched.CompareAndSwap(false, true) {
				return
			}
		}
	}
}

// watchOnce handles ended sessions, reports every session to its monitor
// if report is set, and returns the number of sessions still open.
func watchOnce(report bool) int {
	open := 0
	sessions.m.Range(func(k, v any) bool {
		s := v.(*Session)
		ended := k.(*shm.Session).IsClosed()
		if s.monitor != nil && (ended || report) {
			p, q, m := s.GetMetrics()
			s.monitor.OnEmitSessionMetrics(p, q, m, s)
			s.monitor.Flush()
		}
		if ended {
			sessions.m.Delete(k)
			close(s.closed)
		} else {
			open++
		}
		return true
	})
	return open
}

// empty reports whether sessions holds none.
func empty() bool {
	none := true
	sessions.m.Range(func(any, any) bool { none = false; return false })
	return none
}

package shmipc

import (
	"cmp"
	"expvar"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/goshm/shmipc/internal/shm"
)

// Stats are a session's counters, or the sum over sessions (AggregateStats).
// Counts are since the session started; gauges (Active…, Queue…, Lists) are
// the values when Stats was called.
type Stats struct {
	MessagesOut uint64 // messages sent, through shared memory or as fallback data
	BytesOut    uint64 // their payload bytes
	// MessagesIn counts messages received: IO queue elements and
	// FallbackData frames (a large fallback message may come in several).
	MessagesIn uint64
	BytesIn    uint64 // their payload bytes

	FallbackMessagesOut uint64 // messages sent as FallbackData frames
	// FallbackBytesOut counts their payload bytes, and those of the
	// frames that went out of a message cut short (by Close, a deadline or
	// a failed write), which BytesOut counts too.
	FallbackBytesOut   uint64
	FallbackMessagesIn uint64 // FallbackData frames received
	FallbackBytesIn    uint64 // their payload bytes

	WakeupsSent     uint64 // Polling frames sent: the peer was asleep
	WakeupsSaved    uint64 // messages published while the peer was awake, so no Polling frame was needed
	WakeupsReceived uint64 // Polling frames received

	ReadsPolled uint64 // reads that waited and found their data polling the IO queue themselves
	ReadsWoken  uint64 // reads that waited parked until their data was handed to them

	// SpaceWaits counts the writes that had to wait for room in the buffer
	// region or in the peer's IO queue (back-pressure): the peer had not yet
	// released or taken enough of what was sent.
	SpaceWaits uint64

	ActiveStreams  int   // open streams
	SendQueueDepth int64 // elements published to the peer and not yet taken
	RecvQueueDepth int64 // elements the peer published that this side has not yet taken

	Lists []ListStats // the buffer region by size class (one session only)

	// Buffer and Queue describe the shared regions: for one session, the
	// buffer region it uses (which sessions of one client process may
	// share) and its own queue region; for AggregateStats, the sum over the
	// distinct regions of the live sessions.
	Buffer RegionStats
	Queue  RegionStats
}

// RegionStats describes the memory of one shared region (or a sum of them).
type RegionStats struct {
	// Size is the length of the region: address space, not memory.
	Size uint64
	// Committed is how much of the region is backed by memory now (pages
	// that have been written and not given back). This memory is shared:
	// both processes of a session see the same pages, and it shows under
	// Shmem in /proc/meminfo, counted once.
	Committed uint64
	// InUse is the data capacity of the slices handed out and not yet freed,
	// by either process and any session of a shared region (buffer regions
	// only). Only the region's creator, the client, knows which slices are
	// parked: a server counts them in use, as ListStats.Free does. An open
	// stream that has read a message may keep one slice of up to 128 KiB for
	// its next one (at most an eighth of a class per process), so a region
	// at rest shows up to one such slice per open stream in use.
	InUse uint64
	// Sessions is the number of this process's sessions using the region
	// (or, for AggregateStats, the number of regions summed).
	Sessions int
}

// ListStats describes one size class of a buffer region.
type ListStats struct {
	SliceSize uint32 // data bytes per slice
	Slices    uint32 // slices in the class
	Free      int32  // slices free now, parked ones included
	// Parked is how many of the free slices this process, which created
	// the region, has taken out of circulation with their pages given
	// back, because traffic needs fewer; it hands them out again on demand.
	// A process that did not create the region parks none, and does not
	// count the creator's parked slices as free.
	Parked int32
}

// sessionCounters are updated on the hot paths with atomic adds. Writers
// update the first group and the receive loop the second, each on cache
// lines of its own.
type sessionCounters struct {
	_                                     cacheLinePad
	messagesOut, bytesOut                 atomic.Uint64
	fallbackMessagesOut, fallbackBytesOut atomic.Uint64
	wakeupsSent, wakeupsSaved             atomic.Uint64
	spaceWaits                            atomic.Uint64
	_                                     cacheLinePad
	messagesIn, bytesIn                   atomic.Uint64
	fallbackMessagesIn, fallbackBytesIn   atomic.Uint64
	wakeupsReceived                       atomic.Uint64
	readsPolled, readsWoken               atomic.Uint64
	_                                     cacheLinePad
}

type cacheLinePad [64]byte

// counterStripes is how many sets of counters a session has. A stream
// counts in the set its id picks, so that streams on different processors
// mostly write different cache lines.
const (
	counterStripeBits = 2
	counterStripes    = 1 << counterStripeBits
)

type stripedCounters [counterStripes]sessionCounters

// of returns the set stream id counts in (0 for counts of no stream).
func (c *stripedCounters) of(id uint32) *sessionCounters {
	return &c[(id*0x9E3779B1)>>(32-counterStripeBits)] // Fibonacci hashing: the top bits
}

func (c *stripedCounters) addTo(st *Stats) {
	for i := range c {
		c[i].addTo(st)
	}
}

func (c *sessionCounters) addTo(st *Stats) {
	st.MessagesOut += c.messagesOut.Load()
	st.BytesOut += c.bytesOut.Load()
	st.MessagesIn += c.messagesIn.Load()
	st.BytesIn += c.bytesIn.Load()
	st.FallbackMessagesOut += c.fallbackMessagesOut.Load()
	st.FallbackBytesOut += c.fallbackBytesOut.Load()
	st.FallbackMessagesIn += c.fallbackMessagesIn.Load()
	st.FallbackBytesIn += c.fallbackBytesIn.Load()
	st.WakeupsSent += c.wakeupsSent.Load()
	st.WakeupsSaved += c.wakeupsSaved.Load()
	st.WakeupsReceived += c.wakeupsReceived.Load()
	st.ReadsPolled += c.readsPolled.Load()
	st.ReadsWoken += c.readsWoken.Load()
	st.SpaceWaits += c.spaceWaits.Load()
}

// Stats returns the session's counters and gauges. The gauges of a closed
// session are zero.
func (s *Session) Stats() Stats {
	var counts Stats
	s.counters.addTo(&counts)
	if s.IsClosed() || !s.queueRegion.Acquire() {
		return counts
	}
	defer s.queueRegion.Release()
	st := counts
	s.mu.Lock()
	st.ActiveStreams = len(s.streams)
	s.mu.Unlock()
	err := s.access(func() error {
		st.SendQueueDepth = s.sendQ.Depth()
		st.RecvQueueDepth = s.recvQ.Depth()
		if m := s.buf; m.Region().Acquire() {
			defer m.Region().Release()
			lists := m.Lists()
			st.Lists = make([]ListStats, len(lists))
			st.Buffer = RegionStats{Size: uint64(len(m.Region().Mem())), Committed: m.Region().Committed(), Sessions: int(m.Sessions())}
			for i, l := range lists {
				st.Lists[i] = ListStats{SliceSize: l.SliceCap, Slices: l.Count, Free: l.Free, Parked: l.Parked}
				if held := int64(l.Count) - int64(l.Free); held > 0 {
					st.Buffer.InUse += uint64(held) * uint64(l.SliceCap)
				}
			}
		}
		st.Queue = RegionStats{Size: uint64(len(s.queueRegion.Mem())), Committed: s.queueRegion.Committed(), Sessions: 1}
		return nil
	})
	if err != nil {
		return counts // a fault ended the session: its gauges are zero
	}
	return st
}

// registry holds live sessions and ended ones' counts, for AggregateStats.
var registry = struct {
	sync.Mutex
	live  map[*Session]struct{}
	ended Stats
}{live: make(map[*Session]struct{})}

func register(s *Session) {
	registry.Lock()
	registry.live[s] = struct{}{}
	registry.Unlock()
}

// unregister moves an ending session's counts into the ended total.
func unregister(s *Session) {
	registry.Lock()
	delete(registry.live, s)
	s.counters.addTo(&registry.ended)
	registry.Unlock()
}

// AggregateStats sums the counters of every session this process has had,
// and the gauges of the live ones; Lists is left empty, and a buffer region
// that sessions share is counted once (see Stats.Buffer).
func AggregateStats() Stats {
	registry.Lock()
	total := registry.ended
	live := slices.Collect(maps.Keys(registry.live))
	registry.Unlock()
	buffers := make(map[*shm.Buffer]bool)
	for _, s := range live {
		st := s.Stats()
		s.counters.addTo(&total)
		total.ActiveStreams += st.ActiveStreams
		total.SendQueueDepth += st.SendQueueDepth
		total.RecvQueueDepth += st.RecvQueueDepth
		total.Queue.add(st.Queue)
		if st.Buffer.Size != 0 && !buffers[s.buf] {
			buffers[s.buf] = true
			total.Buffer.add(st.Buffer)
		}
	}
	return total
}

// add sums r into t, counting regions in Sessions.
func (t *RegionStats) add(r RegionStats) {
	t.Size += r.Size
	t.Committed += r.Committed
	t.InUse += r.InUse
	t.Sessions++
}

// PublishExpvar publishes AggregateStats as the expvar variable name (shown
// at /debug/vars by net/http's expvar handler). Like expvar.Publish, it
// panics if the name is already in use.
func PublishExpvar(name string) {
	expvar.Publish(name, expvar.Func(func() any { return AggregateStats() }))
}

// discardLogger is the logger of a Config without one: silent.
var discardLogger = slog.New(slog.DiscardHandler)

func (c *Config) logger() *slog.Logger { return cmp.Or(c.Logger, discardLogger) }

package shmipc

// Hostile IO queues and queue elements: head and tail counters that are too
// far apart or run backwards, elements with stream id 0, unknown statuses
// or a close that carries an offset, and elements for streams the victim
// does not know. Both victims face the same cases; what an element for an
// unknown stream means differs between a server and a client.

import (
	"fmt"
	"testing"

	"github.com/goshm/shmipc/internal/shm"
)

// hpQueueCases are the IO queue corruptions both victims face.
func hpQueueCases() []hpCase {
	return []hpCase{
		{name: "element for stream id 0", want: []string{"stream id 0"},
			do: func(c *hpCtx) { c.publish(0, c.p.msg("zero"), shm.StatusOpened) }},
		{name: "status 2 (HalfClosed on the wire)", want: []string{"status", "0x2"},
			do: func(c *hpCtx) { c.publish(c.id, c.p.msg("x"), 2) }},
		{name: "status 0x1FF", want: []string{"status", "0x1ff"},
			do: func(c *hpCtx) { c.publish(c.id, c.p.msg("x"), 0x1FF) }},
		{name: "status 0xFFFFFF07", want: []string{"status"},
			do: func(c *hpCtx) { c.publish(c.id, c.p.msg("x"), 0xFFFFFF07) }},
		{name: "close element with an offset", want: []string{"close", "offset"},
			do: func(c *hpCtx) { c.publish(c.id, c.p.msg("x"), shm.StatusClosed) }},
		{name: "receive queue tail 2^32 ahead of head", want: []string{"head", "tail", "apart"},
			do: func(c *hpCtx) { c.p.send.setTail(c.p.send.head() + 1<<32); c.wake() }},
		{name: "receive queue tail just past capacity", want: []string{"apart"},
			do: func(c *hpCtx) { c.p.send.setTail(c.p.send.head() + int64(c.p.send.cap) + 1); c.wake() }},
		{name: "receive queue tail behind head", want: []string{"head", "tail", "apart"},
			do: func(c *hpCtx) { c.p.send.setTail(c.p.send.head() - 1); c.wake() }},
		{name: "receive queue tail negative", want: []string{"apart"},
			do: func(c *hpCtx) { c.p.send.setTail(-1 << 62); c.wake() }},
		{name: "send queue head ahead of tail", want: []string{"IO queue", "head"},
			do: func(c *hpCtx) { c.provokeSend(func() { c.p.recv.setHead(c.p.recv.tail() + 5) }) }},
		{name: "send queue head 2^32 behind tail", want: []string{"IO queue", "apart"},
			do: func(c *hpCtx) { c.provokeSend(func() { c.p.recv.setHead(c.p.recv.tail() - 1<<32) }) }},
		// The library reads these fields once, at mapping time; rewriting
		// them later must change nothing.
		{name: "queue cap fields rewritten to 0", survive: hpSurviveRoundTrip,
			do: func(c *hpCtx) { c.p.send.setCapField(0); c.p.recv.setCapField(0) }},
		{name: "queue cap fields rewritten to 0xFFFFFFFF", survive: hpSurviveRoundTrip,
			do: func(c *hpCtx) { c.p.send.setCapField(0xFFFFFFFF); c.p.recv.setCapField(0xFFFFFFFF) }},
		// The consumer keeps its own head: a rewritten shared head is
		// overwritten by the next pop.
		{name: "receive queue head rewritten past tail", survive: hpSurviveRoundTrip,
			do: func(c *hpCtx) { c.p.send.setHead(c.p.send.tail() + 100) }},
		// Receivers mask the status with 0xFF (docs/protocol.md §9.3).
		{name: "status 0x100 is data", survive: func(c *hpCtx) error { return c.roundTrip("upper bits", 0x100) },
			do: func(c *hpCtx) {}},
	}
}

func TestHostileClientQueue(t *testing.T) {
	cases := append(hpQueueCases(),
		hpCase{name: "data for an unknown stream opens it", do: func(c *hpCtx) {
			c.publish(77, c.p.msg("implicit open"), shm.StatusOpened)
		}, survive: func(c *hpCtx) error { return c.expectData(77, "implicit open") }},
		hpCase{name: "close element for an unknown stream is ignored", do: func(c *hpCtx) {
			c.publish(78, 0, shm.StatusClosed)
		}, survive: hpSurviveRoundTrip},
	)
	hpAgainstServer(t, cases)
}

func TestHostileServerQueue(t *testing.T) {
	cases := append(hpQueueCases(),
		hpCase{name: "data for an unknown stream is dropped", do: func(c *hpCtx) {
			c.publish(99, c.p.msg("stray"), shm.StatusOpened)
		}, survive: hpSurviveRoundTrip},
		hpCase{name: "close element for an unknown stream is ignored", do: func(c *hpCtx) {
			c.publish(98, 0, shm.StatusClosed)
		}, survive: hpSurviveRoundTrip},
	)
	hpAgainstClient(t, cases)
}

// TestHostileServerStrayData: data for a stream the client never opened is
// freed and dropped (docs/protocol.md §9.2).
func TestHostileServerStrayData(t *testing.T) {
	env := startTestServer(t, defaultConsumerSpinTime)
	for _, mode := range bothModes {
		t.Run(modeName(mode), func(t *testing.T) {
			c := hpClientCase(t, mode, false)
			before := freeCounts(c.p.bm)[0]
			c.publish(99, c.p.msg("stray"), shm.StatusOpened)
			waitUntil(t, fmt.Sprintf("the stray slice is freed (free count of list 0 back to %d)", before), peerTimeout, func() bool { return freeCounts(c.p.bm)[0] == before })
			c.p.write(rawFallbackFrame(c.p.version, 0, 97, 0, "stray fallback"))
			if err := hpSurviveRoundTrip(c); err != nil {
				t.Error(err)
			}
			if c.victim.IsClosed() {
				t.Errorf("victim closed: %v", c.victim.Err())
			}
			closeWithin(t, c.victim, peerTimeout)
			env.checkGood(t)
		})
	}
}

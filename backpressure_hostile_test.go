package shmipc

// A raw peer that floods waiting readers with frames as large as the
// session accepts: the fallback bounds hold.

import (
	"errors"
	"strings"
	"testing"
	"time"
)

// hostileFlood has the raw peer p send count frames of a frame's worth to
// each stream of ids, while the test watches how much fallback data the
// victim holds, until the writes are done or 30 s pass.
func hostileFlood(t *testing.T, p *rawPeer, victim *Session, ids []uint32, count int) (most int64) {
	data := strings.Repeat("x", minFallbackFrame-16)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range count {
			for _, id := range ids {
				p.conn.SetWriteDeadline(time.Now().Add(peerTimeout))
				if _, err := p.conn.Write(rawFallbackFrame(p.version, 0, id, 0, data)); err != nil {
					return
				}
			}
		}
	}()
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); {
		most = max(most, victim.fallbackHeld.Load())
		select {
		case <-done:
			return most
		case <-time.After(time.Millisecond):
		}
	}
	t.Fatal("the flood's writes still blocked after 30 s")
	return most
}

// hostileVictim is a client session of a raw server, with fallback bounds
// perStream and session and frames of at most minFallbackFrame. Its
// readers never make room, so every stall is waited out: the stall timeout
// is short (50 ms with -short), which changes how long each stall lasts,
// not what the session holds meanwhile.
func hostileVictim(t *testing.T, perStream, session int) (*rawPeer, *Session) {
	t.Helper()
	return acceptRawVictimWith(t, MemMapTypeDevShmFile, defaultConsumerSpinTime, func(c *Config) {
		c.MaxFallbackFrameSize = minFallbackFrame
		c.MaxFallbackBufferedPerStream = perStream
		c.MaxFallbackBuffered = session
		c.FallbackStallTimeout = shortOr(200*time.Millisecond, 50*time.Millisecond)
	})
}

// TestHostileFramesForWaitingReaders: a peer sends frames as large as the
// session accepts to streams whose readers wait: readers that each want a
// header or a byte, one scanning for a delimiter (netpoll Until, which
// waits for one byte more each time), one reading byte by byte and
// releasing only at the end of a line. None of them gets an exception from
// the bounds for that: the session holds at most its bound and a frame,
// the streams nobody makes room on fail with ErrLimitExceeded, and the
// session goes on.
func TestHostileFramesForWaitingReaders(t *testing.T) {
	for _, tc := range []struct {
		name               string
		perStream, session int
		streams, frames    int
		read               func(st *Stream)
	}{
		{"ReadBytes of a header", 512 << 10, 1 << 20, 8, 1, func(st *Stream) { st.BufferReader().ReadBytes(32) }},
		{"Read, bounds below a frame", 256 << 10, 512 << 10, 8, 1, func(st *Stream) { st.Read(make([]byte, 1)) }},
		{"Until", 1 << 20, 2 << 20, 1, 8, func(st *Stream) { st.NetpollReader().Until('\n') }},
		{"ReadByte, released at a newline", 1 << 20, 2 << 20, 1, 8, func(st *Stream) {
			r := st.NetpollReader()
			for {
				c, err := r.ReadByte()
				if err != nil {
					return
				}
				if c == '\n' {
					r.Release()
				}
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if testing.Short() && tc.name != "ReadBytes of a header" && tc.name != "Until" {
				t.Skip("-short: a reader of each kind")
			}
			// The cases run beside each other: each has a raw server and
			// a victim of its own (own region files), and they use no
			// process-global state.
			t.Parallel()
			p, victim := hostileVictim(t, tc.perStream, tc.session)
			defer victim.Close()
			block := make(chan struct{})
			defer close(block)
			var streams []*Stream
			var ids []uint32
			// With -short, at most 3 streams and 3 frames a stream (each
			// frame is 32 MiB): every frame past the first still finds a
			// bound full, waits out a stall and fails a stream.
			for range shortOr(tc.streams, min(tc.streams, 3)) {
				st := openPinged(t, p, victim)
				st.SetDeadline(time.Time{})
				streams = append(streams, st)
				ids = append(ids, st.ID())
				go func() {
					tc.read(st)
					<-block // and never reads again
				}()
			}
			waitBlocked(t, "(*Stream).awaitReadable", len(streams)) // the readers wait
			limit := int64(tc.session) + minFallbackFrame
			if most := hostileFlood(t, p, victim, ids, shortOr(tc.frames, min(tc.frames, 3))); most > limit {
				t.Errorf("the session held %d bytes of fallback data; MaxFallbackBuffered and a frame are %d", most, limit)
			}
			failed := 0
			for _, st := range streams {
				if err := st.failure(); err != nil {
					if !errors.Is(err, ErrLimitExceeded) || !strings.Contains(err.Error(), "Config.MaxFallbackBuffered") {
						t.Errorf("stream %d failed with %v, want ErrLimitExceeded naming a bound", st.ID(), err)
					}
					failed++
				}
			}
			if failed == 0 {
				t.Error("no stream failed")
			}
			if err := victim.Err(); err != nil {
				t.Errorf("session: %v, want it open", err)
			}
			openPinged(t, p, victim) // the session still carries new streams
		})
	}
}

package shmipc

// The traffic of the soak tests: the message format, sending and verifying
// messages, and the loops of one stream, of the client and of the server.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	mbits "math/bits"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"
)

// Message format: a 24-byte header and the body.
//
//	magic u32 | stream id u32 | seq u32 | body length u32 | crc32(body) u32 | flags u32
//
// seq counts the messages of one direction of one stream from 0. The end
// marker has flag skFlagEnd, an empty body and seq = number of messages
// before it.
const (
	skMagic   = 0x534f414b // "SOAK"
	skHdrSize = 24
	skFlagEnd = 1

	skMaxBody       = 4 << 20
	skFallbackSize  = 5 << 20 // > the largest slice of either session: fallback
	skFallbackEvery = 6       // one stream in this many starts with a fallback message
)

// skPool is random data the bodies are cut from (at random offsets).
var skPool = sync.OnceValue(func() []byte { return mpPayload(skFallbackSize+64<<10, 0x5eed) })

// skStats counts what one process verified.
type skStats struct {
	msgs, bytes       atomic.Int64 // messages (end markers included) and body bytes verified
	streams           atomic.Int64 // streams finished in both directions
	fallbackStreams   atomic.Int64 // of which sent fallback data
	queueFullRetries  atomic.Int64
	zeroCopyReads     atomic.Int64
	copyReads         atomic.Int64
	fallbackMsgsBuilt atomic.Int64
}

func (s *skStats) String() string {
	return fmt.Sprintf("msgs=%d bytes=%d streams=%d fallbackStreams=%d queueFullRetries=%d",
		s.msgs.Load(), s.bytes.Load(), s.streams.Load(), s.fallbackStreams.Load(), s.queueFullRetries.Load())
}

// skSize returns a random body size in [1, max], log-uniform, so small and
// large messages are both common.
func skSize(rng *rand.Rand, max int) int {
	bits := 1 + rng.IntN(mbits.Len(uint(max)))
	hi := min(1<<bits-1, max)
	lo := 1 << (bits - 1)
	return lo + rng.IntN(hi-lo+1)
}

// skBody returns n bytes of the pool at a random offset.
func skBody(rng *rand.Rand, n int) []byte {
	pool := skPool()
	off := rng.IntN(len(pool) - n + 1)
	return pool[off : off+n]
}

func skPutHeader(h []byte, id, seq uint32, body []byte, flags uint32) {
	binary.BigEndian.PutUint32(h[0:], skMagic)
	binary.BigEndian.PutUint32(h[4:], id)
	binary.BigEndian.PutUint32(h[8:], seq)
	binary.BigEndian.PutUint32(h[12:], uint32(len(body)))
	binary.BigEndian.PutUint32(h[16:], crc32.ChecksumIEEE(body))
	binary.BigEndian.PutUint32(h[20:], flags)
}

// How skSend builds a message.
const (
	skViaReserve    = iota // BufferWriter.Reserve of the whole message (larger than the largest slice: fallback data)
	skViaWriteBytes        // two BufferWriter.WriteBytes and a Flush
	skViaWrite             // Write of the header, then Write of the body: two messages
)

// skReserveIf is skViaReserve if reserve, else skViaWriteBytes.
func skReserveIf(reserve bool) int {
	if reserve {
		return skViaReserve
	}
	return skViaWriteBytes
}

// skSend sends one message on st, built as via says. A message refused
// with ErrQueueFull was not sent and is sent again.
func skSend(st *Stream, seq uint32, body []byte, flags uint32, via int, stats *skStats) error {
	var h [skHdrSize]byte
	skPutHeader(h[:], st.ID(), seq, body, flags)
	if via == skViaWrite {
		for _, part := range [][]byte{h[:], body} {
			if len(part) == 0 {
				continue
			}
			for {
				_, err := st.Write(part)
				if errors.Is(err, ErrQueueFull) {
					if stats != nil {
						stats.queueFullRetries.Add(1)
					}
					time.Sleep(time.Millisecond)
					continue
				}
				if err != nil {
					return err
				}
				break
			}
		}
		return nil
	}
	reserve := via == skViaReserve
	for {
		w := st.BufferWriter()
		var err error
		if reserve {
			var p []byte
			if p, err = w.Reserve(skHdrSize + len(body)); err == nil {
				copy(p, h[:])
				copy(p[skHdrSize:], body)
			}
		} else {
			if _, err = w.WriteBytes(h[:]); err == nil {
				_, err = w.WriteBytes(body)
			}
		}
		if err == nil {
			err = st.Flush(false)
		} else {
			_ = st.Flush(false) // discards the partial message (the stream is dead anyway)
		}
		if errors.Is(err, ErrQueueFull) {
			if stats != nil {
				stats.queueFullRetries.Add(1)
			}
			time.Sleep(time.Millisecond)
			continue
		}
		return err
	}
}

// skReader reads and verifies the messages of one direction of a stream.
type skReader struct {
	st    *Stream
	seq   uint32
	buf   []byte
	rng   *rand.Rand
	hold  bool // read everything with ReadBytes and never release
	stats *skStats
}

// next reads one message and checks it; it returns the flags and the body
// length. A message that is not the next one in sequence, belongs to another
// stream or fails its checksum is an error wrapping errSkCorrupt.
func (r *skReader) next() (flags uint32, n int, err error) {
	var h []byte
	if r.hold {
		if h, err = r.st.BufferReader().ReadBytes(skHdrSize); err != nil {
			return 0, 0, err
		}
	} else {
		var hb [skHdrSize]byte
		if _, err = io.ReadFull(r.st, hb[:]); err != nil {
			return 0, 0, err
		}
		h = hb[:]
	}
	magic := binary.BigEndian.Uint32(h[0:])
	id := binary.BigEndian.Uint32(h[4:])
	seq := binary.BigEndian.Uint32(h[8:])
	n = int(binary.BigEndian.Uint32(h[12:]))
	sum := binary.BigEndian.Uint32(h[16:])
	flags = binary.BigEndian.Uint32(h[20:])
	if magic != skMagic || id != r.st.ID() || seq != r.seq || n > skFallbackSize || flags&^skFlagEnd != 0 {
		return 0, 0, fmt.Errorf("%w: stream %d: header %x, want magic %x, stream %d, seq %d, length <= %d",
			errSkCorrupt, r.st.ID(), h, skMagic, r.st.ID(), r.seq, skFallbackSize)
	}
	var body []byte
	if r.hold || r.rng.IntN(2) == 0 {
		body, err = r.st.BufferReader().ReadBytes(n) // zero-copy where it can
		if r.stats != nil {
			r.stats.zeroCopyReads.Add(1)
		}
	} else {
		if cap(r.buf) < n {
			r.buf = make([]byte, n)
		}
		body = r.buf[:n]
		_, err = io.ReadFull(r.st, body)
		if r.stats != nil {
			r.stats.copyReads.Add(1)
		}
	}
	if err != nil {
		return 0, 0, err
	}
	if got := crc32.ChecksumIEEE(body); got != sum {
		return 0, 0, fmt.Errorf("%w: stream %d message %d (%d bytes): crc32 %08x, header says %08x", errSkCorrupt, r.st.ID(), seq, n, got, sum)
	}
	if !r.hold && !r.st.s.conf.FallbackWhenFull {
		// Under back-pressure a reader must not keep a message while it
		// waits for the next one: the writer of the next one may be waiting
		// for exactly that memory. With FallbackWhenFull the reader keeps it
		// until its next read, which the fallback path absorbs.
		r.st.BufferReader().ReleasePreviousRead()
	}
	r.seq++
	if r.stats != nil {
		r.stats.msgs.Add(1)
		r.stats.bytes.Add(int64(n))
	}
	return flags, n, nil
}

var errSkCorrupt = errors.New("corrupted, lost, duplicated or reordered data")

// skRunStream runs one stream to the end on either side: it sends count
// messages (the first a fallback-forcing one if fallback) and its end
// marker, reads the peer's messages up to the peer's end marker, and closes
// the stream.
func skRunStream(st *Stream, seed uint64, count int, fallback bool, stats *skStats) error {
	defer st.Close()
	st.SetDeadline(time.Now().Add(skStreamTimeout)) // a hang fails, with a clear error
	werr := make(chan error, 1)
	go func() {
		rng := rand.New(rand.NewPCG(seed, 1))
		for i := range count {
			var err error
			if i == 0 && fallback {
				stats.fallbackMsgsBuilt.Add(1)
				err = skSend(st, uint32(i), skBody(rng, skFallbackSize-skHdrSize), 0, skViaReserve, stats)
			} else {
				body := skBody(rng, skSize(rng, skMaxBody))
				via := skViaWriteBytes
				switch rng.IntN(4) {
				case 0:
					via = skViaReserve
				case 1:
					via = skViaWrite
				}
				err = skSend(st, uint32(i), body, 0, via, stats)
			}
			if err != nil {
				werr <- fmt.Errorf("stream %d: sending message %d: %w", st.ID(), i, err)
				return
			}
		}
		endVia := skViaWriteBytes
		if count%2 == 1 {
			endVia = skViaWrite
		}
		if err := skSend(st, uint32(count), nil, skFlagEnd, endVia, stats); err != nil {
			werr <- fmt.Errorf("stream %d: sending the end marker: %w", st.ID(), err)
			return
		}
		werr <- nil
	}()
	r := &skReader{st: st, rng: rand.New(rand.NewPCG(seed, 2)), stats: stats}
	var rerr error
	for {
		flags, _, err := r.next()
		if err != nil {
			rerr = fmt.Errorf("stream %d: reading message %d: %w", st.ID(), r.seq, err)
			break
		}
		if flags&skFlagEnd != 0 {
			break
		}
	}
	err := <-werr
	if rerr != nil {
		return rerr
	}
	if err != nil {
		return err
	}
	stats.streams.Add(1)
	if st.fallback.Load() {
		stats.fallbackStreams.Add(1)
	}
	return nil
}

// skClient keeps slots streams busy on a client session until deadline.
func skClient(sess *Session, slots int, deadline time.Time, seed uint64, stats *skStats) []error {
	var wg sync.WaitGroup
	var mu sync.Mutex
	var errs []error
	for slot := range slots {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(seed, uint64(slot)))
			for n := 0; time.Now().Before(deadline); n++ {
				st, err := sess.OpenStream()
				if err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
					return
				}
				fallback := rng.IntN(skFallbackEvery) == 0
				if err := skRunStream(st, rng.Uint64(), 1+rng.IntN(12), fallback, stats); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
					return
				}
			}
		}()
	}
	wg.Wait()
	return errs
}

// skServer serves every stream accepted by accept until it fails. wg
// counts the accept loop and active its streams.
type skServer struct {
	wg sync.WaitGroup
	// active counts the stream handlers running. Not a WaitGroup: the
	// accept loop starts handlers while the test waits for them to end,
	// and a WaitGroup's Add from zero must happen before its Wait.
	active atomic.Int64
	mu     sync.Mutex
	errs   []error
	stats  *skStats
}

func (s *skServer) serve(accept func() (*Stream, error), seed uint64) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		rng := rand.New(rand.NewPCG(seed, 99))
		for {
			st, err := accept()
			if err != nil {
				return
			}
			sseed, count := rng.Uint64(), 1+rng.IntN(12)
			s.active.Add(1)
			go func() {
				defer s.active.Add(-1)
				if err := skRunStream(st, sseed, count, false, s.stats); err != nil {
					s.mu.Lock()
					s.errs = append(s.errs, err)
					s.mu.Unlock()
				}
			}()
		}
	}()
}

// idle waits up to d for every stream handler to end, and reports whether
// they did.
func (s *skServer) idle(d time.Duration) bool {
	deadline := time.Now().Add(d)
	for s.active.Load() > 0 {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(time.Millisecond)
	}
	return true
}

func (s *skServer) errors() []error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]error(nil), s.errs...)
}

// skStreamTimeout bounds the life of one stream: at most 12 messages of up
// to 5 MiB each way, under -race on a loaded machine.
const skStreamTimeout = 20 * time.Second

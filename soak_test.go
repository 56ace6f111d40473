package shmipc

// Soak: many streams in both directions between two real processes, for a
// while, with every message checksummed and sequenced, so that a single
// corrupted, lost, duplicated or reordered byte fails the test.
//
// Two sessions run at once between the parent and a child process:
//
//   - session A: the parent is the client and the child the server, with the
//     default slice classes in a 16 MiB region;
//   - session B: the child is the client and the parent the server, with a
//     1 MiB region of ReferenceSliceSizes and a 64-element queue, so large
//     messages span many slices, the region runs dry (fallback) and the
//     queue fills (ErrQueueFull, retried).
//
// On each session the client keeps a few stream slots busy: each slot opens
// a stream, both ends send a random number of messages of 1 B to 4 MiB and an
// end marker, read the other end's messages up to its end marker, and close
// the stream; then the slot opens the next one. One stream in skFallbackEvery
// starts with a 5 MiB message built with Reserve, more than the largest slice,
// which goes as fallback data, so the whole stream does from then on.
//
// Short run (part of go test): go test -run TestSoak .
// Long run: go test -run TestSoak -soak.duration=10m -timeout=20m .

import (
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"hash/crc32"
	"io"
	mbits "math/bits"
	"math/rand/v2"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

var soakDuration = flag.Duration("soak.duration", 3*time.Second, "how long TestSoak sends traffic")

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

// Configurations of the two soak sessions.
func skConfigA(prefix string, fallbackWhenFull bool) *Config {
	conf := DefaultConfig()
	conf.FallbackWhenFull = fallbackWhenFull
	conf.ShareMemoryPathPrefix = prefix
	conf.ShareMemoryBufferCap = 16 << 20
	conf.InitializeTimeout = 20 * time.Second
	conf.ConnectionWriteTimeout = 60 * time.Second
	conf.WriteSpaceTimeout = 5 * time.Second // a writer stuck on a full region fails soon
	return conf
}

func skConfigB(prefix string, fallbackWhenFull bool) *Config {
	conf := skConfigA(prefix, fallbackWhenFull)
	conf.ShareMemoryBufferCap = 1 << 20
	conf.BufferSliceSizes = ReferenceSliceSizes()
	conf.QueueCap = 64
	return conf
}

// skStreamTimeout bounds the life of one stream: at most 12 messages of up
// to 5 MiB each way, under -race on a loaded machine.
const skStreamTimeout = 20 * time.Second

const (
	skChildTest = "TestSoakChild"
	skSlotsA    = 6 // parent client → child server
	skSlotsB    = 4 // child client → parent server
)

var soakTotals struct {
	sync.Mutex
	msgs, bytes int64
}

// TestSoakChild is the child process of TestSoak: the server of session A
// (listening on SOCK) and the client of session B (dialing SOCK2) until
// DEADLINE (Unix nanoseconds). When its stdin closes it waits for the
// streams of session A, prints "result <stats>", and then waits for the
// parent to close both sessions.
func TestSoakChild(t *testing.T) {
	if proctest.Role() == "" {
		t.Skip("runs only as the child process of TestSoak")
	}
	prefix := proctest.MustArg(t, "PREFIX")
	dl, err := strconv.ParseInt(proctest.MustArg(t, "DEADLINE"), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Unix(0, dl)
	seed, _ := strconv.ParseUint(proctest.MustArg(t, "SEED"), 10, 64)
	fwf := proctest.MustArg(t, "FWF") == "1"
	stats := &skStats{}

	ln, err := Listen("unix", proctest.MustArg(t, "SOCK"), skConfigA(prefix, fwf))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	srv := &skServer{stats: stats}
	srv.serve(ln.AcceptStream, seed)
	proctest.Ready()

	sessB, err := Dial("unix", proctest.MustArg(t, "SOCK2"), skConfigB(prefix, fwf))
	if err != nil {
		t.Fatal(err)
	}
	defer sessB.Close()
	clientErrs := make(chan []error, 1)
	go func() { clientErrs <- skClient(sessB, skSlotsB, deadline, seed+1, stats) }()

	<-proctest.StdinClosed() // the parent's slots on session A are done
	for _, err := range <-clientErrs {
		t.Errorf("child client (session B): %v", err)
	}
	// The parent opens no more streams; finish ours of session A (they wait
	// for the parent's end markers) before reporting.
	if !srv.idle(2 * time.Minute) {
		t.Errorf("child: session A streams still running 2 min after the parent finished")
	}
	for _, err := range srv.errors() {
		t.Errorf("child server (session A): %v", err)
	}
	proctest.Println("result " + stats.String())
	// The parent closes both sessions once it has read our end markers.
	end := time.Now().Add(2 * time.Minute)
	for {
		ln.mu.Lock()
		n := len(ln.sessions)
		ln.mu.Unlock()
		if n == 0 && sessB.IsClosed() {
			break
		}
		if time.Now().After(end) {
			t.Errorf("the parent did not close the sessions within 2 min")
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	ln.Close()
	if !clWaitGroup(&srv.wg, 30*time.Second) {
		t.Errorf("child accept loop still running")
	}
}

// skParseStats parses the "result" line of the child.
func skParseStats(line string) (map[string]int64, error) {
	rest, ok := strings.CutPrefix(line, "result ")
	if !ok {
		return nil, fmt.Errorf("no result line: %q", line)
	}
	m := make(map[string]int64)
	for _, f := range strings.Fields(rest) {
		k, v, ok := strings.Cut(f, "=")
		if !ok {
			return nil, fmt.Errorf("bad field %q", f)
		}
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return nil, err
		}
		m[k] = n
	}
	return m, nil
}

// TestSoak runs the soak for -soak.duration (3 s by default) in two
// variants: with Config.FallbackWhenFull (a full region sends fallback data,
// as the reference implementations do), and with the default back-pressure
// (a writer waits for the peer to free slices).
func TestSoak(t *testing.T) {
	if proctest.IsChild() {
		t.Skip("parent-only test")
	}
	if testing.Short() {
		t.Skip("-short: a soak test")
	}
	t.Run("fallback-when-full", func(t *testing.T) { skRun(t, true) })
	t.Run("backpressure", func(t *testing.T) { skRun(t, false) })
}

func skRun(t *testing.T, fwf bool) {
	fwfArg := "0"
	if fwf {
		fwfArg = "1"
	}
	dur := shortOr(*soakDuration, *soakDuration/3)
	prefix := shmPrefix(t, "soak")
	dir := t.TempDir()
	sockA, sockB := filepath.Join(dir, "a.sock"), filepath.Join(dir, "b.sock")
	base := clBaseline(t, prefix)
	seed := rand.Uint64()
	t.Logf("soak for %v, seed %d", dur, seed)
	stats := &skStats{}

	// Session B: the parent serves, the child dials.
	rawB, err := net.Listen("unix", sockB)
	if err != nil {
		t.Fatal(err)
	}
	defer rawB.Close()
	deadline := time.Now().Add(dur)
	c, _ := startChild(t, proctest.Config{
		TestName: skChildTest,
		Role:     "soak",
		Args: map[string]string{
			"SOCK": sockA, "SOCK2": sockB, "PREFIX": prefix,
			"DEADLINE": strconv.FormatInt(deadline.UnixNano(), 10),
			"SEED":     strconv.FormatUint(seed, 10),
			"FWF":      fwfArg,
		},
		Timeout: dur + 5*time.Minute,
	})
	start := time.Now()
	sessA, err := Dial("unix", sockA, skConfigA(prefix, fwf))
	if err != nil {
		t.Fatalf("dial the child: %v", err)
	}
	defer sessA.Close()
	connB, err := rawB.Accept()
	if err != nil {
		t.Fatal(err)
	}
	sessB, err := Server(connB, skConfigB(prefix, fwf))
	if err != nil {
		t.Fatalf("session B handshake: %v", err)
	}
	defer sessB.Close()
	srv := &skServer{stats: stats}
	srv.serve(sessB.AcceptStream, seed+2)

	for _, err := range skClient(sessA, skSlotsA, deadline, seed+3, stats) {
		t.Errorf("parent client (session A): %v", err)
	}
	// No more streams on session A; the child finishes its session-B slots,
	// waits for its session-A streams and reports.
	_ = c.CloseStdin()
	line, err := c.ReadLine(dur + 2*time.Minute)
	if err != nil {
		t.Fatalf("waiting for the child's result: %v\n%s", err, c.Output())
	}
	child, err := skParseStats(line)
	if err != nil {
		t.Fatalf("%v\n%s", err, c.Output())
	}
	// Every stream the child opened has seen our end marker; wait until we
	// have read the child's.
	if !srv.idle(2 * time.Minute) {
		t.Errorf("session B streams still running 2 min after the child finished")
	}
	elapsed := time.Since(start)
	sessA.Close()
	sessB.Close()
	rawB.Close()
	if !clWaitGroup(&srv.wg, 30*time.Second) {
		t.Errorf("parent server goroutines still running")
	}
	for _, err := range srv.errors() {
		t.Errorf("parent server (session B): %v", err)
	}
	if err := c.Wait(2 * time.Minute); err != nil {
		t.Errorf("child: %v\n%s", err, c.Output())
	}
	clCheckBack(t, "after the soak", base, prefix)

	totalMsgs, totalBytes, totalStreams := int64(0), int64(0), int64(0)
	defer func() {
		soakTotals.Lock()
		soakTotals.msgs += totalMsgs
		soakTotals.bytes += totalBytes
		soakTotals.Unlock()
	}()
	totalMsgs = stats.msgs.Load() + child["msgs"]
	totalBytes = stats.bytes.Load() + child["bytes"]
	totalStreams = stats.streams.Load() + child["streams"]
	t.Logf("soak ran %v: verified %d messages, %d body bytes (%.1f MiB/s) on %d stream ends; parent %s; child %s",
		elapsed.Round(time.Millisecond), totalMsgs, totalBytes, float64(totalBytes)/(1<<20)/elapsed.Seconds(),
		totalStreams, stats, line)
	if t.Failed() {
		return
	}
	if stats.streams.Load() == 0 || child["streams"] == 0 {
		t.Errorf("a side finished no stream")
	}
	if stats.fallbackStreams.Load()+child["fallbackStreams"] == 0 {
		t.Errorf("no stream went to fallback")
	}
}

// TestSoakInProcess runs the soak's two sessions with both ends in this
// process: both ends' receive loops and writers busy at once, on both
// sessions at once.
func TestSoakInProcess(t *testing.T) {
	if proctest.IsChild() {
		t.Skip("parent-only test")
	}
	if testing.Short() {
		t.Skip("-short: a soak test")
	}
	t.Run("fallback-when-full", func(t *testing.T) { skRunInProcess(t, true) })
	t.Run("backpressure", func(t *testing.T) { skRunInProcess(t, false) })
}

func skRunInProcess(t *testing.T, fwf bool) {
	dur := shortOr(*soakDuration, *soakDuration/3) / 2
	prefix := shmPrefix(t, "soakip")
	base := clBaseline(t, prefix)
	seed := rand.Uint64()
	t.Logf("soak for %v, seed %d", dur, seed)
	stats := &skStats{}
	deadline := time.Now().Add(dur)
	type end struct {
		ln  *Listener
		cli *Session
		srv *skServer
	}
	start := func(name string, conf *Config, seed uint64) end {
		ln, err := Listen("unix", filepath.Join(t.TempDir(), name), conf)
		if err != nil {
			t.Fatal(err)
		}
		srv := &skServer{stats: stats}
		srv.serve(ln.AcceptStream, seed)
		cli, err := Dial("unix", ln.Addr().String(), conf)
		if err != nil {
			t.Fatal(err)
		}
		return end{ln, cli, srv}
	}
	ends := []end{start("a.sock", skConfigA(prefix, fwf), seed), start("b.sock", skConfigB(prefix, fwf), seed+1)}
	errs := make(chan []error, len(ends))
	for i, e := range ends {
		go func() { errs <- skClient(e.cli, []int{skSlotsA, skSlotsB}[i], deadline, seed+2+uint64(i), stats) }()
	}
	for range ends {
		for _, err := range <-errs {
			t.Errorf("client: %v", err)
		}
	}
	for _, e := range ends {
		if !e.srv.idle(2 * time.Minute) {
			t.Errorf("server streams still running 2 min after the clients finished")
		}
		e.cli.Close()
		e.ln.Close()
		if !clWaitGroup(&e.srv.wg, 30*time.Second) {
			t.Errorf("server accept loop still running")
		}
		for _, err := range e.srv.errors() {
			t.Errorf("server: %v", err)
		}
	}
	clCheckBack(t, "after the soak", base, prefix)
	t.Logf("verified %d messages, %d body bytes on %d stream ends; %s", stats.msgs.Load(), stats.bytes.Load(), stats.streams.Load(), stats)
	if stats.streams.Load() == 0 {
		t.Errorf("no stream finished")
	}
	if fwf && stats.fallbackStreams.Load() == 0 {
		t.Errorf("no stream went to fallback")
	}
}

package shmipc

import (
	"bufio"
	"bytes"
	"encoding/json"
	"expvar"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// fpEcho sends msg on a new stream of sess and reads it back.
func fpEcho(t testing.TB, sess *Session, msg []byte) *Stream {
	t.Helper()
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	st.SetDeadline(time.Now().Add(20 * time.Second))
	if _, err := st.Write(msg); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(st, got); err != nil {
		t.Fatal(err)
	}
	if string(got) != string(msg) {
		t.Fatal("echo differs")
	}
	return st
}

// TestRegionCommittedOnUse checks that a new session commits only the pages
// it writes, not its whole buffer region, and that Stats reports the region's
// committed and in-use bytes.
func TestRegionCommittedOnUse(t *testing.T) {
	conf := DefaultConfig()
	sess := dialEchoSession(t, conf)
	st := fpEcho(t, sess, []byte("hello"))
	defer st.Close()

	s := sess.Stats()
	if s.Buffer.Size != uint64(conf.ShareMemoryBufferCap) {
		t.Errorf("Buffer.Size %d, want %d", s.Buffer.Size, conf.ShareMemoryBufferCap)
	}
	// The slice headers of a fresh region and the pages of one small echo:
	// about 11 MiB for the default layout, far from the 128 MiB reserved up
	// front before.
	if s.Buffer.Committed == 0 || s.Buffer.Committed > s.Buffer.Size/4 {
		t.Errorf("Buffer.Committed %d of %d bytes after one small echo; want a small part of it", s.Buffer.Committed, s.Buffer.Size)
	}
	if s.Queue.Committed == 0 || s.Queue.Committed >= s.Queue.Size {
		t.Errorf("Queue.Committed %d of %d bytes after one small echo; want a small part of it", s.Queue.Committed, s.Queue.Size)
	}
	// At rest the open stream may keep the slice of the echo it read, for
	// its next message (reuse.go); nothing else is in use.
	small := uint64(sess.buf.Lists()[0].SliceCap) // lists are in ascending size
	if s.Buffer.InUse > small || s.Buffer.Sessions < 1 {
		t.Errorf("Buffer.InUse %d, Sessions %d at rest with one stream open; want at most %d and at least 1", s.Buffer.InUse, s.Buffer.Sessions, small)
	}

	// A reserved slice is in use, and its pages are committed before the
	// application gets them.
	before := s.Buffer.Committed
	const n = 1 << 20
	if _, err := st.BufferWriter().Reserve(n); err != nil {
		t.Fatal(err)
	}
	s = sess.Stats()
	if s.Buffer.InUse < n {
		t.Errorf("Buffer.InUse %d with a %d-byte reservation held; want at least that", s.Buffer.InUse, n)
	}
	if s.Buffer.Committed < before+n {
		t.Errorf("Buffer.Committed %d after reserving %d bytes on top of %d; want the reservation committed", s.Buffer.Committed, n, before)
	}
	if err := st.Flush(false); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(st, make([]byte, n)); err != nil {
		t.Fatal(err)
	}
	st.BufferReader().ReleasePreviousRead()
	agg := AggregateStats()
	if agg.Buffer.Committed == 0 || agg.Queue.Committed == 0 {
		t.Errorf("AggregateStats reports no committed memory: %+v %+v", agg.Buffer, agg.Queue)
	}

	// Closing the stream gives back what it kept.
	st.Close()
	waitUntil(t, "the closed stream's slices are free", 5*time.Second, func() bool { return sess.Stats().Buffer.InUse == 0 })
}

// meminfo returns a field of /proc/meminfo in bytes.
func meminfo(t testing.TB, field string) uint64 {
	t.Helper()
	return procField(t, "/proc/meminfo", field)
}

// procField reads "Field:  N kB" from a /proc file, in bytes.
func procField(t testing.TB, path, field string) uint64 {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		name, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok || name != field {
			continue
		}
		num, _, _ := strings.Cut(strings.TrimSpace(rest), " ")
		v, err := strconv.ParseUint(num, 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		return v << 10
	}
	t.Fatalf("%s has no %s", path, field)
	return 0
}

// TestSessionsShareRegion checks that two sessions of one process to one
// server use one buffer region (one memfd, mapped once by the server), each
// with its own queue region, and that ending one returns everything it held
// while the other goes on.
func TestSessionsShareRegion(t *testing.T) {
	conf := DefaultConfig()
	ln := startEchoListener(t, conf)
	a, err := Dial("unix", ln.Addr().String(), conf)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := Dial("unix", ln.Addr().String(), conf)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if a.buf != b.buf || a.buf.Region().Path() != b.buf.Region().Path() {
		t.Fatalf("sessions use buffer regions %q and %q; want one shared region", a.buf.Region().Path(), b.buf.Region().Path())
	}
	if a.queueRegion == b.queueRegion || a.queueRegion.Path() == b.queueRegion.Path() {
		t.Fatalf("sessions share the queue region %q", a.queueRegion.Path())
	}
	sa := fpEcho(t, a, []byte("from a"))
	fpEcho(t, b, []byte("from b")).Close()
	if got := a.Stats().Buffer.Sessions; got != 2 {
		t.Errorf("Buffer.Sessions %d, want 2", got)
	}
	// The server mapped the region once, for both sessions. (The listener's
	// own sessions: other tests' server sessions may still be ending.)
	var servers []*Session
	for s := range listenerSessions(ln) {
		servers = append(servers, s)
	}
	if len(servers) != 2 || servers[0].buf != servers[1].buf {
		t.Fatalf("server has %d sessions on distinct mappings; want 2 sessions on one mapping", len(servers))
	}

	// b ends while a stream of its holds received data and messages sit on
	// its queues; a goes on, and every slice b held comes back.
	held := fpEcho(t, b, make([]byte, 100<<10))
	if _, err := held.Write(make([]byte, 300<<10)); err != nil {
		t.Fatal(err)
	}
	b.Close()
	fpEcho(t, a, make([]byte, 1<<20)).Close() // open, it could keep a slice (reuse.go)
	sa.Close()
	fpWaitFull(t, a)
}

// fpWaitFull waits until every list of sess's buffer region has all its
// slices free, and fails if that does not happen within a few seconds.
func fpWaitFull(t testing.TB, sess *Session) {
	t.Helper()
	deadline := time.Now().Add(time.Minute) // a bound for a loaded machine; done in milliseconds otherwise
	for {
		st := sess.Stats()
		full := len(st.Lists) > 0
		for _, l := range st.Lists {
			full = full && l.Free == int32(l.Slices)
		}
		if full {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("buffer region lists not back to full: %+v", st.Lists)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestGiveBackAfterQuiet checks that the data pages of large messages are
// given back once traffic stops, and that the region works as before after
// that (pages fault back in, zero-filled, and carry the data).
//
// Nothing here depends on how fast the machine is: the region is the
// test's own (no other session's traffic or idle pages in it), the pages
// the traffic committed are seen by sampling while it runs (a give-back
// between two echoes, on a machine that paused the test, does not hide
// them), and the give-back is awaited with a bound of a minute.
func TestGiveBackAfterQuiet(t *testing.T) {
	old := circulationPeriods
	circulationPeriods.GiveBack = 200 * time.Millisecond
	defer func() { circulationPeriods = old }()
	conf := DefaultConfig()
	conf.ShareMemoryPathPrefix = shmPrefix(t, "giveback")
	sess := dialEchoSession(t, conf)
	fpEcho(t, sess, []byte("hello")).Close()
	idle := sess.Stats().Buffer.Committed
	msg := make([]byte, 6<<20)
	for i := range msg {
		msg[i] = byte(i>>12) + 1
	}
	var busy atomic.Uint64
	sample := func() {
		c := sess.Stats().Buffer.Committed
		for b := busy.Load(); c > b && !busy.CompareAndSwap(b, c); b = busy.Load() {
		}
	}
	stop := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			select {
			case <-stop:
				return
			case <-time.After(time.Millisecond):
				sample()
			}
		}
	}()
	for range 4 {
		fpEcho(t, sess, msg).Close()
		sample()
	}
	close(stop)
	<-sampled
	if b := busy.Load(); b < idle+uint64(len(msg)) {
		t.Fatalf("Committed at most %d while echoing %d bytes, from %d idle: the traffic did not commit its pages", b, len(msg), idle)
	}
	stopped := time.Now()
	for {
		now := sess.Stats().Buffer.Committed
		if now <= idle+(256<<10) {
			t.Logf("committed: %.1f MiB idle, at most %.1f MiB with the traffic, %.1f MiB %v after it", float64(idle)/(1<<20), float64(busy.Load())/(1<<20), float64(now)/(1<<20), time.Since(stopped).Round(time.Millisecond))
			break
		}
		if time.Since(stopped) > time.Minute {
			t.Fatalf("Committed %d bytes a minute after traffic stopped; %d when idle", now, idle)
		}
		time.Sleep(20 * time.Millisecond)
	}
	fpEcho(t, sess, msg).Close()
	fpWaitFull(t, sess)
}

// expvarRuns numbers TestStats's expvar names.
var expvarRuns atomic.Int64

// TestStats runs known traffic and checks the counters both sides report.
func TestStats(t *testing.T) {
	var logs bytes.Buffer
	var logMu sync.Mutex
	logger := slog.New(slog.NewTextHandler(lockedWriter{&logs, &logMu}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	conf := DefaultConfig()
	conf.Logger = logger
	ln, err := Listen("unix", filepath.Join(t.TempDir(), "s.sock"), conf)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	srvSess := make(chan *Session, 1)
	go func() {
		for {
			st, err := ln.AcceptStream()
			if err != nil {
				return
			}
			select {
			case srvSess <- st.Session():
			default:
			}
			go echoStream(st)
		}
	}()
	sess, err := Dial("unix", ln.Addr().String(), conf)
	if err != nil {
		t.Fatal(err)
	}
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	st.SetDeadline(time.Now().Add(10 * time.Second))
	const small, n = 100, 20
	buf := make([]byte, small)
	for range n {
		if _, err := st.Write(buf); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(st, buf); err != nil {
			t.Fatal(err)
		}
	}
	// A Reserve larger than any slice goes as fallback data.
	big := maxSliceCap(sess.buf) + 1
	p, err := st.BufferWriter().Reserve(big)
	if err != nil {
		t.Fatal(err)
	}
	p[0] = 1
	if err := st.Flush(false); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(st, make([]byte, big)); err != nil {
		t.Fatal(err)
	}

	c := sess.Stats()
	if c.ActiveStreams != 1 {
		t.Errorf("ActiveStreams %d, want 1", c.ActiveStreams)
	}
	if c.MessagesOut != n+1 || c.BytesOut != n*small+uint64(big) {
		t.Errorf("client sent %d messages, %d bytes; want %d, %d", c.MessagesOut, c.BytesOut, n+1, n*small+big)
	}
	if c.FallbackMessagesOut != 1 || c.FallbackBytesOut != uint64(big) {
		t.Errorf("client fallback out %d messages, %d bytes; want 1, %d", c.FallbackMessagesOut, c.FallbackBytesOut, big)
	}
	if c.BytesIn != n*small+uint64(big) {
		t.Errorf("client received %d bytes, want %d", c.BytesIn, n*small+big)
	}
	if c.WakeupsSent+c.WakeupsSaved != n {
		t.Errorf("wake-ups sent %d + saved %d, want one of them per shared-memory message (%d)", c.WakeupsSent, c.WakeupsSaved, n)
	}
	if len(c.Lists) != len(conf.BufferSliceSizes) {
		t.Fatalf("Lists has %d size classes, want %d", len(c.Lists), len(conf.BufferSliceSizes))
	}
	for i, l := range c.Lists {
		if l.SliceSize != conf.BufferSliceSizes[i].Size || l.Free > int32(l.Slices) || l.Free < int32(l.Slices)-4 {
			t.Errorf("list %d: %+v", i, l)
		}
	}
	s := (<-srvSess).Stats()
	// The fallback message arrives in frames of at most 1 MiB, each
	// counted as a message received.
	perFrame := maxFallbackFrameSent - 16
	frames := uint64((big + perFrame - 1) / perFrame)
	if s.BytesIn != c.BytesOut || s.MessagesIn != n+frames {
		t.Errorf("server received %d messages, %d bytes; client sent %d in %d messages, the last in %d frames",
			s.MessagesIn, s.BytesIn, c.BytesOut, c.MessagesOut, frames)
	}
	if s.FallbackMessagesIn != frames {
		t.Errorf("server FallbackMessagesIn %d, want %d frames", s.FallbackMessagesIn, frames)
	}
	// Between two sessions of one process messages are mostly handed over
	// with no wake-up at all (deliverDirect).
	if (c.WakeupsSent > 0 && s.WakeupsReceived == 0) || s.WakeupsReceived > c.WakeupsSent {
		t.Errorf("server received %d wake-ups, client sent %d", s.WakeupsReceived, c.WakeupsSent)
	}

	agg := AggregateStats()
	if agg.MessagesOut < c.MessagesOut+s.MessagesOut || agg.ActiveStreams < 2 {
		t.Errorf("aggregate %+v does not cover both sessions", agg)
	}

	// expvar names live for the process: a unique one per run keeps the test
	// repeatable (go test -count).
	name := fmt.Sprintf("shmipc_test_stats_%d", expvarRuns.Add(1))
	PublishExpvar(name)
	var fromExpvar Stats
	if err := json.Unmarshal([]byte(expvar.Get(name).String()), &fromExpvar); err != nil {
		t.Fatal(err)
	}
	if fromExpvar.MessagesOut < c.MessagesOut {
		t.Errorf("expvar MessagesOut %d < %d", fromExpvar.MessagesOut, c.MessagesOut)
	}

	st.Close()
	sess.Close()
	// The server session sees the client go away: an Info record (how
	// clients leave a server, not a warning).
	deadline := time.Now().Add(5 * time.Second)
	for {
		logMu.Lock()
		out := logs.String()
		logMu.Unlock()
		if strings.Contains(out, "session started") && strings.Contains(out, "level=INFO msg=\"shmipc: session ended by the peer\"") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("log records missing; got:\n%s", out)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if got := sess.Stats(); got.ActiveStreams != 0 || got.Lists != nil {
		t.Errorf("closed session gauges %+v, want zero", got)
	}
}

type lockedWriter struct {
	w  io.Writer
	mu *sync.Mutex
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

package shmipc

import (
	"bytes"
	"encoding/json"
	"expvar"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

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

package shmipc

// The parent's side of the peer-kill tests: it reads every stream the
// children open and checks what it read, and how each stream ended, against
// what the children's seeds say they wrote.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// pkKey names a stream: a session and a stream number (pkSink for the
// sink).
type pkKey struct{ session, stream int }

// pkResult is what the parent read on a stream after its header, and the
// error that ended the stream (nil for io.EOF).
type pkResult struct {
	data []byte
	err  error
}

// pkParent is the parent's side: it reads every stream the children open.
type pkParent struct {
	t       *testing.T
	replies bool                       // answer every read on the sessions without a sink
	sinks   [pkChildren]sync.WaitGroup // the sink streams of each child made ready
	dead    [pkChildren]chan struct{}  // closed once the child has died

	mu       sync.Mutex
	results  map[pkKey]pkResult
	sessions map[*Session]bool // the sessions streams were accepted from
	bad      []string          // streams that could not be told apart
}

func (p *pkParent) record(k pkKey, r pkResult) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, dup := p.results[k]; dup {
		p.bad = append(p.bad, fmt.Sprintf("session %d stream %d accepted twice", k.session, k.stream))
		return
	}
	p.results[k] = r
}

// progress returns how many streams have ended, and whether every session
// a stream was accepted from has ended.
func (p *pkParent) progress() (int, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for s := range p.sessions {
		if !s.IsClosed() {
			return len(p.results) + len(p.bad), false
		}
	}
	return len(p.results) + len(p.bad), true
}

// wait waits until want streams have ended. A stream whose data was all
// lost is never accepted, so it stops waiting once every session has ended
// and no stream has ended for two seconds, and after pkReadLimit at most.
func (p *pkParent) wait(want int) {
	deadline := time.Now().Add(pkReadLimit + 5*time.Second)
	last, since := -1, time.Now()
	for time.Now().Before(deadline) {
		n, ended := p.progress()
		if n >= want {
			return
		}
		if n != last {
			last, since = n, time.Now()
		}
		if ended && time.Since(since) > 2*time.Second {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// serve reads a stream the child opened until it ends. On a sink stream
// it first makes the child's receive loop stop reading (fillSink).
func (p *pkParent) serve(st *Stream) {
	defer st.Close()
	_ = st.SetReadDeadline(time.Now().Add(pkReadLimit))
	p.mu.Lock()
	p.sessions[st.Session()] = true
	p.mu.Unlock()
	head := make([]byte, pkHeaderSize)
	if _, err := io.ReadFull(st, head); err != nil {
		p.mu.Lock()
		p.bad = append(p.bad, fmt.Sprintf("a stream ended before its header: %v", err))
		p.mu.Unlock()
		return
	}
	k := pkKey{int(binary.BigEndian.Uint32(head)), int(binary.BigEndian.Uint32(head[4:]))}
	if k.session >= pkChildren*pkSessionsPerChild || k.stream != pkSink && k.stream >= pkStreams(k.session) || k.stream == pkSink && !pkReset(k.session) {
		p.mu.Lock()
		p.bad = append(p.bad, fmt.Sprintf("a stream starts with %x, which names no stream", head))
		p.mu.Unlock()
		return
	}
	if k.stream == pkSink {
		c := k.session / pkSessionsPerChild
		err := p.fillSink(st)
		p.sinks[c].Done()
		if err != nil {
			p.record(k, pkResult{err: err})
			return
		}
		// Read the rest once the child is dead: a reader waiting here
		// would keep the readers of the session's data stream from
		// polling.
		select {
		case <-p.dead[c]:
		case <-time.After(pkReadLimit):
		}
	}
	var r pkResult
	if p.replies && !pkReset(k.session) {
		r = pkReadReplying(st)
	} else {
		r.data, r.err = io.ReadAll(st)
	}
	p.record(k, r)
}

// pkReadReplying reads st to its end, and answers each read with 8 bytes
// the child never reads.
func pkReadReplying(st *Stream) pkResult {
	var r pkResult
	buf := make([]byte, 64<<10)
	for {
		n, err := st.Read(buf)
		r.data = append(r.data, buf[:n]...)
		if err == io.EOF {
			return r
		}
		if err != nil {
			r.err = err
			return r
		}
		_, _ = st.Write(buf[:8])
	}
}

// fillSink sends on a sink stream a first fallback frame, which the child's
// receive loop takes and hands to the stream, whose reader never reads it,
// then waits for the child to say it arrived, so that what follows does not
// go in the same read, and sends pkLater: the child's receive loop stops at
// the first of these frames, for the stream holds more than pkChildHold.
func (p *pkParent) fillSink(st *Stream) error {
	first, err := st.BufferWriter().Reserve(pkPastSlices())
	if err != nil {
		return fmt.Errorf("sink: reserve the first frame: %w", err)
	}
	clear(first)
	if err := st.Flush(false); err != nil {
		return fmt.Errorf("sink: send the first frame: %w", err)
	}
	ack := make([]byte, 1)
	if _, err := io.ReadFull(st, ack); err != nil || ack[0] != pkAck {
		return fmt.Errorf("sink: the child's acknowledgement: %q, %v", ack, err)
	}
	for _, n := range pkLater {
		if _, err := st.Write(make([]byte, n)); err != nil {
			return fmt.Errorf("sink: send %d bytes: %w", n, err)
		}
	}
	return nil
}

// check compares what each stream read and how it ended with what the
// child did, and counts how the sessions ended. p.mu is held.
func (p *pkParent) check(seed uint64) {
	t := p.t
	bad := slices.Clone(p.bad)
	streams := 0
	ends := make(map[string]int) // how the sessions ended, seen on a stream left open or the sink
	for i := range pkChildren * pkSessionsPerChild {
		how := ""
		for k := range pkStreams(i) {
			streams++
			r, ok := p.results[pkKey{i, k}]
			if !ok {
				bad = append(bad, fmt.Sprintf("session %d stream %d: never accepted (its data was lost)", i, k))
				continue
			}
			if msg := pkCompare(pkContent(seed, i, k)[pkHeaderSize:], r.data); msg != "" {
				bad = append(bad, fmt.Sprintf("session %d stream %d: %s, then %v", i, k, msg, r.err))
				continue
			}
			if pkClosed(i, k) {
				switch {
				case errors.Is(r.err, os.ErrDeadlineExceeded):
					bad = append(bad, fmt.Sprintf("session %d stream %d (closed by the child): read all, then no end within %v", i, k, pkReadLimit))
				case r.err != nil:
					bad = append(bad, fmt.Sprintf("session %d stream %d (closed by the child): read all, then %v, want io.EOF", i, k, r.err))
				}
				continue
			}
			if msg := pkSessionEnd(r.err); msg != "" {
				bad = append(bad, fmt.Sprintf("session %d stream %d (left open): read all, then %s", i, k, msg))
				continue
			}
			how = pkHow(r.err)
		}
		if pkReset(i) {
			streams++
			r, ok := p.results[pkKey{i, pkSink}]
			switch {
			case !ok:
				bad = append(bad, fmt.Sprintf("session %d: sink stream never accepted", i))
			case len(r.data) > 0:
				bad = append(bad, fmt.Sprintf("session %d sink stream: %d bytes after the acknowledgement, want none", i, len(r.data)))
			default:
				if msg := pkSessionEnd(r.err); msg != "" {
					bad = append(bad, fmt.Sprintf("session %d sink stream: %s", i, msg))
				} else {
					how = pkHow(r.err)
				}
			}
		}
		if how == "" {
			continue // every stream closed, or one that ended wrong
		}
		ends[how]++
		if !p.replies && pkReset(i) != (how == "ECONNRESET") {
			t.Logf("session %d ended by %s, which the test did not arrange", i, how)
		}
	}
	t.Logf("%d streams; the sessions with a stream left open ended by %v", streams, ends)
	if len(bad) > 0 {
		t.Errorf("%d of %d streams were not read as the child wrote them (first 10):\n%s",
			len(bad), streams, strings.Join(bad[:min(len(bad), 10)], "\n"))
	}
	if len(bad) == 0 && !p.replies && (ends["ECONNRESET"] == 0 || ends["io.EOF"] == 0) {
		t.Errorf("sessions ended by %v: the test is meant to take both ends of a dead peer's socket, ECONNRESET and io.EOF", ends)
	}
}

// pkHow says how the session whose stream ended with err ended.
func pkHow(err error) string {
	if strings.Contains(err.Error(), syscall.ECONNRESET.Error()) {
		return "ECONNRESET"
	}
	return "io.EOF"
}

// pkCompare describes how got differs from want, or returns "".
func pkCompare(want, got []byte) string {
	if bytes.Equal(want, got) {
		return ""
	}
	i := 0
	for i < len(want) && i < len(got) && want[i] == got[i] {
		i++
	}
	return fmt.Sprintf("read %d bytes of %d after the header, the first %d right", len(got), len(want), i)
}

// pkSessionEnd describes what is wrong with err as the end of a stream left
// open by a peer that died, or returns "".
func pkSessionEnd(err error) string {
	switch {
	case err == nil:
		return "io.EOF, want the session's error (wrapping ErrSessionClosed and ErrPeerClosed)"
	case errors.Is(err, os.ErrDeadlineExceeded):
		return fmt.Sprintf("no end within %v: %v", pkReadLimit, err)
	case errors.Is(err, io.EOF):
		return fmt.Sprintf("%v, which matches io.EOF: the stream would look cleanly ended", err)
	case !clPeerGone(err):
		return fmt.Sprintf("%v, want an error wrapping ErrSessionClosed and ErrPeerClosed", err)
	}
	return ""
}

package shmipc

import (
	"bytes"
	"context"
	"errors"
	"io"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cloudwego/netpoll"
)

func mzReadAll(t *testing.T, st *Stream, n int) []byte {
	t.Helper()
	st.SetReadDeadline(time.Now().Add(mzTimeout))
	b := make([]byte, n)
	if _, err := io.ReadFull(st, b); err != nil {
		t.Fatalf("reading %d bytes: %v (got %q)", n, err, b)
	}
	return b
}

// mzNothingMore checks that nothing more arrives on st.
func mzNothingMore(t *testing.T, st *Stream, what string) {
	t.Helper()
	time.Sleep(50 * time.Millisecond)
	if n := st.BufferReader().Len(); n != 0 {
		p, _ := st.BufferReader().Peek(n)
		t.Errorf("%s: %d unexpected bytes arrived: %q", what, n, p)
	}
}

// TestMisuseBufferInterleave mixes Reserve, WriteBytes, Write, Flush and
// the netpoll writer on one stream, from one goroutine, and checks what the
// peer receives.
func TestMisuseBufferInterleave(t *testing.T) {
	mzModes(t, func(t *testing.T) {
		_, cli, srv := mzPair(t, nil)
		bw := cli.BufferWriter()
		// Reserve, then Write: the reserved bytes go first.
		b, err := bw.Reserve(3)
		if err != nil {
			t.Fatal(err)
		}
		copy(b, "abc")
		if _, err := cli.Write([]byte("def")); err != nil {
			t.Fatal(err)
		}
		if got := mzReadAll(t, srv, 6); string(got) != "abcdef" {
			t.Errorf("Reserve+Write: %q", got)
		}
		// Flush with nothing, Reserve(0)+Flush, empty Write: nothing arrives.
		for i, f := range []func() error{
			func() error { return cli.Flush(false) },
			func() error { _, err := bw.Reserve(0); return errors.Join(err, cli.Flush(true)) },
			func() error { _, err := cli.Write(nil); return err },
			func() error { _, err := bw.WriteBytes(nil); return errors.Join(err, cli.Flush(false)) },
			func() error {
				_, err := cli.NetpollWriter().Malloc(0)
				return errors.Join(err, cli.NetpollWriter().Flush())
			},
		} {
			if err := f(); err != nil {
				t.Errorf("empty op %d: %v", i, err)
			}
		}
		mzNothingMore(t, srv, "empty flushes")
		// WriteBytes + Reserve + WriteString + WriteByte + netpoll, one Flush.
		bw.WriteBytes([]byte("1"))
		r, _ := bw.Reserve(2)
		copy(r, "23")
		bw.WriteString("45")
		bw.WriteByte('6')
		nw := cli.NetpollWriter()
		m, _ := nw.Malloc(2)
		copy(m, "78")
		nw.WriteBinary([]byte("9"))
		if bw.Len() != 9 || nw.MallocLen() != 9 {
			t.Errorf("Len %d MallocLen %d, want 9", bw.Len(), nw.MallocLen())
		}
		if err := cli.Flush(false); err != nil {
			t.Fatal(err)
		}
		if got := mzReadAll(t, srv, 9); string(got) != "123456789" {
			t.Errorf("mixed writers: %q", got)
		}
		// MallocAck shrinks; beyond the size is an error; WriteDirect bounds.
		m, _ = nw.Malloc(10)
		copy(m, "ABCDEFGHIJ")
		if err := nw.MallocAck(11); err == nil {
			t.Errorf("MallocAck beyond the size: nil error")
		}
		if err := nw.MallocAck(-1); err == nil {
			t.Errorf("MallocAck(-1): nil error")
		}
		if err := nw.MallocAck(4); err != nil {
			t.Fatal(err)
		}
		if err := nw.WriteDirect([]byte("x"), 5); err == nil {
			t.Errorf("WriteDirect remainCap beyond size: nil error")
		}
		if err := nw.WriteDirect([]byte("xy"), 2); err != nil {
			t.Fatal(err)
		}
		if err := nw.Flush(); err != nil {
			t.Fatal(err)
		}
		if got := mzReadAll(t, srv, 6); string(got) != "ABxyCD" {
			t.Errorf("Malloc/MallocAck/WriteDirect: %q, want ABxyCD", got)
		}
		if err := nw.Append(cli.NetpollWriter()); err == nil {
			t.Errorf("Append of the stream's own writer: nil error")
		}
		// A message built and Close: Flush after Close fails, nothing arrives.
		bw.WriteString("never")
		cli.Close()
		mzWantErr(t, "Flush of a message built before Close", cli.Flush(false), ErrStreamClosed)
		srv.SetReadDeadline(time.Now().Add(mzTimeout))
		if n, err := srv.Read(make([]byte, 10)); err != io.EOF {
			t.Errorf("peer read after a Close that dropped a built message: n=%d err=%v, want EOF", n, err)
		}
	})
}

// TestMisuseReaderBoundaries: Peek/ReadBytes/Discard/Skip/Next/Slice at and
// beyond the data present when the peer closes.
func TestMisuseReaderBoundaries(t *testing.T) {
	mzModes(t, func(t *testing.T) {
		_, cli, srv := mzPair(t, nil)
		cli.Write([]byte("hello"))
		cli.Write([]byte(" world\npartial"))
		cli.Close()
		br, nr := srv.BufferReader(), srv.NetpollReader()
		srv.SetReadDeadline(time.Now().Add(mzTimeout))
		if _, err := br.ReadBytes(-1); err == nil {
			t.Errorf("ReadBytes(-1): nil error")
		}
		if _, err := nr.Next(-1); err == nil {
			t.Errorf("Next(-1): nil error")
		}
		if _, err := br.Discard(-1); err == nil {
			t.Errorf("Discard(-1): nil error")
		}
		if _, err := nr.ReadBinary(-1); err == nil {
			t.Errorf("ReadBinary(-1): nil error")
		}
		p, err := br.Peek(8) // spans the two messages: a copy
		if err != nil || string(p) != "hello wo" {
			t.Fatalf("Peek(8): %q %v", p, err)
		}
		q, err := br.Peek(2)
		if err != nil || string(q) != "he" {
			t.Fatalf("Peek(2): %q %v", q, err)
		}
		if string(p) != "hello wo" {
			t.Errorf("a second Peek changed the first Peek's bytes: %q", p)
		}
		line, err := nr.Until('\n')
		if err != nil || string(line) != "hello world\n" {
			t.Fatalf("Until: %q %v", line, err)
		}
		if string(p) != "hello wo" {
			t.Errorf("Until changed the bytes of an earlier Peek before any release: %q", p)
		}
		// More than is left, stream ended: ErrUnexpectedEOF, nothing consumed.
		if _, err := br.ReadBytes(100); err != io.ErrUnexpectedEOF {
			t.Errorf("ReadBytes beyond the end: %v, want io.ErrUnexpectedEOF", err)
		}
		if err := nr.Skip(100); err != io.ErrUnexpectedEOF {
			t.Errorf("Skip beyond the end: %v", err)
		}
		if br.Len() != 7 {
			t.Errorf("Len after failed reads: %d, want 7", br.Len())
		}
		br.ReleasePreviousRead()
		br.ReleasePreviousRead()
		if _, err := nr.Slice(100); err != io.ErrUnexpectedEOF {
			t.Errorf("Slice beyond the end: %v", err)
		}
		rest, err := nr.Until('\n')
		if string(rest) != "partial" || err != io.EOF {
			t.Errorf("Until at the end: %q %v, want \"partial\" EOF", rest, err)
		}
		if n, err := br.Discard(5); n != 0 || err != io.EOF {
			t.Errorf("Discard at the end: %d %v", n, err)
		}
		if _, err := br.ReadByte(); err != io.EOF {
			t.Errorf("ReadByte at the end: %v", err)
		}
	})
}

// TestMisuseAppendLinkBuffer: Append of a LinkBuffer with readable and
// unflushed bytes, and of another stream's writer.
func TestMisuseAppendLinkBuffer(t *testing.T) {
	mzModes(t, func(t *testing.T) {
		p, cli, srv := mzPair(t, nil)
		lb := netpoll.NewLinkBuffer(16)
		lb.WriteString("abc")
		lb.Flush()
		lb.WriteString("def") // not flushed
		nw := cli.NetpollWriter()
		if err := nw.Append(lb); err != nil {
			t.Fatal(err)
		}
		other, err := p.client.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		defer other.Close()
		ow := other.NetpollWriter()
		ow.WriteString("ghi")
		if err := nw.Append(ow); err != nil {
			t.Fatal(err)
		}
		if ow.MallocLen() != 0 {
			t.Errorf("the other writer still holds %d bytes", ow.MallocLen())
		}
		// Other stream closed with a message pending: Append must not panic.
		ow.WriteString("jkl")
		other.Close()
		err, _ = mzCall(t, "Append of a closed stream's writer", func() error { return nw.Append(ow) })
		t.Logf("Append of a closed stream's writer: %v", err)
		if err := nw.Flush(); err != nil {
			t.Fatal(err)
		}
		got := mzReadAll(t, srv, 9)
		if !bytes.Equal(got, []byte("abcdefghi")) {
			t.Errorf("got %q", got)
		}
		mzNothingMore(t, srv, "after Append of a closed stream's writer")
	})
}

func mzManager(t *testing.T, addr string, tweak func(*SessionManagerConfig)) *SessionManager {
	t.Helper()
	conf := SessionManagerConfig{Network: "unix", Address: addr, SessionNum: 2,
		MinReconnectBackoff: 5 * time.Millisecond, MaxReconnectBackoff: 50 * time.Millisecond}
	if tweak != nil {
		tweak(&conf)
	}
	m, err := NewSessionManager(conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// TestMisuseManagerPutBackTwice: a stream put back twice must not be handed
// out twice.
func TestMisuseManagerPutBackTwice(t *testing.T) {
	ln := startEchoListener(t, nil)
	m := mzManager(t, ln.Addr().String(), nil)
	st, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	st.SetDeadline(time.Now().Add(mzTimeout))
	if _, err := st.Write([]byte("ab")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(st, make([]byte, 2)); err != nil {
		t.Fatal(err)
	}
	// Twice from two goroutines at once, then once more.
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() { defer wg.Done(); m.PutBack(st) }()
	}
	wg.Wait()
	m.PutBack(st)
	if n := m.IdleStreams(); n != 1 {
		t.Errorf("IdleStreams after putting one stream back thrice: %d", n)
	}
	a, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	b, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	if a == b {
		t.Fatalf("the same stream handed out twice")
	}
	// PutBack of a closed stream, a stream with unread data, a stream with
	// an unflushed message, and a stream of another manager.
	a.Close()
	m.PutBack(a)
	if m.IdleStreams() != 0 {
		t.Errorf("a closed stream was pooled")
	}
	b.SetDeadline(time.Now().Add(mzTimeout))
	b.Write([]byte("zz"))
	waitUntil(t, "the echo arrives", mzTimeout, func() bool { return b.BufferReader().Len() == 2 })
	m.PutBack(b)
	if m.IdleStreams() != 0 {
		t.Errorf("a stream with unread data was pooled")
	}
	if _, err := b.Write([]byte("x")); !errors.Is(err, ErrStreamClosed) {
		t.Errorf("stream with unread data put back: Write %v, want ErrStreamClosed (it must be closed)", err)
	}
	c, _ := m.GetStream()
	c.BufferWriter().WriteString("pending")
	m.PutBack(c)
	if m.IdleStreams() != 0 {
		t.Errorf("a stream with an unflushed message was pooled")
	}
	m2 := mzManager(t, ln.Addr().String(), nil)
	d, err := m2.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	m.PutBack(d)
	if m.IdleStreams() != 0 || m2.IdleStreams() != 0 {
		t.Errorf("a stream of another manager was pooled: %d %d", m.IdleStreams(), m2.IdleStreams())
	}
	m2.PutBack(d) // its own manager, after the other closed it
	if m2.IdleStreams() != 0 {
		t.Errorf("a closed stream was pooled by its own manager")
	}
}

// TestMisuseManagerCloseWhileWaiting: Close ends GetStreamContext and
// DialContext calls waiting for a session, and leaves no goroutine behind.
func TestMisuseManagerCloseWhileWaiting(t *testing.T) {
	base := runtime.NumGoroutine()
	func() {
		sock := sockPath(t)
		ln, err := Listen("unix", sock, nil)
		if err != nil {
			t.Fatal(err)
		}
		go serveStreams(ln, echoStream)
		m, err := NewSessionManager(SessionManagerConfig{Network: "unix", Address: sock, SessionNum: 2,
			MinReconnectBackoff: 5 * time.Millisecond, MaxReconnectBackoff: 20 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		out, err := m.GetStream()
		if err != nil {
			t.Fatal(err)
		}
		ln.CloseAll() // every session dies; re-dials fail
		waitUntil(t, "the sessions die", mzTimeout, func() bool { return len(m.Sessions()) == 0 })
		_, err = m.GetStream()
		mzWantErr(t, "GetStream with no session", err, ErrNoHealthySession)
		errs := make(chan error, 2)
		go func() { _, err := m.GetStreamContext(context.Background()); errs <- err }()
		go func() { _, err := m.DialContext(context.Background(), "x"); errs <- err }()
		waitBlocked(t, "(*SessionManager).GetStreamContext", 1)
		waitBlocked(t, "(*SessionManager).DialContext", 1)
		mzCall(t, "SessionManager.Close", m.Close)
		for range 2 {
			select {
			case err := <-errs:
				mzWantErr(t, "waiting call after Close", err, ErrSessionManagerClosed)
			case <-time.After(mzTimeout):
				t.Fatal("HANG: a waiting GetStreamContext/DialContext did not end on Close")
			}
		}
		_, err = out.Read(make([]byte, 1))
		mzWantErr(t, "Read of a stream of a dead session", err, ErrSessionClosed)
		out.Close()
		// ctx cancellation while waiting.
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		_, err = m.GetStreamContext(ctx)
		mzWantErr(t, "GetStreamContext after Close", err, ErrSessionManagerClosed)
	}()
	mzGoroutines(t, base, 2)
}

// TestMisuseManagerCloseWithStreamsOut: Close while streams are handed out
// and in use on other goroutines.
func TestMisuseManagerCloseWithStreamsOut(t *testing.T) {
	ln := startEchoListener(t, nil)
	base := runtime.NumGoroutine()
	m, err := NewSessionManager(SessionManagerConfig{Network: "unix", Address: ln.Addr().String(), SessionNum: 3})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var rounds atomic.Int64
	for i := range 12 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				st, err := m.GetStream()
				if err != nil {
					if !errors.Is(err, ErrSessionManagerClosed) && !errors.Is(err, ErrNoHealthySession) {
						t.Errorf("GetStream: %v", err)
					}
					return
				}
				st.SetDeadline(time.Now().Add(mzTimeout))
				msg := make([]byte, 100*(i+1))
				if _, err := st.Write(msg); err != nil {
					if !mzAcceptable(err) {
						t.Errorf("Write: %v", err)
					}
					st.Close()
					continue
				}
				if _, err := io.ReadFull(st, msg); err != nil {
					if !mzAcceptable(err) {
						t.Errorf("Read: %v", err)
					}
					st.Close()
					continue
				}
				m.PutBack(st)
				rounds.Add(1)
			}
		}()
	}
	// Close once the users are under way: 200 ms of traffic, or with
	// -short 500 round trips.
	if testing.Short() {
		waitUntil(t, "500 round trips", mzTimeout, func() bool { return rounds.Load() >= 500 })
	} else {
		time.Sleep(200 * time.Millisecond)
	}
	mzCall(t, "Close", m.Close)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(2 * mzTimeout):
		t.Fatal("HANG: users of the manager did not finish after Close")
	}
	mzGoroutines(t, base, 2)
}

// TestMisuseManagerCancelledContext: DialContext and GetStreamContext with a
// context that is already done. net.Dialer.DialContext fails at once with
// the context's error; here a healthy manager hands out a stream anyway.
func TestMisuseManagerCancelledContext(t *testing.T) {
	ln := startEchoListener(t, nil)
	m := mzManager(t, ln.Addr().String(), nil)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	c, err := m.DialContext(ctx, "x")
	if err == nil {
		c.Close()
		t.Errorf("DialContext with a cancelled context: a stream and nil error, want ctx.Err() (as net.Dialer)")
	}
	st, err := m.GetStreamContext(ctx)
	if err == nil {
		st.Close()
		t.Logf("NOTE GetStreamContext with a cancelled context: a stream and nil error")
	}
}

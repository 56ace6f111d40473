package shmipc

import (
	"bytes"
	"io"
	"testing"
	"time"
)

// mzBlocked runs f in a goroutine and returns a channel with its error and
// how long it took.
type mzResult struct {
	err  error
	took time.Duration
	n    int
}

func mzBlocked(f func() (int, error)) <-chan mzResult {
	ch := make(chan mzResult, 1)
	go func() {
		start := time.Now()
		n, err := f()
		ch <- mzResult{err, time.Since(start), n}
	}()
	return ch
}

// mzReaders is every blocking read of a stream, for the deadline tests.
func mzReaders(st *Stream) map[string]func() (int, error) {
	br, nr := st.BufferReader(), st.NetpollReader()
	return map[string]func() (int, error){
		"Read":      func() (int, error) { return st.Read(make([]byte, 10)) },
		"ReadBytes": func() (int, error) { p, err := br.ReadBytes(10); return len(p), err },
		"Peek":      func() (int, error) { p, err := br.Peek(10); return len(p), err },
		"Discard":   func() (int, error) { return br.Discard(10) },
		"ReadByte":  func() (int, error) { _, err := br.ReadByte(); return 0, err },
		"np.Next":   func() (int, error) { p, err := nr.Next(10); return len(p), err },
		"np.Until":  func() (int, error) { p, err := nr.Until('\n'); return len(p), err },
		"np.Skip":   func() (int, error) { return 0, nr.Skip(10) },
		"np.Slice":  func() (int, error) { _, err := nr.Slice(10); return 0, err },
	}
}

// TestMisuseDeadlinePast: a read deadline in the past fails every read at
// once with a deadline error, and a zero deadline makes reads work again.
func TestMisuseDeadlinePast(t *testing.T) {
	mzModes(t, func(t *testing.T) {
		_, cli, srv := mzPair(t, nil)
		srv.SetReadDeadline(time.Now().Add(-time.Hour))
		for name, f := range mzReaders(srv) {
			r := <-mzBlocked(f)
			mzTimeoutErr(t, name+" with past deadline", r.err)
			if r.took > time.Second {
				t.Errorf("%s with past deadline took %v", name, r.took)
			}
		}
		// Data present: net.Conn semantics say the read fails even so
		// ("a deadline ... fails I/O"); accept either, but it must not hang.
		srv.SetReadDeadline(time.Time{})
		if _, err := cli.Write([]byte("hello\n")); err != nil {
			t.Fatal(err)
		}
		srv.SetReadDeadline(time.Now().Add(mzTimeout))
		got := make([]byte, 6)
		if _, err := io.ReadFull(srv, got); err != nil || string(got) != "hello\n" {
			t.Fatalf("after resetting the deadline: %q %v", got, err)
		}
		// Write deadline in the past.
		cli.SetWriteDeadline(time.Now().Add(-time.Second))
		n, err := cli.Write([]byte("x"))
		mzTimeoutErr(t, "Write with past deadline", err)
		if n != 0 {
			t.Errorf("Write with past deadline: n=%d", n)
		}
		if _, err := cli.BufferWriter().WriteBytes([]byte("abc")); err != nil {
			t.Logf("WriteBytes with past deadline: %v", err)
		}
		mzTimeoutErr(t, "Flush with past deadline", cli.Flush(false))
		if l := cli.BufferWriter().Len(); l != 0 {
			t.Errorf("after a failed Flush the message is %d bytes, want discarded", l)
		}
		nw := cli.NetpollWriter()
		nw.WriteString("abc")
		mzTimeoutErr(t, "np.Flush with past deadline", nw.Flush())
		cli.SetWriteDeadline(time.Time{})
		if _, err := cli.Write([]byte("ok")); err != nil {
			t.Fatalf("Write after clearing the deadline: %v", err)
		}
		got = make([]byte, 2)
		if _, err := io.ReadFull(srv, got); err != nil || string(got) != "ok" {
			t.Fatalf("read %q %v, want \"ok\" (failed messages must not arrive)", got, err)
		}
	})
}

// TestMisuseDeadlineChangedWhileBlocked: a read that is blocked must follow
// deadline changes: set from none to soon, moved further, cleared.
func TestMisuseDeadlineChangedWhileBlocked(t *testing.T) {
	waitsInParallel(t)
	mzModes(t, func(t *testing.T) {
		_, cli, srv := mzPair(t, func(c *Config) {})
		for name, f := range mzReaders(srv) {
			if testing.Short() && name != "Read" && name != "np.Until" {
				continue // -short: a reader of each package
			}
			// none -> soon
			srv.SetReadDeadline(time.Time{})
			ch := mzBlocked(f)
			time.Sleep(30 * time.Millisecond)
			srv.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
			select {
			case r := <-ch:
				mzTimeoutErr(t, name+" after deadline set while blocked", r.err)
			case <-time.After(mzTimeout):
				t.Errorf("%s: HANG: a deadline set while blocked did not end the read", name)
				srv.SetReadDeadline(time.Now()) // try to unblock
				<-ch
			}
			// soon -> later: must not time out at the old deadline. It is
			// watched for three times the old deadline (100 ms, 50 ms with
			// -short): a read that kept it would have ended by then.
			old := shortOr(100*time.Millisecond, 50*time.Millisecond)
			srv.SetReadDeadline(time.Now().Add(old))
			ch = mzBlocked(f)
			time.Sleep(20 * time.Millisecond)
			srv.SetReadDeadline(time.Now().Add(time.Hour))
			select {
			case r := <-ch:
				t.Errorf("%s: returned %v after %v although the deadline was extended", name, r.err, r.took)
			case <-time.After(3 * old):
			}
			// cleared: still blocked (watched for 150 ms, 75 ms with
			// -short: a read that took clearing for a deadline passed
			// would end at once); then data ends it.
			srv.SetReadDeadline(time.Time{})
			select {
			case r := <-ch:
				t.Errorf("%s: returned %v after the deadline was cleared", name, r.err)
			case <-time.After(shortOr(150*time.Millisecond, 75*time.Millisecond)):
			}
			if _, err := cli.Write([]byte("0123456789\n")); err != nil {
				t.Fatal(err)
			}
			select {
			case r := <-ch:
				if r.err != nil {
					t.Errorf("%s: %v after data arrived", name, r.err)
				}
			case <-time.After(mzTimeout):
				t.Fatalf("%s: HANG: data did not end the read", name)
			}
			srv.BufferReader().Discard(srv.BufferReader().Len())
			srv.BufferReader().ReleasePreviousRead()
		}
	})
}

// TestMisuseDeadlineAfterWriteReader: the reader polls for a reply right
// after it sent (awaiting): a deadline set then must end the poll.
func TestMisuseDeadlineWhilePolling(t *testing.T) {
	waitsInParallel(t)
	mzModes(t, func(t *testing.T) {
		_, cli, srv := mzPair(t, nil)
		// Each round waits out a 20 ms deadline; with -short, 8 rounds
		// (each of the four delays before the deadline is set, twice).
		for i := range shortOr(20, 8) {
			if _, err := cli.Write([]byte("ping")); err != nil {
				t.Fatal(err)
			}
			cli.SetReadDeadline(time.Time{})
			ch := mzBlocked(func() (int, error) { return cli.Read(make([]byte, 4)) })
			time.Sleep(time.Duration(i%4) * time.Millisecond)
			cli.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
			select {
			case r := <-ch:
				mzTimeoutErr(t, "Read while polling", r.err)
			case <-time.After(mzTimeout):
				t.Fatalf("round %d: HANG: a deadline set while the reader polled did not end the read", i)
			}
			srv.SetReadDeadline(time.Now().Add(mzTimeout))
			if _, err := io.ReadFull(srv, make([]byte, 4)); err != nil {
				t.Fatal(err)
			}
		}
	})
}

// TestMisuseWriteDeadlineWhileBlocked: a Write blocked for room (the peer
// does not read) ends when a write deadline is set meanwhile, and Close
// ends it too.
func TestMisuseWriteDeadlineWhileBlocked(t *testing.T) {
	mzModes(t, func(t *testing.T) {
		_, cli, _ := mzPair(t, func(c *Config) {
			c.ShareMemoryBufferCap = 1 << 20
			c.BufferSliceSizes = ReferenceSliceSizes()
			c.QueueCap = 64
			c.WriteSpaceTimeout = time.Minute
		})
		msg := bytes.Repeat([]byte{1}, 4096)
		// Fill until a write blocks: it pauses for room in spaceWait.
		var ch <-chan mzResult
		me := goroutineID()
	fill:
		for i := 0; ; i++ {
			ch = mzBlocked(func() (int, error) { return cli.Write(msg) })
			for {
				select {
				case r := <-ch:
					if r.err != nil {
						t.Fatalf("write %d: %v", i, r.err)
					}
					continue fill
				case <-time.After(time.Millisecond):
				}
				if blockedIn("(*spaceWait).pause", me) > 0 {
					break fill
				}
			}
		}
		cli.SetWriteDeadline(time.Now().Add(50 * time.Millisecond))
		select {
		case r := <-ch:
			mzTimeoutErr(t, "blocked Write after SetWriteDeadline", r.err)
		case <-time.After(mzTimeout):
			t.Fatalf("HANG: a blocked Write ignored a write deadline set meanwhile")
		}
		cli.SetWriteDeadline(time.Time{})
		ch = mzBlocked(func() (int, error) { return cli.Write(msg) })
		waitBlocked(t, "(*spaceWait).pause", 1)
		cli.Close()
		select {
		case r := <-ch:
			mzWantErr(t, "blocked Write after Close", r.err, ErrStreamClosed)
		case <-time.After(mzTimeout):
			t.Fatalf("HANG: a blocked Write did not end on Close")
		}
	})
}

// TestMisuseReadTimeoutsLoseNothing: a reader whose reads keep timing out
// (short deadlines) while a writer sends: every byte must arrive once, in
// order, and a timed-out Read must not have its buffer written afterwards.
func TestMisuseReadTimeoutsLoseNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: rounds of timeouts kept up for seconds")
	}
	mzModes(t, func(t *testing.T) {
		_, cli, srv := mzPair(t, nil)
		const total = 300000
		go func() {
			seq := 0
			for seq < total {
				n := min(1+seq%700, total-seq)
				msg := make([]byte, n)
				for i := range msg {
					msg[i] = byte((seq + i) % 253)
				}
				if _, err := cli.Write(msg); err != nil {
					t.Errorf("Write: %v", err)
					return
				}
				seq += n
				if seq%7 == 0 {
					time.Sleep(100 * time.Microsecond)
				}
			}
		}()
		got := 0
		timeouts := 0
		buf := make([]byte, 1024)
		deadlineEnd := time.Now().Add(3 * mzTimeout)
		for got < total {
			if time.Now().After(deadlineEnd) {
				t.Fatalf("HANG: read %d of %d", got, total)
			}
			srv.SetReadDeadline(time.Now().Add(time.Duration(got%3) * 50 * time.Microsecond))
			n, err := srv.Read(buf)
			if err != nil {
				mzTimeoutErr(t, "Read", err)
				timeouts++
				if n != 0 {
					t.Fatalf("Read returned n=%d with a timeout", n)
				}
				for i := range buf {
					buf[i] = 0xff // must not be overwritten later
				}
				continue
			}
			for i := range n {
				if buf[i] != byte((got+i)%253) {
					t.Fatalf("byte %d: %d, want %d (timeouts so far %d)", got+i, buf[i], byte((got+i)%253), timeouts)
				}
			}
			got += n
		}
		t.Logf("%d timeouts", timeouts)
	})
}

// Deadlines on a stream, and every blocked reader woken by whatever ends its
// read.

// TestStreamDeadlines checks read deadlines in the past and the near future,
// that clearing one makes reads work again, that setting one wakes a blocked
// Read, and write deadlines.
func TestStreamDeadlines(t *testing.T) {
	forEachStreamMode(t, func(t *testing.T, mode MemMapType) {
		p := newStreamTestPair(t, mode, nil)
		st := openStreamT(t, p.client)
		writeAll(t, st, [][]byte{[]byte("hi")})
		srv := acceptStreamT(t, p.server)
		if _, err := io.ReadFull(srv, make([]byte, 2)); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 16)
		br := st.BufferReader()

		st.SetReadDeadline(time.Now().Add(-time.Second))
		_, err := st.Read(buf)
		requireTimeout(t, err, "Read with a deadline in the past")
		_, err = br.ReadBytes(1)
		requireTimeout(t, err, "ReadBytes with a deadline in the past")
		_, err = br.Peek(1)
		requireTimeout(t, err, "Peek with a deadline in the past")
		_, err = br.ReadByte()
		requireTimeout(t, err, "ReadByte with a deadline in the past")

		deadline := time.Now().Add(50 * time.Millisecond)
		st.SetReadDeadline(deadline)
		start := time.Now()
		_, err = st.Read(buf)
		requireTimeout(t, err, "Read with a deadline 50ms ahead")
		if time.Now().Before(deadline) {
			t.Fatalf("Read timed out before its deadline")
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Fatalf("Read with a 50ms deadline took %v", d)
		}

		st.SetReadDeadline(time.Time{})
		writeAll(t, srv, [][]byte{[]byte("after")})
		got := make([]byte, 5)
		if _, err := io.ReadFull(st, got); err != nil || string(got) != "after" {
			t.Fatalf("read after clearing the deadline: %q, %v", got, err)
		}

		blocked := make(chan error, 1)
		go func() {
			_, err := st.Read(buf)
			blocked <- err
		}()
		time.Sleep(20 * time.Millisecond) // let the Read block
		st.SetReadDeadline(time.Now())
		requireTimeout(t, waitResult(t, blocked, "Read after SetReadDeadline(now)"), "blocked Read woken by SetReadDeadline(now)")

		st.SetReadDeadline(time.Time{})
		writeAll(t, srv, [][]byte{[]byte("again")})
		if _, err := io.ReadFull(st, got); err != nil || string(got) != "again" {
			t.Fatalf("read after clearing the deadline again: %q, %v", got, err)
		}

		st.SetWriteDeadline(time.Now().Add(-time.Second))
		_, err = st.Write([]byte("late"))
		requireTimeout(t, err, "Write with a deadline in the past")
		st.SetWriteDeadline(time.Time{})
		writeAll(t, st, [][]byte{[]byte("ok")})
		if _, err := io.ReadFull(srv, got[:2]); err != nil || string(got[:2]) != "ok" {
			t.Fatalf("server read %q, %v after the write deadline was cleared; want only \"ok\"", got[:2], err)
		}
	})
}

// TestStreamWakesEveryBlockedReader: with several goroutines blocked
// reading one stream, whatever ends the reads ends all of them, as
// net.Conn promises ("any blocked Read or Write operations will be
// unblocked"; a read deadline applies to "any currently-blocked Read
// call"): Close, a deadline set in the past, the peer closing the stream,
// the session closing. Before, the wake-up went to one of them, and the
// others stayed blocked.
func TestStreamWakesEveryBlockedReader(t *testing.T) {
	for _, tc := range []struct {
		name   string
		end    func(cli, srv *Stream, p *streamTestPair)
		server bool // the readers read the server's end
	}{
		{"Close", func(cli, _ *Stream, _ *streamTestPair) { cli.Close() }, false},
		{"SetReadDeadline", func(cli, _ *Stream, _ *streamTestPair) { cli.SetReadDeadline(time.Now()) }, false},
		{"peer closes the stream", func(_, srv *Stream, _ *streamTestPair) { srv.Close() }, false},
		{"Session.Close", func(_, _ *Stream, p *streamTestPair) { p.client.Close() }, false},
		{"server side Close", func(_, srv *Stream, _ *streamTestPair) { srv.Close() }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, cli, srv := exchangedPair(t)
			st := cli
			if tc.server {
				st = srv
			}
			const readers = 4
			done := make(chan error, readers)
			for i := range readers {
				go func() {
					if i%2 == 0 {
						_, err := st.Read(make([]byte, 8))
						done <- err
					} else {
						_, err := st.BufferReader().ReadBytes(8)
						done <- err
					}
				}()
			}
			waitBlocked(t, "(*Stream).awaitReadable", readers)
			tc.end(cli, srv, p)
			for i := range readers {
				select {
				case err := <-done:
					if err == nil {
						t.Errorf("a read returned no error")
					}
				case <-time.After(peerTimeout):
					t.Fatalf("%d of %d blocked readers still blocked after %v", readers-i, readers, peerTimeout)
				}
			}
		})
	}
}

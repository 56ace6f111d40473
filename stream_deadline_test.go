package shmipc

// Deadlines on a stream, and every blocked reader woken by whatever ends its
// read.

import (
	"io"
	"testing"
	"time"
)

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

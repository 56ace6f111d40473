package shmipc

// The parts of the net.Conn contract that callers branch on: the error
// after a deliberate Close, and deadlines that apply to calls already
// blocked.

import (
	"bytes"
	"errors"
	"io"
	"net"
	"testing"
	"time"
)

// TestStreamOwnCloseMatchesNetErrClosed: after a stream's own Close, every
// call that fails (reads, writes, a Read and a Write blocked when Close
// came) fails with an error matching net.ErrClosed, as a closed net.Conn's
// do, and ErrStreamClosed.
func TestStreamOwnCloseMatchesNetErrClosed(t *testing.T) {
	mzModes(t, func(t *testing.T) {
		_, cli, _ := mzPair(t, func(c *Config) {
			c.ShareMemoryBufferCap = 1 << 20
			c.BufferSliceSizes = ReferenceSliceSizes()
			c.QueueCap = 64
			c.WriteSpaceTimeout = time.Minute
		})
		blockedRead := mzBlocked(func() (int, error) { return cli.Read(make([]byte, 8)) })
		writer := ccBlockedWrite(t, cli) // the server reads nothing
		waitBlocked(t, "(*Stream).awaitReadable", 1)
		waitBlocked(t, "(*spaceWait).pause", 1)
		if err := cli.Close(); err != nil {
			t.Fatal(err)
		}
		for what, ch := range map[string]<-chan mzResult{"Read": blockedRead, "Write": writer} {
			select {
			case r := <-ch:
				ccWantNetErrClosed(t, what+" blocked during Close", r.err)
			case <-time.After(mzTimeout):
				t.Fatalf("HANG: a %s blocked during Close did not end", what)
			}
		}
		for _, op := range mzStreamOps(cli) {
			if err, ok := mzCall(t, op.name, op.f); ok && (err != nil || !op.zero) {
				ccWantNetErrClosed(t, op.name+" after Close", err)
			}
		}
	})
}

func ccWantNetErrClosed(t *testing.T, what string, err error) {
	t.Helper()
	if !errors.Is(err, net.ErrClosed) || !errors.Is(err, ErrStreamClosed) {
		t.Errorf("%s: %v, want an error matching net.ErrClosed and ErrStreamClosed", what, err)
	}
}

// TestStreamPeerCloseWriteError: a Write on a stream the peer closed fails
// with ErrStreamPeerClosed, which does not look like a deliberate local
// close; once this side closes too, writes fail with net.ErrClosed.
func TestStreamPeerCloseWriteError(t *testing.T) {
	mzModes(t, func(t *testing.T) {
		_, cli, srv := mzPair(t, nil)
		if err := srv.Close(); err != nil {
			t.Fatal(err)
		}
		cli.SetReadDeadline(time.Now().Add(mzTimeout))
		if _, err := cli.Read(make([]byte, 1)); err != io.EOF {
			t.Fatalf("Read after the peer's close: %v, want io.EOF", err)
		}
		_, err := cli.Write([]byte("late"))
		if !errors.Is(err, ErrStreamPeerClosed) || errors.Is(err, net.ErrClosed) || errors.Is(err, ErrStreamClosed) {
			t.Errorf("Write after the peer's close: %v, want ErrStreamPeerClosed, not net.ErrClosed nor ErrStreamClosed", err)
		}
		cli.Close()
		_, err = cli.Write([]byte("later"))
		ccWantNetErrClosed(t, "Write after the peer's close and this side's", err)
	})
}

// ccBlockedWrite fills the send path of st (ccFill), then starts a Write
// that blocks for room with no deadline. It returns the Write's result.
func ccBlockedWrite(t *testing.T, st *Stream) <-chan mzResult {
	t.Helper()
	ccFill(t, st)
	return mzBlocked(func() (int, error) { return st.Write(bytes.Repeat([]byte{7}, 4096)) })
}

// ccMoveTimes are the times of the tests whose deadline is moved later
// while a call is blocked: the first deadline, when it is moved (once the
// call has had time to block), and when the call is given what it waits
// for, well past the first deadline, so that a deadline not moved would
// have ended the call by then (twice the first deadline with -short).
func ccMoveTimes() (first, move, serve time.Duration) {
	if testing.Short() {
		return 100 * time.Millisecond, 30 * time.Millisecond, 200 * time.Millisecond
	}
	return 200 * time.Millisecond, 50 * time.Millisecond, 500 * time.Millisecond
}

// ccFill writes to st, whose peer reads nothing, until a write waits for
// room (it pauses in spaceWait), ends that write by moving its deadline to
// now, so that its message is not sent, and clears the write deadline.
// (Each write's deadline is peerTimeout away, should the move not end it.)
func ccFill(t *testing.T, st *Stream) {
	t.Helper()
	msg := bytes.Repeat([]byte{7}, 4096)
	me := goroutineID()
	for i := 0; ; i++ {
		st.SetWriteDeadline(time.Now().Add(peerTimeout))
		ch := mzBlocked(func() (int, error) { return st.Write(msg) })
		var r mzResult
	wait:
		for {
			select {
			case r = <-ch:
				break wait
			case <-time.After(time.Millisecond):
				if blockedIn("(*spaceWait).pause", me) > 0 {
					st.SetWriteDeadline(time.Now())
				}
			}
		}
		if errors.Is(r.err, ErrTimeout) {
			break
		}
		if r.err != nil {
			t.Fatalf("write %d: %v", i, r.err)
		}
		if i > 100000 {
			t.Fatalf("%d writes went through without a reader", i)
		}
	}
	st.SetWriteDeadline(time.Time{})
}

// TestWriteDeadlineExtendedWhileBlocked: a Write blocked for room with a
// 200 ms deadline, the deadline moved to 3 s after 50 ms, room made after
// 500 ms (100, 30 and 200 ms with -short): the Write succeeds. Clearing the deadline does the same, and
// moving it earlier ends the wait then.
func TestWriteDeadlineExtendedWhileBlocked(t *testing.T) {
	mzModes(t, func(t *testing.T) {
		for _, c := range []struct {
			name  string
			later time.Duration // 0: cleared
		}{{"moved", 3 * time.Second}, {"cleared", 0}} {
			t.Run(c.name, func(t *testing.T) {
				_, cli, srv := mzPair(t, func(c *Config) {
					c.ShareMemoryBufferCap = 1 << 20
					c.BufferSliceSizes = ReferenceSliceSizes()
					c.QueueCap = 64
					c.WriteSpaceTimeout = time.Minute
				})
				ccFill(t, cli)
				msg := []byte("after the wait")
				first, move, serve := ccMoveTimes()
				cli.SetWriteDeadline(time.Now().Add(first))
				ch := mzBlocked(func() (int, error) { return cli.Write(msg) })
				time.Sleep(move)
				if c.later == 0 {
					cli.SetWriteDeadline(time.Time{})
				} else {
					cli.SetWriteDeadline(time.Now().Add(c.later))
				}
				time.Sleep(serve - move)
				select {
				case r := <-ch:
					t.Fatalf("the Write ended before there was room: (%d, %v) after %v; its deadline was moved to %v", r.n, r.err, r.took, c.later)
				default:
				}
				got := make(chan []byte, 1)
				go func() { // room: the server reads everything
					all, _ := io.ReadAll(srv)
					got <- all
				}()
				select {
				case r := <-ch:
					if r.err != nil {
						t.Fatalf("Write blocked for room: %v after %v, although its deadline was moved to %v", r.err, r.took, c.later)
					}
				case <-time.After(mzTimeout):
					t.Fatalf("HANG: the blocked Write did not end")
				}
				cli.Close()
				if all := <-got; !bytes.HasSuffix(all, msg) {
					t.Errorf("the server's last bytes: %q, want %q", all[max(0, len(all)-len(msg)):], msg)
				}
			})
		}
		t.Run("earlier", func(t *testing.T) {
			_, cli, _ := mzPair(t, func(c *Config) {
				c.ShareMemoryBufferCap = 1 << 20
				c.BufferSliceSizes = ReferenceSliceSizes()
				c.QueueCap = 64
				c.WriteSpaceTimeout = time.Minute
			})
			cli.SetWriteDeadline(time.Now().Add(time.Hour))
			ch := ccBlockedWrite(t, cli)
			waitBlocked(t, "(*spaceWait).pause", 1)
			cli.SetWriteDeadline(time.Now().Add(50 * time.Millisecond))
			select {
			case r := <-ch:
				mzTimeoutErr(t, "blocked Write after its deadline was moved earlier", r.err)
			case <-time.After(mzTimeout):
				t.Fatalf("HANG: a deadline moved earlier did not end the blocked Write")
			}
		})
	})
}

// TestReadDeadlineMovedWhileBlocked: the read side of the same contract. A
// Read blocked with a 200 ms deadline that is moved to 3 s after 50 ms gets
// the data written after 500 ms (100, 30 and 200 ms with -short); one whose deadline is moved from an hour
// to 50 ms from now fails then.
func TestReadDeadlineMovedWhileBlocked(t *testing.T) {
	mzModes(t, func(t *testing.T) {
		_, cli, srv := mzPair(t, nil)
		first, move, serve := ccMoveTimes()
		srv.SetReadDeadline(time.Now().Add(first))
		ch := mzBlocked(func() (int, error) { return io.ReadFull(srv, make([]byte, 5)) })
		time.Sleep(move)
		srv.SetReadDeadline(time.Now().Add(3 * time.Second))
		time.Sleep(serve - move)
		if _, err := cli.Write([]byte("hello")); err != nil {
			t.Fatal(err)
		}
		if r := <-ch; r.err != nil {
			t.Errorf("Read whose deadline was moved later: %v after %v", r.err, r.took)
		}

		srv.SetReadDeadline(time.Now().Add(time.Hour))
		ch = mzBlocked(func() (int, error) { return srv.Read(make([]byte, 5)) })
		waitBlocked(t, "(*Stream).awaitReadable", 1)
		srv.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
		select {
		case r := <-ch:
			mzTimeoutErr(t, "Read whose deadline was moved earlier", r.err)
		case <-time.After(mzTimeout):
			t.Fatalf("HANG: a read deadline moved earlier did not end the Read")
		}
	})
}

package shmipc

// A peer process killed while this one waits in Read: the blocked Read
// fails with ErrSessionClosed, the session says the peer closed the
// connection, and the shared memory regions go away.

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

// mpBlockedRead starts a Read on st and returns where its error arrives.
func mpBlockedRead(t *testing.T, st *Stream) <-chan error {
	t.Helper()
	res := make(chan error, 1)
	go func() {
		n, err := st.Read(make([]byte, 64))
		if err == nil {
			err = fmt.Errorf("read %d bytes, want an error", n)
		}
		res <- err
	}()
	waitBlocked(t, "(*Stream).awaitReadable", 1)
	select {
	case err := <-res:
		t.Fatalf("Read returned before the peer died: %v", err)
	default:
	}
	return res
}

// mpExpectPeerDeath checks what a session sees once the peer process died:
// the blocked Read fails within 2 s with ErrSessionClosed, and the session
// says the peer closed the connection.
func mpExpectPeerDeath(t *testing.T, sess *Session, res <-chan error) {
	t.Helper()
	select {
	case err := <-res:
		if !errors.Is(err, ErrSessionClosed) {
			t.Errorf("blocked Read after the peer died: %v, want an error wrapping ErrSessionClosed", err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("blocked Read still blocked 2s after the peer was killed")
	}
	err := sess.Err()
	if !errors.Is(err, ErrSessionClosed) || err == nil || !strings.Contains(err.Error(), "peer closed the connection") {
		t.Errorf("session Err() after the peer died: %v, want ErrSessionClosed and %q", err, "peer closed the connection")
	}
}

// TestMultiProcessPeerDeath: the parent is the client of a child server
// that is SIGKILLed while the parent waits in Read.
func TestMultiProcessPeerDeath(t *testing.T) {
	for _, mode := range bothModes {
		t.Run(mode.String(), func(t *testing.T) {
			prefix := shmPrefix(t, "mp")
			sock := filepath.Join(t.TempDir(), "s.sock")
			c := mpStart(t, mpRoleEchoServer, sock, prefix, mode)

			sess, err := Dial("unix", sock, mpConfig(mode, prefix))
			if err != nil {
				t.Fatalf("dial the child: %v\n%s", err, c.Output())
			}
			defer sess.Close()
			st, err := sess.OpenStream()
			if err != nil {
				t.Fatal(err)
			}
			defer st.Close()
			if err := mpRoundTrip(st, mpPayload(64, 1), false); err != nil {
				t.Fatal(err)
			}
			res := mpBlockedRead(t, st)
			if err := c.Kill(); err != nil {
				t.Fatal(err)
			}
			mpExpectPeerDeath(t, sess, res)

			// errors.go: ErrSessionClosed "is returned by the methods of a
			// closed session and of its streams"; ErrStreamClosed only after
			// the stream's own Close or the peer's close of the stream.
			t.Run("write-after-death", func(t *testing.T) {
				if _, err := st.Write([]byte("x")); !errors.Is(err, ErrSessionClosed) {
					t.Errorf("Write on a stream of a session whose peer died: %v, want an error wrapping ErrSessionClosed (and the cause)", err)
				}
				if _, err := st.BufferWriter().WriteBytes([]byte("x")); !errors.Is(err, ErrSessionClosed) {
					t.Errorf("BufferWriter.WriteBytes on a stream of a session whose peer died: %v, want an error wrapping ErrSessionClosed", err)
				}
			})
			if _, err := sess.OpenStream(); !errors.Is(err, ErrSessionClosed) {
				t.Errorf("OpenStream after the peer died: %v, want an error wrapping ErrSessionClosed", err)
			}
			st.Close()
			sess.Close()
			if err := c.Wait(10 * time.Second); err == nil {
				t.Errorf("the killed child exited with status 0")
			}
			// The dead server cannot clean up; the client removes its own
			// files and mappings.
			mpWaitGone(t, "regions after the server died", "self", prefix, clSettle)
		})
	}
}

// TestMultiProcessClientDeath: the parent is the server, the child client
// is SIGKILLed while the parent waits in Read on its stream. The server must
// also remove the files the dead client can no longer remove.
func TestMultiProcessClientDeath(t *testing.T) {
	for _, mode := range bothModes {
		t.Run(mode.String(), func(t *testing.T) {
			prefix := shmPrefix(t, "mp")
			sock := filepath.Join(t.TempDir(), "s.sock")
			ln, err := Listen("unix", sock, mpConfig(mode, prefix))
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			c := mpStart(t, mpRoleIdleClient, sock, prefix, mode)

			st := acceptWithin(t, ln, 10*time.Second)
			defer st.Close()
			st.SetReadDeadline(time.Now().Add(10 * time.Second))
			got := make([]byte, 64)
			if _, err := io.ReadFull(st, got); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, mpPayload(64, 7)) {
				t.Fatalf("got %x from the child client", got)
			}
			st.SetReadDeadline(time.Time{})
			res := mpBlockedRead(t, st)
			if err := c.Kill(); err != nil {
				t.Fatal(err)
			}
			mpExpectPeerDeath(t, st.Session(), res)
			st.Close()
			if err := c.Wait(10 * time.Second); err == nil {
				t.Errorf("the killed child exited with status 0")
			}
			mpWaitGone(t, "regions of the dead client", "self", prefix, clSettle)
			if err := ln.Close(); err != nil {
				t.Error(err)
			}
		})
	}
}

// TestPeerDeathKillLoop: the child killed at random points of a mixed
// workload, -peerdeath.kills times.

var pdKills = flag.Int("peerdeath.kills", 100, "how many times TestPeerDeathKillLoop kills its child")

// TestPeerDeathKillLoop kills the child -peerdeath.kills times (100 by
// default) at a random point 0-50 ms into a workload of 1-6 streams each
// sending checksummed messages of 1 B to 1 MiB in both directions. The
// child is the server in even iterations and the client in odd ones, in
// memfd or file mode by turns.
func TestPeerDeathKillLoop(t *testing.T) {
	if proctest.IsChild() {
		t.Skip()
	}
	prefix := shmPrefix(t, "pdl")
	check := pdLeakCheck(t, prefix)
	start := time.Now()
	var lats, afterClose []time.Duration
	survived := 0
	// With -short, 8 kills: each side in each mode still killed twice.
	kills := shortOr(*pdKills, min(*pdKills, 8))
	for i := range kills {
		side := "server"
		if i%2 == 1 {
			side = "client"
		}
		mode := bothModes[(i/2)%2]
		ok := t.Run(fmt.Sprintf("%d", i), func(t *testing.T) {
			nstreams := 1 + rand.IntN(6)
			p := pdConnect(t, side, "mixed", "default", mode, prefix, nstreams)
			var calls []*pdCall
			for _, st := range p.streams {
				werr := make(chan error, 1)
				calls = append(calls, pdGo(fmt.Sprintf("reader of stream %d", st.ID()), func() error {
					err := pdMixed(st, rand.Uint64(), 1<<20, werr)
					if errors.Is(err, errSkCorrupt) {
						t.Errorf("%v", err)
					}
					return err
				}))
				calls = append(calls, pdGo(fmt.Sprintf("writer of stream %d", st.ID()), func() error { return <-werr }))
			}
			if side == "client" {
				calls = append(calls, pdGo("AcceptStream", func() error { _, err := p.sess.AcceptStream(); return err }))
			}
			time.Sleep(time.Duration(rand.IntN(51)) * time.Millisecond)
			// Note when the session sees the death (the socket closed and
			// the receive loop read EOF): the kill-to-error latency also
			// holds the kernel's teardown of the child, which for a -race
			// binary under load is most of it.
			seen := make(chan time.Time, 1)
			stop := make(chan struct{})
			go func() {
				for !p.sess.IsClosed() {
					select {
					case <-stop:
						return
					default:
					}
					time.Sleep(100 * time.Microsecond)
				}
				seen <- time.Now()
			}()
			lat := pdKillQuiet(t, p.c, pdSessionGone, calls...)
			close(stop)
			var last time.Time
			for _, call := range calls {
				if call.at.After(last) {
					last = call.at
				}
			}
			select {
			case at := <-seen:
				afterClose = append(afterClose, max(last.Sub(at), 0))
			case <-time.After(pdBound):
				t.Errorf("session not closed %v after the peer was killed", pdBound)
			}
			lats = append(lats, lat)
			p.close()
		})
		if !ok {
			break
		}
		survived++
	}
	pdFresh(t, MemMapTypeMemFd, prefix)
	pdFresh(t, MemMapTypeDevShmFile, prefix)
	check("after the kill loop")
	slices.Sort(lats)
	slices.Sort(afterClose)
	if len(afterClose) > 0 {
		t.Logf("kill loop: last blocked call failed after the session saw the closed socket: median %v, max %v",
			afterClose[len(afterClose)/2].Round(10*time.Microsecond), afterClose[len(afterClose)-1].Round(10*time.Microsecond))
	}
	if len(lats) > 0 {
		t.Logf("kill loop: %d/%d kills survived in %v; error latency after SIGKILL: median %v, p90 %v, max %v",
			survived, kills, time.Since(start).Round(time.Millisecond), lats[len(lats)/2].Round(10*time.Microsecond),
			lats[len(lats)*9/10].Round(10*time.Microsecond), lats[len(lats)-1].Round(10*time.Microsecond))
	}
}

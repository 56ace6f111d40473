package shmipc

// A peer process killed while this one waits in Read: the blocked Read
// fails with ErrSessionClosed, the session says the peer closed the
// connection, and the shared memory regions go away.

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"testing"
	"time"
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

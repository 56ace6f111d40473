package shmipc

// Cleanup of a session closed while its streams still hold unread data.

import (
	"bytes"
	"errors"
	"fmt"
	"path/filepath"
	"testing"
	"time"
)

// TestCleanupCloseSessionWithUnreadData closes a session while streams on
// both sides still hold unread data (and one holds a zero-copy slice it has
// read), then closes the streams: everything must go away. It also checks
// what the streams see in between.
func TestCleanupCloseSessionWithUnreadData(t *testing.T) {
	for _, mode := range bothModes {
		for _, closer := range []string{"client", "server"} {
			t.Run(mode.String()+"/"+closer+"-closes", func(t *testing.T) {
				prefix := shmPrefix(t, "cl")
				conf := clConfig(mode, prefix)
				sock := filepath.Join(t.TempDir(), "s.sock")
				base := clBaseline(t, prefix)

				ln, err := Listen("unix", sock, conf)
				if err != nil {
					t.Fatal(err)
				}
				defer ln.Close()
				sess, err := Dial("unix", sock, conf)
				if err != nil {
					t.Fatal(err)
				}
				defer sess.Close()

				const nStreams = 3
				toServer := []int{64, 20 << 10, 200 << 10} // three slice classes
				const toClient = 50 << 10
				var cs, ss []*Stream
				for i := range nStreams {
					st, err := sess.OpenStream()
					if err != nil {
						t.Fatal(err)
					}
					defer st.Close()
					for k, n := range toServer {
						if _, err := st.Write(mpPayload(n, uint64(i*10+k))); err != nil {
							t.Fatal(err)
						}
					}
					cs = append(cs, st)
				}
				for range nStreams {
					st := acceptWithin(t, ln, 10*time.Second)
					defer st.Close()
					if _, err := st.Write(mpPayload(toClient, uint64(st.ID()))); err != nil {
						t.Fatal(err)
					}
					ss = append(ss, st)
				}
				total := 0
				for _, n := range toServer {
					total += n
				}
				for _, st := range ss {
					clWaitLen(t, st, total)
				}
				for _, st := range cs {
					clWaitLen(t, st, toClient)
				}
				// The client reads part of stream 0 zero-copy and keeps
				// the slice: the mapping must outlive the session for it.
				want := mpPayload(toClient, uint64(cs[0].ID()))[:100]
				held, err := cs[0].BufferReader().ReadBytes(100)
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(held, want) {
					t.Fatalf("zero-copy read: got %x, want %x", held[:8], want[:8])
				}

				srvSess := ss[0].Session()
				var peer *Session
				switch closer {
				case "client":
					sess.Close()
					peer = srvSess
				case "server":
					srvSess.Close()
					peer = sess
				}
				waitSessionClosed(t, peer, 5*time.Second)
				if err := peer.Err(); !clPeerGone(err) {
					t.Errorf("%s session after its peer closed: Err() = %v, want ErrSessionClosed wrapping io.EOF or ECONNRESET", peer.role(), err)
				}

				if !bytes.Equal(held, want) {
					t.Errorf("zero-copy slice read before the session ended changed: got %x, want %x", held[:8], want[:8])
				}
				// A session ended by the peer leaves received data
				// readable; then reads fail with the session's error.
				peerStreams := ss
				if closer == "server" {
					peerStreams = cs[1:]
				}
				for _, st := range peerStreams {
					n := st.BufferReader().Len()
					if n == 0 {
						t.Errorf("%s stream %d: unread data dropped when the peer closed the session", peer.role(), st.ID())
						continue
					}
					if _, err := st.BufferReader().Discard(n); err != nil {
						t.Errorf("%s stream %d: reading the %d bytes left after the peer closed the session: %v", peer.role(), st.ID(), n, err)
					}
					if _, err := st.Read(make([]byte, 1)); !errors.Is(err, ErrSessionClosed) {
						t.Errorf("%s stream %d: read past the data left after the peer closed the session: %v, want ErrSessionClosed", peer.role(), st.ID(), err)
					}
				}

				for _, st := range append(cs, ss...) {
					if err := st.Close(); err != nil {
						t.Errorf("%s stream %d: Close after the session ended: %v", st.Session().role(), st.ID(), err)
					}
				}
				sess.Close()
				if err := ln.Close(); err != nil {
					t.Error(err)
				}
				clCheckBack(t, "after closing the sessions and then their streams", base, prefix)
			})
		}
	}
}

// clWaitLen waits until st has n unread bytes.
func clWaitLen(t testing.TB, st *Stream, n int) {
	t.Helper()
	waitUntil(t, fmt.Sprintf("%d bytes arrive on stream %d", n, st.ID()), 5*time.Second, func() bool { return st.BufferReader().Len() >= n })
}

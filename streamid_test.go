package shmipc

// Stream ids never wrap: a session that has given out its last id refuses
// to open more, and a SessionManager carries on with a new session.

import (
	"errors"
	"io"
	"math"
	"path/filepath"
	"testing"
	"time"
)

// nearLastID makes client session s give out the ids from math.MaxUint32-left+1
// on, as if it had opened nearly 2^32 streams.
func nearLastID(s *Session, left uint32) {
	s.mu.Lock()
	s.nextID = math.MaxUint32 - left
	s.mu.Unlock()
}

// TestStreamIDsDoNotWrap: the last ids work end to end, and then OpenStream
// fails with ErrStreamIDsExhausted instead of starting again from a low id
// the server may still know.
func TestStreamIDsDoNotWrap(t *testing.T) {
	p := newStreamTestPair(t, MemMapTypeMemFd, nil)
	nearLastID(p.client, 2)
	for _, want := range []uint32{math.MaxUint32 - 1, math.MaxUint32} {
		st, err := p.client.OpenStream()
		if err != nil {
			t.Fatalf("OpenStream for id %d: %v", want, err)
		}
		defer st.Close()
		if st.ID() != want {
			t.Fatalf("stream id %d, want %d", st.ID(), want)
		}
		if _, err := st.Write([]byte("ping")); err != nil {
			t.Fatal(err)
		}
		srv := acceptWithin(t, p.server, 10*time.Second)
		defer srv.Close()
		if srv.ID() != want {
			t.Fatalf("server accepted id %d, want %d", srv.ID(), want)
		}
		buf := make([]byte, 4)
		srv.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.ReadFull(srv, buf); err != nil || string(buf) != "ping" {
			t.Fatalf("server read %q, %v", buf, err)
		}
	}
	st, err := p.client.OpenStream()
	if err == nil {
		st.Close()
		t.Fatalf("OpenStream after id %d gave id %d; want ErrStreamIDsExhausted", uint32(math.MaxUint32), st.ID())
	}
	if !errors.Is(err, ErrStreamIDsExhausted) {
		t.Fatalf("OpenStream after the last id: %v, want ErrStreamIDsExhausted", err)
	}
	if p.client.IsClosed() {
		t.Fatalf("the session ended: %v; its open streams should go on", p.client.Err())
	}
}

// TestSessionManagerRenewsExhaustedSession: when its session runs out of
// ids, GetStream goes on with a stream on a new session; the old session's
// streams go on working until they are put back (then they are closed, not
// pooled), and the old session ends with the last of them.
func TestSessionManagerRenewsExhaustedSession(t *testing.T) {
	prefix := shmPrefix(t, "sid")
	sock := filepath.Join(t.TempDir(), "s.sock")
	srv := clStartEcho(t, sock, mpConfig(MemMapTypeMemFd, prefix))
	defer srv.close(t)
	m, err := NewSessionManager(SessionManagerConfig{
		Config:  mpConfig(MemMapTypeMemFd, prefix),
		Network: "unix",
		Address: sock,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	old := m.Sessions()[0]
	nearLastID(old, 1)
	last, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	if last.Session() != old || last.ID() != math.MaxUint32 {
		t.Fatalf("first stream: id %d on session %p, want the last id on %p", last.ID(), last.Session(), old)
	}
	if err := mpRoundTrip(last, []byte("last id"), false); err != nil {
		t.Fatal(err)
	}

	var streams []*Stream
	for i := range 3 {
		st, err := m.GetStream()
		if err != nil {
			t.Fatalf("GetStream %d after the last id: %v", i, err)
		}
		streams = append(streams, st)
		if st.Session() == old {
			t.Fatalf("GetStream %d after the last id: stream %d on the exhausted session", i, st.ID())
		}
		if err := mpRoundTrip(st, []byte("new session"), false); err != nil {
			t.Fatalf("stream %d on the new session: %v", i, err)
		}
	}
	if ss := m.Sessions(); len(ss) != 1 || ss[0] == old || ss[0] != streams[0].Session() {
		t.Fatalf("the manager's sessions after the renewal: %v, want only the new one", ss)
	}
	if old.IsClosed() {
		t.Fatalf("the old session ended while a stream was open on it: %v", old.Err())
	}
	if err := mpRoundTrip(last, []byte("old session, still open"), false); err != nil {
		t.Fatalf("the stream left on the old session: %v", err)
	}
	m.PutBack(last)
	select {
	case <-old.closed:
	case <-time.After(10 * time.Second):
		t.Fatalf("the old session did not end after its last stream was put back")
	}
	for _, st := range streams {
		m.PutBack(st)
	}
	if n := m.IdleStreams(); n != len(streams) {
		t.Errorf("%d idle streams, want the %d put back on the new session", n, len(streams))
	}
	st, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	if err := mpRoundTrip(st, []byte("pooled"), false); err != nil {
		t.Fatal(err)
	}
	m.PutBack(st)
}

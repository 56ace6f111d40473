package shmipc

// SessionManager.PutBack under read deadlines: a stream whose reply may
// still be on its way must not be handed out for the next request. The
// server is another process (a child running the delayed echo below).

import (
	"encoding/binary"
	"errors"
	"io"
	"math/rand/v2"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

const (
	pbChildTest       = "TestPutBackChild"
	pbRoleDelayedEcho = "delayed-echo"
	pbRequestLen      = 12 // u64 id, u32 delay in µs
)

// TestPutBackChild is the body of the child process of the PutBack tests:
// a server that answers each request (pbRequestLen bytes: an id and a
// delay) with its id, after the delay the request asks for. In a normal
// run it skips itself.
func TestPutBackChild(t *testing.T) {
	switch proctest.Role() {
	case "":
		t.Skip("runs only as the child process of the PutBack tests")
	case pbRoleDelayedEcho:
	default:
		t.Fatalf("unknown child role %q", proctest.Role())
	}
	ln, err := Listen("unix", proctest.MustArg(t, "SOCK"), mpConfig(MemMapTypeMemFd, proctest.MustArg(t, "PREFIX")))
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			st, err := ln.AcceptStream()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				pbServe(st)
			}()
		}
	}()
	proctest.Ready()
	<-proctest.StdinClosed()
	ln.Close()
	wg.Wait()
}

// pbServe answers the requests of one stream in turn until the client
// closes it. A reply to a stream the client closed meanwhile fails, which
// ends the stream here too.
func pbServe(st *Stream) {
	defer st.Close()
	req := make([]byte, pbRequestLen)
	for {
		if _, err := io.ReadFull(st, req); err != nil {
			return
		}
		time.Sleep(time.Duration(binary.LittleEndian.Uint32(req[8:])) * time.Microsecond)
		if _, err := st.Write(req[:8]); err != nil {
			return
		}
	}
}

// pbManager starts the delayed echo server in a child and returns a
// SessionManager dialed to it.
func pbManager(t *testing.T, sessions int) *SessionManager {
	t.Helper()
	prefix := shmPrefix(t, "pb")
	sock := filepath.Join(t.TempDir(), "s.sock")
	c, _ := startChild(t, proctest.Config{
		TestName: pbChildTest,
		Role:     pbRoleDelayedEcho,
		Args:     map[string]string{"SOCK": sock, "PREFIX": prefix},
	})
	t.Cleanup(func() {
		if err := c.Stop(20 * time.Second); err != nil {
			t.Errorf("child: %v\n%s", err, c.Output())
		}
	})
	m, err := NewSessionManager(SessionManagerConfig{
		Config:     mpConfig(MemMapTypeMemFd, prefix),
		Network:    "unix",
		Address:    sock,
		SessionNum: sessions,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// pbRequest sends request id with the server delay d on st.
func pbRequest(st *Stream, id uint64, d time.Duration) error {
	var req [pbRequestLen]byte
	binary.LittleEndian.PutUint64(req[:], id)
	binary.LittleEndian.PutUint32(req[8:], uint32(d/time.Microsecond))
	_, err := st.Write(req[:])
	return err
}

// pbReply reads one reply id from st.
func pbReply(st *Stream) (uint64, error) {
	var rep [8]byte
	if _, err := io.ReadFull(st, rep[:]); err != nil {
		return 0, err
	}
	return binary.LittleEndian.Uint64(rep[:]), nil
}

// TestPutBackAfterReadTimeout is the plain case: request A's reply comes
// after 100 ms, the client's deadline is 20 ms, it puts the stream back;
// request B on the next stream from the manager must read B's reply, not
// A's. A stream whose request was never read is not pooled either, while
// one whose exchange completed is.
func TestPutBackAfterReadTimeout(t *testing.T) {
	m := pbManager(t, 1)
	a, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	if err := pbRequest(a, 'A', 100*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	a.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	if _, err := pbReply(a); !errors.Is(err, ErrTimeout) {
		t.Fatalf("read of A's reply with a 20 ms deadline: %v, want a timeout", err)
	}
	m.PutBack(a)

	b, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	if err := pbRequest(b, 'B', 0); err != nil {
		t.Fatal(err)
	}
	b.SetReadDeadline(time.Now().Add(10 * time.Second))
	if got, err := pbReply(b); err != nil || got != 'B' {
		t.Fatalf("request B read (%q, %v), want B's reply: the stream put back after the timeout was handed out again (same stream: %v)", rune(got), err, a == b)
	}
	m.PutBack(b) // answered and read: clean
	again, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	if again != b {
		t.Errorf("a stream whose exchange completed was not pooled")
	}

	// A request whose reply nobody read: the stream is not clean.
	if err := pbRequest(again, 'C', 0); err != nil {
		t.Fatal(err)
	}
	m.PutBack(again)
	d, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	if d == again {
		t.Errorf("a stream whose request was not read was pooled")
	}
	if err := pbRequest(d, 'D', 0); err != nil {
		t.Fatal(err)
	}
	d.SetReadDeadline(time.Now().Add(10 * time.Second))
	if got, err := pbReply(d); err != nil || got != 'D' {
		t.Errorf("request D read (%q, %v), want D's reply", rune(got), err)
	}
	m.PutBack(d)
}

// TestPutBackRandomDeadlines sends 10,000 requests through a
// SessionManager from 8 goroutines. Each request carries a unique id and
// asks the server to answer after 0-2 ms; the client reads with a deadline
// of 0.2-3 ms (a quarter of them: 1 s), so many reads time out with their
// reply on its way, and every stream is put back after its request,
// whatever happened. No read may return another request's reply.
func TestPutBackRandomDeadlines(t *testing.T) {
	requests := 10000
	if testing.Short() {
		requests = 1000
	}
	const workers = 8
	m := pbManager(t, 2)
	var next, answered, timedOut, reused, wrong atomic.Int64
	var mu sync.Mutex
	seen := make(map[*Stream]bool)
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 37))
			for {
				id := uint64(next.Add(1))
				if id > uint64(requests) {
					return
				}
				st, err := m.GetStream()
				if err != nil {
					errs <- err
					return
				}
				mu.Lock()
				if seen[st] {
					reused.Add(1)
				}
				seen[st] = true
				mu.Unlock()
				delay := time.Duration(rng.IntN(2000)) * time.Microsecond
				deadline := time.Duration(200+rng.IntN(2800)) * time.Microsecond
				if rng.IntN(4) == 0 {
					deadline = time.Second // answered however loaded the machine is
				}
				if err := pbRequest(st, id, delay); err != nil {
					errs <- err
					return
				}
				st.SetReadDeadline(time.Now().Add(deadline))
				got, err := pbReply(st)
				switch {
				case errors.Is(err, ErrTimeout):
					timedOut.Add(1)
				case err != nil:
					errs <- err
					return
				case got != id:
					if wrong.Add(1) <= 5 {
						t.Errorf("request %d read the reply to request %d", id, got)
					}
				default:
					answered.Add(1)
				}
				m.PutBack(st)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	t.Logf("%d requests: %d answered, %d timed out, %d wrong replies; %d streams, %d handed out again",
		requests, answered.Load(), timedOut.Load(), wrong.Load(), len(seen), reused.Load())
	if wrong.Load() > 0 {
		t.Errorf("%d of %d requests read another request's reply", wrong.Load(), requests)
	}
	// The run must have exercised both paths: reads that gave up with the
	// reply on its way, and streams reused after a clean exchange.
	if timedOut.Load() < int64(requests/50) || reused.Load() < int64(requests/50) {
		t.Errorf("too few timeouts (%d) or reused streams (%d) for the run to mean anything", timedOut.Load(), reused.Load())
	}
}

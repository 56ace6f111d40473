package shmipc

import (
	"bytes"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

// sqRegion is a region whose large class has 7 slices of sqSize: with the
// last never handed out and a reserve of 1, a writer that holds nothing can
// take 5 of them.
func sqRegion() *Config {
	conf := DefaultConfig()
	conf.ShareMemoryBufferCap = 4 << 20
	conf.BufferSliceSizes = []SizePercentPair{{Size: 4096, Percent: 50}, {Size: sqSize, Percent: 50}}
	conf.WriteSpaceTimeout = 20 * time.Second
	return conf
}

const sqSize = 256 << 10

// Writers that find no room take it in the order they came, not whoever
// looks first after a slice is freed.
func TestWritersGetRoomInTurn(t *testing.T) {
	sess, _ := bpPair(t, sqRegion())
	if l := sess.Stats().Lists; len(l) != 2 || l[1].Slices != 7 {
		t.Fatalf("lists %+v: want 7 slices of %d bytes", l, sqSize)
	}
	open := func() *Stream {
		st, err := sess.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		return st
	}
	// Five streams hold a large slice each in a message they have not sent.
	var holders []*Stream
	for range 5 {
		st := open()
		if _, err := st.BufferWriter().Reserve(sqSize); err != nil {
			t.Fatal(err)
		}
		holders = append(holders, st)
	}
	class := sess.buf.Class(sqSize, false)
	const writers = 4
	done := make(chan int, writers)
	var wg sync.WaitGroup
	for i := range writers {
		st := open()
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := st.BufferWriter().Reserve(sqSize); err != nil {
				t.Errorf("writer %d: %v", i, err)
			}
			done <- i
		}()
		// Let it queue before the next one starts.
		waitFor(t, fmt.Sprintf("writer %d to queue", i), func() bool { return sess.buf.Space().Waiters(class) == i+1 })
	}
	for want := range writers {
		holders[want].Close() // frees one large slice: room for one writer
		select {
		case got := <-done:
			if got != want {
				t.Fatalf("freed slice %d went to writer %d, want %d (the longest waiting)", want, got, want)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("no writer got the freed slice %d", want)
		}
	}
	wg.Wait()
	if w := sess.Stats().SpaceWaits; w != writers {
		t.Errorf("Stats.SpaceWaits = %d, want %d: each writer waited for room once", w, writers)
	}
	if sess.buf.Space().Waiting() {
		t.Fatal("writers still counted as waiting")
	}
}

// waitFor polls cond until it holds, failing the test after 10 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// sqDialChild starts the child process test in role, which listens on
// the socket it is given, and dials it with conf.
func sqDialChild(t *testing.T, test, role string, conf *Config) (*proctest.Child, *Session) {
	t.Helper()
	sock := sockPath(t)
	c, _ := startChild(t, proctest.Config{TestName: test, Role: role, Args: map[string]string{"SOCK": sock}})
	sess, err := Dial("unix", sock, conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sess.Close() })
	return c, sess
}

const sqEchoRole = "space-queue-echo"

// TestSpaceQueueEchoChild is the child process of
// TestOverflowingEchoesStayInSharedMemory and
// TestSplitEchoesStayInSharedMemory: an echo server that reserves each
// reply (or, as splitEchoRole, appends a copy of the request with
// WriteBytes) before it releases the request it answers, until the parent
// closes stdin; it then prints how many messages it sent as fallback data.
func TestSpaceQueueEchoChild(t *testing.T) {
	role := proctest.Role()
	if role != sqEchoRole && role != splitEchoRole {
		t.Skip("runs only as the child process of TestOverflowingEchoesStayInSharedMemory and TestSplitEchoesStayInSharedMemory")
	}
	ln, err := Listen("unix", proctest.MustArg(t, "SOCK"), sqRegion())
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu   sync.Mutex
		sess *Session
	)
	go func() {
		for {
			st, err := ln.AcceptStream()
			if err != nil {
				return
			}
			mu.Lock()
			sess = st.Session()
			mu.Unlock()
			go func() {
				defer st.Close()
				r, w := st.BufferReader(), st.BufferWriter()
				for {
					req, err := r.ReadBytes(sqSize)
					if err != nil {
						return
					}
					if role == splitEchoRole {
						// WriteBytes, which may split the reply over slices.
						if _, err := w.WriteBytes(req); err != nil {
							proctest.Println("echo error:", err)
							return
						}
					} else {
						p, err := w.Reserve(sqSize)
						if err != nil {
							proctest.Println("echo error:", err)
							return
						}
						copy(p, req)
					}
					r.ReleasePreviousRead()
					if err := st.Flush(false); err != nil {
						return
					}
				}
			}()
		}
	}()
	proctest.Ready()
	<-proctest.StdinClosed()
	mu.Lock()
	defer mu.Unlock()
	var fallbacks uint64
	if sess != nil {
		fallbacks = sess.Stats().FallbackMessagesOut
	}
	proctest.Println("fallbacks " + strconv.FormatUint(fallbacks, 10))
	ln.Close()
}

// Echoes between two processes whose requests and replies together need
// more of the region than it has: the echo server reserves each reply
// while it holds the request. Requests must not take every slice, or the
// server waits for room that only its replies would free and ends up
// sending its replies over the socket; with the list reserve every
// exchange stays in shared memory, and every stream gets its round trips.
func TestOverflowingEchoesStayInSharedMemory(t *testing.T) {
	c, sess := sqDialChild(t, "TestSpaceQueueEchoChild", sqEchoRole, sqRegion())
	const (
		streams = 16 // each needs two large slices in flight; 6 can be handed out
		rounds  = 30
	)
	sqEchoStreams(t, sess, streams, rounds, func(st *Stream, msg []byte) error {
		p, err := st.BufferWriter().Reserve(len(msg)) // one slice, contiguous
		copy(p, msg)
		return err
	})
	if fb := sess.Stats().FallbackMessagesOut; fb != 0 {
		t.Errorf("the client sent %d messages as fallback data, want 0", fb)
	}
	sqCheckServerFallbacks(t, c)
}

// sqEchoStreams runs rounds echoes of sqSize bytes on each of streams
// new streams of sess at once, each request written by write, and checks
// every echo.
func sqEchoStreams(t *testing.T, sess *Session, streams, rounds int, write func(st *Stream, msg []byte) error) {
	t.Helper()
	var wg sync.WaitGroup
	for i := range streams {
		st, err := sess.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		wg.Add(1)
		go func() {
			defer wg.Done()
			msg := make([]byte, sqSize)
			for n := range rounds {
				for k := range msg {
					msg[k] = byte(i*rounds + n + k)
				}
				if err := write(st, msg); err != nil {
					t.Errorf("stream %d round %d: %v", i, n, err)
					return
				}
				if err := st.Flush(false); err != nil {
					t.Errorf("stream %d round %d: flush: %v", i, n, err)
					return
				}
				got, err := st.BufferReader().ReadBytes(sqSize)
				if err != nil {
					t.Errorf("stream %d round %d: read: %v", i, n, err)
					return
				}
				if !bytes.Equal(got, msg) {
					t.Errorf("stream %d round %d: the echo differs", i, n)
				}
				st.BufferReader().ReleasePreviousRead()
			}
		}()
	}
	wg.Wait()
}

// sqCheckServerFallbacks stops the echo server c and checks that it sent
// no reply as fallback data and met no error.
func sqCheckServerFallbacks(t *testing.T, c *proctest.Child) {
	t.Helper()
	if err := c.CloseStdin(); err != nil {
		t.Fatal(err)
	}
	for {
		line, err := c.ReadLine(30 * time.Second)
		if err != nil {
			t.Fatalf("no report from the echo server: %v\n%s", err, c.Output())
		}
		if rest, ok := strings.CutPrefix(line, "fallbacks "); ok {
			if rest != "0" {
				t.Errorf("the echo server sent %s replies as fallback data, want 0", rest)
			}
			return
		}
		if strings.HasPrefix(line, "echo error:") {
			t.Errorf("echo server: %s", line)
		}
	}
}

const sqPushRole = "space-queue-push"

// TestSpaceQueuePushChild is the child process of
// TestMapperWritesIntoParkedRegion: a server that sends messages of 4 MiB
// on the stream it accepts, one at a time, each after the parent
// acknowledged the previous one with a 1, until the parent answers 0; it
// then prints "sent" and how many writes waited for room, or the error
// that stopped it.
func TestSpaceQueuePushChild(t *testing.T) {
	if proctest.Role() != sqPushRole {
		t.Skip("runs only as the child process of TestMapperWritesIntoParkedRegion")
	}
	conf := DefaultConfig()
	conf.WriteSpaceTimeout = 3 * time.Second
	ln, err := Listen("unix", proctest.MustArg(t, "SOCK"), conf)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	proctest.Ready()
	st, err := ln.AcceptStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	r, w := st.BufferReader(), st.BufferWriter()
	if _, err := r.ReadBytes(2); err != nil { // the parent's "go"
		t.Fatal(err)
	}
	r.ReleasePreviousRead()
	for n := 0; ; n++ {
		p, err := w.Reserve(4 << 20)
		if err == nil {
			p[0], p[len(p)-1] = byte(n), byte(n)
			err = st.Flush(false)
		}
		var ack []byte
		if err == nil {
			ack, err = r.ReadBytes(1)
		}
		if err != nil {
			proctest.Println(fmt.Sprintf("error after %d messages: %v", n, err))
			return
		}
		more := ack[0] == 1
		r.ReleasePreviousRead()
		if !more {
			break
		}
	}
	proctest.Println(fmt.Sprintf("sent, %d waits", st.Session().Stats().SpaceWaits))
	<-proctest.StdinClosed()
}

// The server maps the region the client created, and the client parks the
// slices of a busy list that traffic does not need (internal/shm, circulation.go): the
// list of 4 MiB slices, with one message in flight, keeps only a few of its
// 20 slices free. The server's writers must still get room there, message
// after message.
func TestMapperWritesIntoParkedRegion(t *testing.T) {
	c, sess := sqDialChild(t, "TestSpaceQueuePushChild", sqPushRole, DefaultConfig())
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := st.Write([]byte("go")); err != nil { // the server accepts it
		t.Fatal(err)
	}
	large := sess.buf.Class(4<<20, false)
	// Messages for 20 circulation periods (6 with -short), and at least
	// until a slice has been parked.
	start, parked, n := time.Now(), int32(0), 0
	for ; time.Since(start) < shortOr[time.Duration](20, 6)*circulationPeriods.Look || parked == 0; n++ {
		if time.Since(start) > 20*time.Second {
			t.Fatalf("no 4 MiB slice was parked in 20 s: the test does not test what it should")
		}
		if err := st.SetReadDeadline(time.Now().Add(20 * time.Second)); err != nil {
			t.Fatal(err)
		}
		msg, err := st.BufferReader().ReadBytes(4 << 20)
		if err != nil {
			t.Fatalf("message %d: %v\n%s", n, err, c.Output())
		}
		if msg[0] != byte(n) || msg[len(msg)-1] != byte(n) {
			t.Fatalf("message %d differs", n)
		}
		st.BufferReader().ReleasePreviousRead()
		if _, err := st.Write([]byte{1}); err != nil {
			t.Fatal(err)
		}
		parked = max(parked, sess.Stats().Lists[large].Parked)
	}
	if _, err := st.Write([]byte{0}); err != nil {
		t.Fatal(err)
	}
	// The client releases each message before it acknowledges it, so the
	// server finds the slice back on the list when it writes the next one.
	line, err := c.ReadLine(30 * time.Second)
	if err != nil || line != "sent, 0 waits" {
		t.Fatalf("server: %q, %v (want \"sent, 0 waits\": no write waited for room)\n%s", line, err, c.Output())
	}
	t.Logf("%d messages of 4 MiB in %v; at most %d slices of 4 MiB parked", n, time.Since(start).Round(time.Millisecond), parked)
}

const splitEchoRole = "split-echo"

// Echoes between two processes that need more large slices than the
// region has, written with WriteBytes, which may split a message over
// smaller slices. Split into 4 KiB slices (64 per message), the messages
// used to hold parts of the region while their writers waited for the
// rest, until the writers gave up and sent over the socket; split no
// finer than an eighth, a writer waits for a large slice instead, and
// every exchange stays in shared memory.
func TestSplitEchoesStayInSharedMemory(t *testing.T) {
	c, sess := sqDialChild(t, "TestSpaceQueueEchoChild", splitEchoRole, sqRegion())
	const (
		streams = 16
		rounds  = 30
	)
	sqEchoStreams(t, sess, streams, rounds, func(st *Stream, msg []byte) error {
		_, err := st.BufferWriter().WriteBytes(msg) // may split it over slices
		return err
	})
	if fb := sess.Stats().FallbackMessagesOut; fb != 0 {
		t.Errorf("the client sent %d messages as fallback data, want 0", fb)
	}
	sqCheckServerFallbacks(t, c)
}

// A message that fits one slice of the largest size is never sent as
// fallback data for being too large to split, even when the region has
// only two slices of that size.
func TestMessageWithinLargestSliceStaysInSharedMemory(t *testing.T) {
	const big = 256 << 10
	sess, accepted := twoClassPair(t, big, 30, 2, nil)
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	msg := bytes.Repeat([]byte("w"), big*6/10)
	if _, err := st.BufferWriter().WriteBytes(msg); err != nil {
		t.Fatal(err)
	}
	if err := st.Flush(false); err != nil {
		t.Fatal(err)
	}
	srv := <-accepted
	defer srv.Close()
	got, err := srv.BufferReader().ReadBytes(len(msg))
	if err != nil || !bytes.Equal(got, msg) {
		t.Fatalf("the message arrived as %d bytes, %v", len(got), err)
	}
	if fb := sess.Stats().FallbackMessagesOut; fb != 0 {
		t.Errorf("%d messages went as fallback data, want 0", fb)
	}
}

package shmipc

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

// Busy-polling readers between two real processes (poll.go): the replies
// of a ping-pong are found by the waiting reader itself; a reader that
// polls gets its deadline, the session's end, a memory fault and a peer
// that floods another stream as a parked reader would.

const pollChildTest = "TestPollChild"

// The first byte a client writes on a stream to the poll child says what
// the stream is for.
const (
	pollEcho  = 'E' // echo every byte back (mpServeEcho's frames)
	pollFlood = 'F' // then a count n (4 bytes): send n frames of pollFloodSize
)

const pollFloodSize = 4 << 10

// TestPollChild is the server process of the polling tests. In a normal run
// it skips itself.
func TestPollChild(t *testing.T) {
	if proctest.Role() == "" {
		t.Skip("runs only as the child process of the polling tests")
	}
	conf := mpConfig(mpParseMode(t, proctest.MustArg(t, "MODE")), proctest.MustArg(t, "PREFIX"))
	ln, err := Listen("unix", proctest.MustArg(t, "SOCK"), conf)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for {
			st, err := ln.AcceptStream()
			if err != nil {
				return
			}
			go pollServe(st)
		}
	}()
	proctest.Ready()
	<-proctest.StdinClosed()
	ln.CloseAll()
}

// pollServe serves one stream of the poll child.
func pollServe(st *Stream) {
	defer st.Close()
	var kind [1]byte
	if _, err := io.ReadFull(st, kind[:]); err != nil {
		return
	}
	if kind[0] == pollEcho {
		_ = mpServeEcho(st)
		return
	}
	var count [4]byte
	if _, err := io.ReadFull(st, count[:]); err != nil {
		return
	}
	msg := mpPayload(pollFloodSize, 3)
	for range binary.BigEndian.Uint32(count[:]) {
		if _, err := st.Write(msg); err != nil {
			return
		}
	}
	_, _ = io.Copy(io.Discard, st) // until the client closes
}

// pollServer starts the poll child in mode and returns it with its socket.
func pollServer(t *testing.T, mode MemMapType, prefix string) (*proctest.Child, string) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "s.sock")
	c, _ := startChild(t, proctest.Config{
		TestName: pollChildTest,
		Role:     "server",
		Args:     map[string]string{"SOCK": sock, "PREFIX": prefix, "MODE": mode.String()},
		Timeout:  3 * time.Minute,
	})
	t.Cleanup(func() { _ = c.Stop(peerTimeout) })
	return c, sock
}

// pollStream opens a stream of kind on sess.
func pollStream(t *testing.T, sess *Session, kind byte) *Stream {
	t.Helper()
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	if _, err := st.Write([]byte{kind}); err != nil {
		t.Fatal(err)
	}
	return st
}

// pollDial dials the poll child with conf (its mode and prefix as the
// child's).
func pollDial(t *testing.T, sock string, conf *Config) *Session {
	t.Helper()
	sess, err := Dial("unix", sock, conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sess.Close() })
	return sess
}

// TestPollingReaderFindsReplies: in a ping-pong with a server process, most
// replies are found by the waiting reader polling the queue (ReadsPolled),
// not handed to it parked (ReadsWoken), and few Polling frames go either
// way. Spinning is switched off for a while when the machine is busy, so
// the test looks at batches of round trips begun while it was on, and asks
// for one that shows it.
func TestPollingReaderFindsReplies(t *testing.T) {
	if procs.read(time.Now()); spinning.slots.Load() == 0 {
		t.Skip("nothing spins on a single CPU (spinGovernor)")
	}
	prefix := shmPrefix(t, "pollrt")
	_, sock := pollServer(t, MemMapTypeMemFd, prefix)
	sess := pollDial(t, sock, mpConfig(MemMapTypeMemFd, prefix))
	st := pollStream(t, sess, pollEcho)
	payload := mpPayload(64, 1)
	const batch = 200
	var last string
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); {
		// Spinning is off for a cool-down after a spinner found its CPU
		// wanted by another thread (spinGovernor.pressure): a batch then
		// shows a busy machine, not the readers.
		for spinning.offUntil.Load() != 0 && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		before := sess.Stats()
		for range batch {
			if err := mpRoundTrip(st, payload, false); err != nil {
				t.Fatal(err)
			}
		}
		after := sess.Stats()
		polled, woken := after.ReadsPolled-before.ReadsPolled, after.ReadsWoken-before.ReadsWoken
		wakeups := after.WakeupsSent + after.WakeupsReceived - before.WakeupsSent - before.WakeupsReceived
		last = fmt.Sprintf("%d round trips: %d reads polled their data, %d were woken, %d Polling frames", batch, polled, woken, wakeups)
		if polled >= 3*(polled+woken)/4 && polled >= batch/2 && wakeups <= batch/4 {
			return
		}
	}
	t.Fatalf("no batch of round trips had most replies found by the polling reader; the last: %s", last)
}

// pollingReader starts a read of 4 bytes on st, which no reply will come
// for, and returns its result once it polls (a spinner of this process),
// with the time the read began.
func pollingReader(t *testing.T, st *Stream) (<-chan error, time.Time) {
	t.Helper()
	if procs.read(time.Now()); spinning.slots.Load() == 0 {
		t.Skip("nothing spins on a single CPU (spinGovernor)")
	}
	waitUntil(t, "the spinners of earlier sessions stop", peerTimeout, func() bool { return spinning.active.Load() == 0 })
	for range 20 {
		read := make(chan error, 1)
		began := time.Now()
		go func() {
			_, err := io.ReadFull(st, make([]byte, 4))
			read <- err
		}()
		for until := time.Now().Add(maxSpinCooldown + 50*time.Millisecond); time.Now().Before(until); time.Sleep(time.Millisecond) {
			if spinning.active.Load() == 1 {
				return read, began
			}
		}
		// A cool-down (a busy machine): end this read and try again.
		st.SetReadDeadline(time.Now())
		<-read
		st.SetReadDeadline(time.Time{})
	}
	t.Fatal("the reader never polled")
	return nil, time.Time{}
}

// pollSpinConf is a configuration whose readers poll for 10 s.
func pollSpinConf(mode MemMapType, prefix string) *Config {
	conf := mpConfig(mode, prefix)
	conf.ConsumerSpinTime = 10 * time.Second
	return conf
}

// TestPollDeadline: a read deadline that passes while the reader polls
// ends the read with a timeout, long before its spin would end.
func TestPollDeadline(t *testing.T) {
	prefix := shmPrefix(t, "polldl")
	_, sock := pollServer(t, MemMapTypeMemFd, prefix)
	sess := pollDial(t, sock, pollSpinConf(MemMapTypeMemFd, prefix))
	st := pollStream(t, sess, pollEcho)
	read, began := pollingReader(t, st)
	st.SetReadDeadline(began.Add(200 * time.Millisecond))
	select {
	case err := <-read:
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("the read ended with %v, want a timeout", err)
		}
		if took := time.Since(began); took > 3*time.Second {
			t.Fatalf("the read timed out after %v, its deadline was 200ms", took)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a polling reader missed its deadline by seconds")
	}
	st.SetReadDeadline(time.Time{})
	if err := mpRoundTrip(st, []byte("after"), false); err != nil {
		t.Fatalf("the stream after the timeout: %v", err)
	}
}

// TestPollSessionEnds: the session's end, by Close here or by the server
// process's death, ends a polling read with the session's error at once,
// and leaves nothing in /dev/shm.
func TestPollSessionEnds(t *testing.T) {
	for _, how := range []string{"close", "kill"} {
		t.Run(how, func(t *testing.T) {
			prefix := shmPrefix(t, "pollend")
			c, sock := pollServer(t, MemMapTypeMemFd, prefix)
			sess := pollDial(t, sock, pollSpinConf(MemMapTypeMemFd, prefix))
			st := pollStream(t, sess, pollEcho)
			read, _ := pollingReader(t, st)
			ended := time.Now()
			if how == "close" {
				sess.Close()
			} else if err := c.Kill(); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-read:
				if !errors.Is(err, ErrSessionClosed) {
					t.Fatalf("the read ended with %v, want ErrSessionClosed", err)
				}
			case <-time.After(peerTimeout):
				t.Fatal("a polling reader did not see its session end")
			}
			if took := time.Since(ended); took > 2*time.Second {
				t.Errorf("the polling read ended %v after the session", took)
			}
			st.Close()
			sess.Close()
			waitUntil(t, "the session is torn down", peerTimeout, func() bool {
				select {
				case <-sess.loopDone:
					return true
				default:
					return false
				}
			})
			if how == "close" {
				mpWaitGone(t, "after Close", "self", prefix, peerTimeout)
			}
		})
	}
}

// TestPollFault: a fault in the queue region while a reader polls (the
// region's file shrunk under it) ends that session with a memory-fault
// error the reader gets; another session to the same server goes on.
func TestPollFault(t *testing.T) {
	prefix := shmPrefix(t, "pollfault")
	_, sock := pollServer(t, MemMapTypeDevShmFile, prefix)
	other := pollDial(t, sock, mpConfig(MemMapTypeDevShmFile, prefix))
	otherSt := pollStream(t, other, pollEcho)
	if err := mpRoundTrip(otherSt, []byte("before"), false); err != nil {
		t.Fatal(err)
	}
	before, _ := filepath.Glob(prefix + "_*_queue_*")
	sess := pollDial(t, sock, pollSpinConf(MemMapTypeDevShmFile, prefix))
	st := pollStream(t, sess, pollEcho)
	after, _ := filepath.Glob(prefix + "_*_queue_*")
	queue := added(before, after)
	if queue == "" {
		t.Fatalf("no queue file of the new session among %v", after)
	}
	read, _ := pollingReader(t, st)
	if err := os.Truncate(queue, 0); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-read:
		if !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "memory fault") {
			t.Fatalf("the reader got %v, want an error wrapping ErrProtocol naming a memory fault", err)
		}
	case <-time.After(peerTimeout):
		t.Fatal("the polling reader did not return after its queue region shrank")
	}
	if err := mpRoundTrip(otherSt, []byte("after"), false); err != nil {
		t.Fatalf("the other session after the fault: %v", err)
	}
}

// TestPollFloodStarvesNobody: while the server floods one stream, a reader
// polling for another stream's replies hands the flood to its reader and
// still gets every reply, and the flood arrives whole.
func TestPollFloodStarvesNobody(t *testing.T) {
	prefix := shmPrefix(t, "pollflood")
	_, sock := pollServer(t, MemMapTypeMemFd, prefix)
	sess := pollDial(t, sock, mpConfig(MemMapTypeMemFd, prefix))
	flood := pollStream(t, sess, pollFlood)
	echo := pollStream(t, sess, pollEcho)
	const frames = 5000
	var count [4]byte
	binary.BigEndian.PutUint32(count[:], frames)
	if _, err := flood.Write(count[:]); err != nil {
		t.Fatal(err)
	}
	flood.SetReadDeadline(time.Now().Add(60 * time.Second))
	echo.SetReadDeadline(time.Now().Add(60 * time.Second))
	var wg sync.WaitGroup
	var floodErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		want := mpPayload(pollFloodSize, 3)
		got := make([]byte, pollFloodSize)
		for i := range frames {
			if _, err := io.ReadFull(flood, got); err != nil {
				floodErr = fmt.Errorf("flood frame %d: %w", i, err)
				return
			}
			if string(got) != string(want) {
				floodErr = fmt.Errorf("flood frame %d differs", i)
				return
			}
		}
	}()
	payload := mpPayload(64, 2)
	for i := range 2000 {
		if err := mpRoundTrip(echo, payload, i%2 == 0); err != nil {
			t.Fatalf("round trip %d beside the flood: %v", i, err)
		}
	}
	wg.Wait()
	if floodErr != nil {
		t.Fatal(floodErr)
	}
}

package shmipc

import (
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/goshm/shmipc/internal/shm"
)

// Stream is one bidirectional byte stream of a session (the boundaries of
// writes are not preserved). It implements net.Conn and adds zero-copy
// access to shared memory through BufferReader and BufferWriter. Data
// written is sent by Flush (Write flushes by itself).
//
// Closing a stream closes both directions; its methods then return
// ErrStreamClosed, which matches net.ErrClosed. When the peer closes its
// side, data already received stays readable, then reads return io.EOF and
// writes ErrStreamPeerClosed (which does not match net.ErrClosed: the
// stream must still be closed here).
//
// Every stream obtained from OpenStream, AcceptStream or a Listener must be
// closed: until then it may keep the shared memory mapped.
type Stream struct {
	s  *Session
	id uint32

	mu         sync.Mutex // guards reader and the fields below it
	reader     streamReader
	readNotify chan struct{} // signalled on new data, close and deadline changes
	rDeadline  time.Time
	pooled     bool  // in a SessionManager's idle pool; guarded by that pool's lock
	closed     bool  // Close was called
	peerClosed bool  // the peer closed its side
	failErr    error // why this side ended the stream (fail), nil if it did not
	waiting    bool  // a reader waits for data and counts in its session's waiting
	peerGone   bool  // in the session's table and counted in its peerGone; guarded by the session's mu

	reuse atomic.Uint32 // replyOwed and readFailed, for SessionManager.PutBack (poolable)

	wmu        handoverMutex // serialises writers, Flush and Close
	writer     streamWriter
	partSent   int           // of a failed send, what the peer may read: whole fallback frames, or all if queued
	spaceCh    chan struct{} // the writer's, for waiting for room (send.go, shm.SpaceQueues)
	spaceTimer *time.Timer
	wDeadline  atomic.Pointer[time.Time]

	writeClosed  atomic.Bool   // writes fail: closed here or by the peer
	closeOwed    atomic.Uint32 // closeSilent or closeTell: Close left its writer's part to wmu's holder (finishClose)
	fallback     atomic.Bool   // once set, every message goes as FallbackData
	life         atomic.Uint32 // lifeEnded, lifeDropped
	heldFallback atomic.Int64  // received fallback bytes not yet released
	kept         atomic.Uint64 // a received slice kept for the next message (reuse.go)
}

var _ net.Conn = (*Stream)(nil)

// The bits of Stream.reuse.
const (
	replyOwed  = 1 << iota // sent since a read last returned bytes
	readFailed             // a read has failed (a deadline, a close); never cleared
)

// The bits of Stream.life.
const (
	lifeEnded   = 1 << iota // the session has ended (sessionEnded ran)
	lifeDropped             // the stream's references on the regions are gone
)

func (st *Stream) isEnded() bool { return st.life.Load()&lifeEnded != 0 }

func newStream(s *Session, id uint32) *Stream {
	st := &Stream{s: s, id: id, readNotify: make(chan struct{}, 1)}
	st.reader.st = st
	st.writer.st = st
	return st
}

// ID is the stream's id on the wire.
func (st *Stream) ID() uint32 { return st.id }

// Session is the session the stream belongs to.
func (st *Stream) Session() *Session { return st.s }

// BufferReader gives zero-copy access to the received bytes.
func (st *Stream) BufferReader() BufferReader { return (*bufferReader)(st) }

// BufferWriter builds the next message directly in shared memory.
func (st *Stream) BufferWriter() BufferWriter { return (*bufferWriter)(st) }

func (st *Stream) notify() { signalChan(st.readNotify) }

// signalChan signals ch, a channel of capacity 1, unless it holds a signal.
func signalChan(ch chan<- struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// Read reads up to len(p) bytes into p. It copies, and returns the shared
// memory it has read to the buffer region at once, with what earlier
// BufferReader calls returned: their slices become invalid.
func (st *Stream) Read(p []byte) (int, error) {
	st.mu.Lock()
	defer st.mu.Unlock()
	r := &st.reader
	if len(p) == 0 {
		return 0, st.closedErr()
	}
	if err := st.waitReadable(1); err != nil {
		return 0, err
	}
	n := min(len(p), r.unread)
	err := st.s.access(func() error {
		r.copyOut(p[:n])
		r.advance(n)
		return r.release()
	})
	if err != nil {
		return 0, err
	}
	if r.unread > 0 {
		st.notify() // another reader may be waiting
	}
	return n, nil
}

// waitReadable blocks until n bytes are unread; st.mu is held, except
// while it waits. A wake-up goes to one of the goroutines waiting on the
// stream, so one that returns an error passes the wake-up on: the same
// cause ends the others' waits.
func (st *Stream) waitReadable(n int) error {
	err := st.awaitReadable(n)
	st.uncountWaiting()
	if err != nil {
		st.reuse.Or(readFailed)
		st.notify()
	}
	return err
}

// closedErr is the error of a read of nothing; st.mu is held.
func (st *Stream) closedErr() error {
	if st.closed {
		return ErrStreamClosed
	}
	if st.reader.unread == 0 {
		if st.failErr != nil {
			return st.failErr
		}
		if st.s.IsClosed() {
			return st.s.Err()
		}
	}
	return nil
}

// awaitReadable is waitReadable without passing an error on. The reader
// waits on readNotify alone, which data (deliver), closes, the session's
// end and deadline changes signal.
func (st *Stream) awaitReadable(n int) error {
	r := &st.reader
	if n <= 0 {
		return st.closedErr()
	}
	for r.unread < n {
		if st.closed {
			return ErrStreamClosed
		}
		if st.failErr != nil {
			return st.failErr
		}
		if st.peerClosed {
			if r.unread > 0 {
				return io.ErrUnexpectedEOF
			}
			return io.EOF
		}
		if st.s.IsClosed() {
			return st.s.Err() // never io.EOF: it wraps ErrSessionClosed
		}
		deadline := st.rDeadline
		if !deadline.IsZero() && !time.Now().Before(deadline) {
			return ErrTimeout
		}
		st.mu.Unlock()
		polled := st.poll(deadline)
		st.mu.Lock()
		if polled {
			// Its own signal, if any, was for this reader: it is awake.
			select {
			case <-st.readNotify:
			default:
			}
			if r.unread >= n {
				st.s.counters.of(st.id).readsPolled.Add(1)
			}
			continue
		}
		st.countWaiting()
		st.mu.Unlock()
		st.s.wait(st.readNotify, deadline)
		st.mu.Lock()
		if r.unread >= n {
			st.s.counters.of(st.id).readsWoken.Add(1)
		}
	}
	raceAcquireIO()
	return nil
}

// countWaiting counts the reader, about to park, in its session's waiting
// readers: the token's holder serves them (consume, poll), and a loop in
// awaitReader is told. st.mu is held.
func (st *Stream) countWaiting() {
	if !st.waiting {
		st.waiting = true
		st.s.waiting.Add(1)
	}
	signalChan(st.s.readerWaits)
}

// uncountWaiting undoes countWaiting unless a delivery did; st.mu is held.
func (st *Stream) uncountWaiting() {
	if st.waiting {
		st.waiting = false
		st.s.waiting.Add(-1)
	}
}

// holdsReceived reports whether the reader holds slices of the buffer
// region it read in place and has not released.
func (st *Stream) holdsReceived() bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.reader.holdsShared()
}

// deliver hands a received message to the stream. It reports false when
// the stream no longer takes data; the caller then frees the slices.
func (st *Stream) deliver(slices []shm.Segment, heap []byte) bool {
	st.mu.Lock()
	if st.closed || st.peerClosed || st.failErr != nil || st.isEnded() {
		st.mu.Unlock()
		return false
	}
	if heap != nil {
		st.reader.appendHeap(heap)
	} else {
		st.reader.append(slices)
	}
	st.uncountWaiting()
	st.mu.Unlock()
	st.notify()
	return true
}

// failed reports whether this side ended the stream (fail).
func (st *Stream) failed() bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.failErr != nil
}

// takesData reports whether the stream still takes data it receives.
func (st *Stream) takesData() bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	return !st.closed && !st.peerClosed && st.failErr == nil && !st.isEnded()
}

// fail ends the stream for this side's reason err (serveStalled), on the
// receive loop inside an access: what it received and has not handed out
// goes back, the peer is told the stream is closed, and reads and writes
// return err. It stays in its session's table until Close.
func (st *Stream) fail(err error) {
	st.mu.Lock()
	if st.closed || st.failErr != nil {
		st.mu.Unlock()
		return
	}
	st.failErr = err
	tell := !st.peerClosed
	var rerr error
	if !st.reader.exposed() { // what the application holds stays valid
		rerr = st.reader.releaseAll()
	}
	st.mu.Unlock()
	st.writeClosed.Store(true)
	st.notify()
	st.s.conf.logger().Warn("shmipc: stream failed", "role", st.s.role(), "stream", st.id, "err", err)
	if rerr != nil {
		st.s.closeWithError(rerr)
		return
	}
	if tell {
		st.s.sendStreamClose(st.id, true)
	}
}

// peerClose records that the peer closed the stream. The stream will send
// nothing more, so the slice it kept for its next message goes back now.
func (st *Stream) peerClose() {
	st.mu.Lock()
	st.peerClosed = true
	received := st.reader.consumed > 0 || st.reader.unread > 0
	st.mu.Unlock()
	st.s.peerClosedStream(st)
	if f := st.s.onRefused; f != nil && !received {
		f()
	}
	st.writeClosed.Store(true)
	st.notify()
	st.dropKept()
}

// LocalAddr returns the local address of the session's connection.
func (st *Stream) LocalAddr() net.Addr { return st.s.LocalAddr() }

// RemoteAddr returns the remote address of the session's connection.
func (st *Stream) RemoteAddr() net.Addr { return st.s.RemoteAddr() }

// SetDeadline sets both the read and the write deadline.
func (st *Stream) SetDeadline(t time.Time) error {
	st.SetReadDeadline(t)
	return st.SetWriteDeadline(t)
}

// SetReadDeadline sets the time after which blocked and future reads fail
// with an error that satisfies net.Error with Timeout() == true. A zero time
// means no deadline.
func (st *Stream) SetReadDeadline(t time.Time) error {
	st.mu.Lock()
	st.rDeadline = t
	st.mu.Unlock()
	st.notify()
	return nil
}

// SetWriteDeadline sets the time after which writes and flushes fail with a
// timeout error, including one waiting for space in the IO queue or the
// buffer region, or sending fallback data over the socket. A zero time
// means no deadline: a write then waits at most WriteSpaceTimeout for space
// and ConnectionWriteTimeout for the socket. As for every net.Conn, it
// applies to writes already blocked: one waiting for space looks at the
// deadline before each pause (at most a millisecond apart). A fallback
// frame being written keeps the deadline it started with.
//
// Fallback data (see Config.FallbackWhenFull) goes over the socket in
// frames. A deadline that passes before a frame starts fails the write and
// leaves the session usable; frames already sent stay sent, so the message
// may arrive in part. One that passes in the middle of a frame ends the
// session, since the peer can no longer find where frames start: the write
// fails with a timeout error, and the session's error says the frame was
// cut short.
func (st *Stream) SetWriteDeadline(t time.Time) error {
	st.wDeadline.Store(&t)
	return nil
}

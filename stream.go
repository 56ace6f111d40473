package shmipc

import (
	"errors"
	"io"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// Stream is one bidirectional byte stream of a session. It implements
// net.Conn and adds zero-copy access to shared memory through BufferReader
// and BufferWriter.
//
// A stream is a byte stream: the boundaries of writes are not preserved.
// Data written is sent by Flush (Write flushes by itself).
//
// Closing a stream closes both directions. When the peer closes its side,
// data already received stays readable, then reads return io.EOF, and
// writes return ErrStreamClosed.
//
// Every stream obtained from OpenStream, AcceptStream or a Listener must be
// closed: until then it may keep slices of shared memory, and with them the
// mapping, alive.
type Stream struct {
	s  *Session
	id uint32

	mu         sync.Mutex // guards reader and the fields below it
	reader     streamReader
	readNotify chan struct{} // signalled on new data, close and deadline changes
	sleeping   atomic.Bool   // the reader sleeps on readNotify (lead.go)
	notified   atomic.Uint64 // notify calls, each counted before it signals
	sleptAt    atomic.Uint64 // notified when the reader last began to sleep
	delivered  atomic.Uint64 // messages handed to the stream (lead.go)
	handWakes  atomic.Uint32 // wake-ups of a paired session's reader (awaitReadable)
	bigIn      atomic.Bool   // a paired session delivered a large message since the writer last yielded (writerTurn)
	yieldedAt  atomic.Int64  // when the stream of a paired session last yielded for fairness (unix ns)
	rDeadline  time.Time
	// A reader waiting in Read on a paired session offers its buffer to
	// the peer's writer (copyToReader): offered is that buffer, offerN how
	// much the writer copied into it; readWaiters counts the goroutines in
	// awaitReadable.
	offered     []byte
	offerN      int
	readWaiters int
	pooled      bool // in a SessionManager's idle pool; guarded by that pool's lock
	closed      bool // Close was called
	peerClosed  bool // the peer closed its side
	// peerGone: the stream is in its session's table and counted in the
	// session's peerGone (the peer closed it). Guarded by the session's mu.
	peerGone bool

	wmu    handoverMutex // serialises writers, Flush and Close
	writer streamWriter
	// partSent is how much of the message being written the peer may
	// read although the send failed: fallback frames, or all on the queue.
	partSent int
	// The writer's, for waiting for room (send.go, space_queue.go).
	spaceCh    chan struct{}
	spaceTimer *time.Timer
	wDeadline  atomic.Pointer[time.Time]

	writeClosed  atomic.Bool  // writes fail: closed here or by the peer
	closeOwed    atomic.Bool  // Close left its writer's part to the goroutine holding wmu (finishClose)
	closeTells   bool         // whether that part tells the peer; written before closeOwed is set
	fallback     atomic.Bool  // once set, every message goes as FallbackData
	refDropped   atomic.Bool  // the stream's references on the regions are gone
	ended        atomic.Bool  // the session has ended (sessionEnded ran)
	heldFallback atomic.Int64 // received fallback bytes not yet released
	// readWant is the count the stream's waiting reader needs unread
	// (awaitReadable; 0 while none waits; the largest while several wait)
	// and readShort how many bytes it still lacks; both are written under
	// mu and read by the receive loop, which takes fallback data for a
	// waiting reader beyond the bounds that only it could make room under
	// (waitFallbackRoom).
	readWant  atomic.Int64
	readShort atomic.Int64
	scanning  bool          // a reader waits for a delimiter (waitScanning); under mu
	awaiting  atomic.Bool   // sent since data last arrived: a reply is likely on its way
	kept      atomic.Uint64 // a received slice kept for the next message (reuse.go)
	// peerRefs is the paired peer session (pairLocal) whose queue and
	// buffer regions the stream holds references on, so that its writer
	// drains that session's queue (drainForPeer) without taking any; nil
	// when it holds none.
	peerRefs *Session
	// directScratch is the writer's to read its message's chain into when
	// it hands the message over itself (deliverDirect); guarded by wmu.
	directScratch []segment
}

var _ net.Conn = (*Stream)(nil)

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

func (st *Stream) notify() {
	st.notified.Add(1)
	select {
	case st.readNotify <- struct{}{}:
	default:
	}
	if st.s.sock.blocked.Load() == st {
		st.s.kick() // its reader is in a socket read (lead.go)
	}
}

// Read reads up to len(p) bytes into p. It copies, so it returns the
// shared memory it has read to the buffer region at once; that also releases
// what earlier BufferReader calls returned, so their slices are invalid
// afterwards.
func (st *Stream) Read(p []byte) (int, error) {
	st.mu.Lock()
	defer st.mu.Unlock()
	r := &st.reader
	if len(p) == 0 {
		return 0, st.closedErr()
	}
	offered := st.offer(p)
	err := st.waitOffered(1, offered)
	if offered {
		n := st.offerN
		st.offered, st.offerN = nil, 0
		if n > 0 {
			r.consumed += uint64(n)
			return n, nil // copied in by the peer's writer (copyToReader)
		}
	}
	if err != nil {
		return 0, err
	}
	n := min(len(p), r.unread)
	err = st.s.access(func() error {
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

// Within one process a writer hands its message over on its own processor
// (the reader runs there next), so the two ends of a stream stay on one
// processor, and so do the slices they pass back and forth. Left alone, a
// pair handing messages back and forth would keep its processor until the
// runtime preempts it, 10 ms later, and the other streams there would wait.
// So a paired stream lets the other goroutines run now and then
// (runtime.Gosched): its reader after every handTurn wake-ups, and its
// writer as it begins a message of handTurnBytes or more, or the first
// after it received one (writerTurn); each at most once per handTurnTime.
//
// A yield puts the goroutine on the Go runtime's global run queue, from
// which either processor may take it: the stream, and its data, may move to
// the other core. Without the time bound, the readers of 8 streams of 4 KB
// or 256 KB in one process yielded every 50-75 µs each, and on the 2-vCPU
// AMD EPYC VM in the state where data moving between its two cores costs
// 3-4 times as much (README, Performance), 8 streams of 4 KB took 1.6
// times as long per round trip as in the other state, and of 256 KB 3.2
// times (22 µs against 7). With handTurnTime, in that state: 4 KB 831-860
// ns against 935-949 ns, 256 KB 15.3-15.6 µs against 21.3-22.3 µs; in the
// other state 4 KB 550-563 ns against 581-605 ns and 256 KB 5.55 µs against
// 7.0-7.1 µs (BenchmarkPingPong, 0.3 s runs, three and two alternating
// rounds). The slowest of 8 streams then made 0.88-0.94 of the fastest
// one's round trips in such a run, against 0.95-0.99; a bound of 1 ms went
// down to 0.56-0.72, and of 50 µs changed nothing.
//
// Large messages yield where moving costs least: a writer beginning a
// message while its stream holds nothing it received has nothing in its
// processor's caches that the other processor would have to fetch, and
// the slice it then writes into comes from the processor it runs on
// (local_slices.go). When the reader yielded as it woke to a large
// message instead, a move took that message with it. Against that, in
// alternating 0.4 s runs of BenchmarkPingPong: 8 streams of 1 MB took
// 20.4-22.0 µs per round trip in the dear state against 25.7-27.8 µs
// (three runs each, with the writer yielding for messages of handTurnBytes
// or more only, the first form of this); 8 of 4 MB 73-84 µs against
// 113-141 µs in either state, and 64 of 256 KB 3.8-6.3 µs against
// 6.9-7.2 µs in the cheap one (eleven and seven runs), with the slowest
// stream at 0.85-0.98 of the fastest either way.
const (
	handTurn      = 16
	handTurnBytes = 256 << 10
	handTurnTime  = 200 * time.Microsecond
)

// writerTurn lets the other goroutines run as a writer of a paired stream
// begins a message of n bytes, if it is large or follows a large one the
// stream received, the stream holds nothing it received, and it has not
// yielded for handTurnTime (see above).
func (st *Stream) writerTurn(n int) {
	if st.peerRefs == nil || n < handTurnBytes && !st.bigIn.Load() {
		return
	}
	now := time.Now().UnixNano()
	if now-st.yieldedAt.Load() < int64(handTurnTime) || st.holdsReceived() {
		return
	}
	st.bigIn.Store(false)
	st.yieldedAt.Store(now)
	runtime.Gosched()
}

// waitScanning is waitReadable for a reader looking for a delimiter, which
// waits for one byte more each time: it has no count of its own, so the
// fallback bounds hold for it as for data nobody reads (wantBytes).
func (st *Stream) waitScanning(n int) error {
	st.scanning = true
	err := st.waitReadable(n)
	st.scanning = false
	return err
}

// waitReadable blocks until n bytes are unread. It is called and returns
// with st.mu held, which it does not hold while it waits or polls.
//
// Several goroutines may wait on one stream, and a wake-up goes to one of
// them: one that returns with an error (the stream or session closed, the
// data ended, the deadline passed) passes it on, as the same cause ends
// the others' waits.
func (st *Stream) waitReadable(n int) error { return st.waitOffered(n, false) }

// waitOffered is waitReadable for a reader whose buffer may be the
// stream's offer (offered, Stream.offer): it also returns once the peer's
// writer has copied into that buffer.
func (st *Stream) waitOffered(n int, offered bool) error {
	err := st.awaitReadable(n, offered)
	if err != nil {
		st.notify()
	}
	return err
}

// closedErr is the error of a read of nothing: nil, unless the stream is
// closed (ErrStreamClosed) or its session has ended with nothing left to
// read (the session's error). st.mu is held.
func (st *Stream) closedErr() error {
	if st.closed {
		return ErrStreamClosed
	}
	if st.reader.unread == 0 && st.s.IsClosed() {
		return st.s.Err()
	}
	return nil
}

// awaitReadable is waitOffered without passing an error on.
func (st *Stream) awaitReadable(n int, offered bool) error {
	r := &st.reader
	if n <= 0 {
		return st.closedErr()
	}
	st.readWaiters++
	defer func() {
		if st.readWaiters--; st.readWaiters == 0 && st.readWant.Load() != 0 {
			st.readWant.Store(0)
			st.readShort.Store(0)
		}
	}()
	for r.unread < n {
		if st.offerN > 0 {
			if offered {
				return nil
			}
			// Another reader's buffer was filled: let that reader take it
			// before this one waits, so that this one cannot take the
			// wake-up meant for it.
			st.mu.Unlock()
			runtime.Gosched()
			st.mu.Lock()
			continue
		}
		if st.closed {
			return ErrStreamClosed
		}
		ended := st.peerClosed
		var err error = io.EOF
		if !ended && st.s.IsClosed() {
			ended, err = true, st.s.Err()
		}
		if ended {
			if r.unread > 0 && err == io.EOF {
				return io.ErrUnexpectedEOF
			}
			return err
		}
		deadline := st.rDeadline
		if !deadline.IsZero() && !time.Now().Before(deadline) {
			return ErrTimeout
		}
		if !st.scanning {
			st.wantBytes(n)
		}
		st.mu.Unlock()
		// Poll only while a reply is awaited: a reader that waits for the
		// peer to start something (a server between requests) would spin
		// for nothing, on a core others need. And only in turn with the
		// session's other readers (pollTurn).
		s := st.s
		awaiting := st.awaiting.Load()
		paired := s.localPeerSession.Load() != nil    // its peer delivers (drainForPeer)
		counted := awaiting && s.localPeer && !paired // only turnDue uses the count
		if counted {
			s.contenders.Add(1)
		}
		polled := !paired && awaiting && st.pollTurn() && s.pollFor(st.readNotify)
		if !polled {
			// The count serves the socket's lending and the polling turns,
			// which a paired session's readers take no part in; an atomic
			// pair per wait on a line both processors write is what it
			// would cost them.
			if !paired {
				s.sleepers.Add(1)
			}
			if !deadline.IsZero() || paired || !s.lead(st) {
				st.sleptAt.Store(st.notified.Load())
				st.sleeping.Store(true)
				s.wait(st.readNotify, deadline)
				st.sleeping.Store(false)
				if paired {
					if st.handWakes.Add(1)%handTurn == 0 {
						if now := time.Now().UnixNano(); now-st.yieldedAt.Load() >= int64(handTurnTime) {
							st.yieldedAt.Store(now)
							runtime.Gosched()
						}
					}
				}
			}
			if !paired {
				s.sleepers.Add(-1)
			}
		}
		if counted {
			s.contenders.Add(-1)
		}
		st.mu.Lock()
	}
	raceAcquireIO()
	return nil
}

// wantBytes records, under mu, that a reader is about to wait until n
// bytes are unread, for the receive loop, which may take fallback data
// beyond the bounds for it (waitFallbackRoom), and tells the loop to look
// again if it is holding some back.
func (st *Stream) wantBytes(n int) {
	old := st.readWant.Load()
	want := max(old, int64(n))
	short := want - int64(st.reader.unread)
	if want == old && st.readShort.Load() == short {
		return
	}
	st.readWant.Store(want)
	st.readShort.Store(short)
	if st.s.fallbackHeld.Load() > 0 {
		select {
		case st.s.fallbackRoom <- struct{}{}:
		default:
		}
	}
}

// holdsReceived reports whether the stream's reader holds received slices
// of the buffer region that it read in place and has not released.
func (st *Stream) holdsReceived() bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.reader.holdsShared()
}

// deliver hands a received message to the stream. It reports false when
// the stream no longer takes data; the caller then frees the slices.
func (st *Stream) deliver(slices []segment, heap []byte) bool {
	st.mu.Lock()
	if st.closed || st.peerClosed || st.ended.Load() {
		st.mu.Unlock()
		return false
	}
	if heap != nil {
		st.reader.appendHeap(heap)
	} else {
		st.reader.append(slices)
	}
	if want := st.readWant.Load(); want != 0 {
		st.readShort.Store(max(0, want-int64(st.reader.unread)))
	}
	st.mu.Unlock()
	st.delivered.Add(1)
	st.awaiting.Store(false)
	st.notify()
	return true
}

// sent records a message sent. A stream that sends after data arrived is
// likely to get a reply: a reader waiting on it is woken so that it polls
// for that reply (pollFor) rather than sleeping until it is handed over.
// It is not woken when it could not poll now (no spinning slot for it, or
// spinning is cooling down): waking it would only put it to sleep again.
func (st *Stream) sent() {
	if !st.awaiting.Load() && !st.awaiting.Swap(true) && st.s.mayPoll() {
		st.notify()
	}
}

// peerClose records that the peer closed the stream. The stream will send
// nothing more, so the slice it kept for its next message goes back now.
func (st *Stream) peerClose() {
	st.mu.Lock()
	st.peerClosed = true
	st.mu.Unlock()
	st.s.peerClosedStream(st)
	if f := st.s.onRefused; f != nil && st.delivered.Load() == 0 {
		f()
	}
	st.writeClosed.Store(true)
	st.notify()
	st.dropKept()
}

// Write writes p as one message and flushes it. On error n counts the
// bytes of p the peer may read: a message going over the socket in
// fallback frames (one larger than the buffer region can give) can be cut
// short by Close, the write deadline or a failed socket write after some
// of its frames went out. A message that reached the IO queue counts as
// written even if the wake-up after it failed: with the peer's connection
// closed just then, Write returns len(p) and nil (as with bytes in a
// socket buffer, it may or may not have read it; the writes after it fail
// with an error wrapping ErrPeerClosed), otherwise len(p) and the error.
func (st *Stream) Write(p []byte) (int, error) {
	st.lockWriter()
	defer st.unlockWriter()
	if err := st.writeDeadlineErr(); err != nil {
		return 0, err
	}
	before := st.writer.size // left by BufferWriter calls: sent first
	if before == 0 {
		st.writerTurn(len(p))
	}
	if before == 0 && st.copyToReader(p) {
		return len(p), nil
	}
	st.partSent = 0
	err := st.s.access(func() error {
		_, err := writeTo(&st.writer, p)
		if err == nil {
			err = st.flushLocked()
		}
		if err != nil {
			_ = st.writer.discard()
		}
		return err
	})
	if err != nil {
		// What went out: frames written whole, or the message on the queue.
		return min(max(st.partSent-before, 0), len(p)), err
	}
	return len(p), nil
}

// Flush sends the message built with BufferWriter (and anything Write left).
// endStream has no effect on the wire; it is accepted for compatibility.
// On error the message is discarded.
func (st *Stream) Flush(endStream bool) error {
	st.lockWriter()
	defer st.unlockWriter()
	return st.s.access(st.flushLocked)
}

func (st *Stream) writeDeadlineErr() error {
	if d := st.wDeadline.Load(); d != nil && !d.IsZero() && !time.Now().Before(*d) {
		return ErrTimeout
	}
	return nil
}

// flushLocked sends the pending message; st.wmu is held and it runs inside
// an access.
func (st *Stream) flushLocked() error {
	w := &st.writer
	if w.size == 0 {
		if w.closedUnsent {
			return ErrStreamClosed
		}
		if err := w.discard(); err != nil {
			return err
		}
		return w.usable() // nothing to send, but not on a closed stream either
	}
	raceReleaseIO()
	if err := w.usable(); err != nil {
		_ = w.discard()
		return err
	}
	if err := st.writeDeadlineErr(); err != nil {
		_ = w.discard()
		return err
	}
	if w.heap || st.fallback.Load() {
		return st.sendFallback()
	}
	return st.sendShm()
}

// sendShm links the message's slices into a chain and publishes it on the
// queue, retrying while the queue is full (PROTOCOL.md §5.6).
func (st *Stream) sendShm() error {
	s, w := st.s, &st.writer
	// Drop empty slices first, so that a failure below frees each slice once.
	kept := w.segs[:0]
	var empty []segment
	for _, seg := range w.segs {
		if seg.n == 0 {
			empty = append(empty, seg)
		} else {
			kept = append(kept, seg)
		}
	}
	clear(w.segs[len(kept):])
	w.segs = kept
	if err := s.freeSegments(empty); err != nil {
		_ = w.discard()
		return err
	}
	var root uint32
	for i := len(w.segs) - 1; i >= 0; i-- {
		s.buf.linkSlice(w.segs[i].off, w.segs[i].n, root)
		root = w.segs[i].off
	}
	c := s.counters.of(st.id)
	var sent bool
	var err error
	if peer := st.directPeer(); peer != nil {
		if err = s.sendable(); err == nil && peer.deliverDirect(st.id, root, &st.directScratch) {
			sent = true
			c.wakeupsSaved.Add(1) // handed over: no wake-up needed
		}
	}
	if !sent && err == nil {
		sent, err = s.putElem(queueElem{id: st.id, offset: root, status: statusOpened}, st)
	}
	if !sent {
		_ = w.discard()
		return err
	}
	c.messagesOut.Add(1)
	c.bytesOut.Add(uint64(w.size))
	st.sent()
	st.partSent = w.size // on the queue: the peer may read it, whatever err says (Write)
	w.reset()
	if errors.Is(err, ErrPeerClosed) {
		// Only the wake-up found the peer's socket closed: a peer that
		// polls its queue may have read it first, so it counts as sent,
		// as bytes in a socket buffer do; the next write fails (sendable).
		return nil
	}
	return err
}

// queueFullGiveUp tells a writer waiting for space to stop: the stream was
// closed, or its write deadline passed.
func (st *Stream) queueFullGiveUp() error {
	if err := st.s.sendable(); err != nil {
		return err
	}
	if st.writeClosed.Load() {
		return ErrStreamClosed
	}
	return st.writeDeadlineErr()
}

// sendFallback copies the message into FallbackData frames and frees its
// slices. From then on the stream always sends fallback data, so its bytes
// cannot be overtaken by shared-memory messages (PROTOCOL.md §6.5).
func (st *Stream) sendFallback() error {
	s, w := st.s, &st.writer
	st.fallback.Store(true)
	limit := fallbackFrameData // whatever the peer's MaxFallbackFrameSize
	var deadline time.Time     // bounds the socket writes too
	if d := st.wDeadline.Load(); d != nil {
		deadline = *d
	}
	var frame [][]byte
	size, sent := 0, 0
	var err error
	for i := 0; i < len(w.segs) && err == nil; i++ {
		data := w.segs[i].data[:w.segs[i].n]
		for len(data) > 0 && err == nil {
			c := min(len(data), limit-size)
			frame = append(frame, data[:c])
			size += c
			data = data[c:]
			if size == limit {
				if err = s.sendFallbackFrame(st.id, frame, deadline); err == nil {
					sent += size
				}
				frame, size = frame[:0], 0
				if err == nil && st.writeClosed.Load() {
					err = ErrStreamClosed // closed meanwhile: the rest is not sent
				}
			}
		}
	}
	if err == nil && size > 0 {
		if err = s.sendFallbackFrame(st.id, frame, deadline); err == nil {
			sent += size
		}
	}
	if sent > 0 {
		st.sent()
		c := s.counters.of(st.id)
		c.bytesOut.Add(uint64(sent))
		c.fallbackBytesOut.Add(uint64(sent))
	}
	if err == nil {
		c := s.counters.of(st.id)
		c.messagesOut.Add(1)
		c.fallbackMessagesOut.Add(1)
	} else {
		st.partSent = sent
	}
	if derr := w.discard(); err == nil {
		err = derr
	}
	return err
}

// Close closes the stream in both directions. If the peer had not closed
// it, the peer is told (PROTOCOL.md §6.4). Slices returned by reads and
// Reserve become invalid. Close is idempotent.
//
// Close does not wait for a Write, Flush or netpoll write in progress on the
// stream: that call fails with ErrStreamClosed at its next step, and it
// discards its message, tells the peer and lets go of the region as it
// returns. A fallback frame it is writing cannot be cut short without
// making the session's connection unusable, so the frame goes out whole
// and the peer is told after it; the rest of the message is not sent.
func (st *Stream) Close() error {
	first, tellPeer, err := st.closeReader()
	if !first {
		return nil
	}
	st.writeClosed.Store(true)
	st.notify()
	st.closeTells = tellPeer
	st.closeOwed.Store(true)
	if werr := st.finishClose(); err == nil {
		err = werr
	}
	return err
}

// finishClose does the writer's part of Close, unless a writer holds wmu:
// then that writer does it as it lets go (unlockWriter, handoverMutex).
func (st *Stream) finishClose() error {
	for st.closeOwed.Load() {
		if !st.wmu.tryLockOrLeave() {
			return nil
		}
		if !st.closeOwed.Swap(false) {
			st.wmu.Unlock()
			continue
		}
		if len(st.writer.segs) > 0 {
			st.writer.closedUnsent = true
		}
		err := st.s.access(st.writer.discard)
		st.wmu.Unlock()
		// The close goes out before the stream leaves the table: a
		// client's OpenStream counts the streams in it against
		// Config.MaxStreams, and the stream it opens next must not reach
		// the server before this close does.
		if st.closeTells {
			_ = st.s.access(func() error {
				st.s.sendStreamClose(st.id, st.fallback.Load())
				return nil
			})
		}
		st.s.forgetStream(st, st.closeTells)
		st.dropRef()
		return err
	}
	return nil
}

// closeReader marks the stream closed and frees what it received. first
// reports whether this was the first Close; tellPeer whether the peer still
// expects a close.
func (st *Stream) closeReader() (first, tellPeer bool, err error) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.closed {
		return false, false, nil
	}
	st.closed = true
	return true, !st.peerClosed, st.s.access(st.reader.releaseAll)
}

// sessionEnded is called for each stream when its session ends. Unread data
// stays readable unless the session was closed locally. The stream lets go
// of the mapping as soon as it holds nothing of it (letGo); while it holds
// data still unread or handed out, Close does it.
//
// A message handed over directly by a paired session's writer
// (deliverDirect), which the end of the session does not wait for, either
// arrived before the mark, set under mu, and is what came before the end,
// or finds the stream ended and goes back to its deliverer (deliver).
func (st *Stream) sessionEnded(local bool) {
	st.releaseUnexposed(local)
	st.writeClosed.Store(true)
	st.notify()
	st.letGo()
}

// letGo drops the stream's reference on the buffer region if its session
// has ended and it holds nothing of the region: no received data and no
// unsent message. A writer busy meanwhile does it when it is done
// (unlockWriter), so that a stream whose last Write overlapped the end of
// its session does not keep the region mapped until Close.
func (st *Stream) letGo() {
	if st.refDropped.Load() || !st.ended.Load() {
		return
	}
	st.mu.Lock()
	idle := !st.reader.exposed() && st.reader.unread == 0
	st.mu.Unlock()
	if idle && st.wmu.tryLockOrLeave() {
		if len(st.writer.segs) == 0 {
			st.dropRef()
		}
		st.wmu.Unlock()
		if st.closeOwed.Load() {
			_ = st.finishClose() // a Close that found wmu held by this look
		}
	}
}

// lockWriter serialises writers, Flush and Close.
func (st *Stream) lockWriter() { st.wmu.Lock() }

// unlockWriter ends what lockWriter began, and does what was left to the
// writer meanwhile (handoverMutex): the rest of a Close, and, if the
// session ended, dropping the stream's reference (letGo). The session
// marks the stream ended before it tries the lock, and the writer unlocks
// before it looks at the mark, so one of the two sees the other.
func (st *Stream) unlockWriter() {
	st.wmu.Unlock()
	if st.closeOwed.Load() {
		_ = st.finishClose() // the caller's own error stands
	}
	if st.ended.Load() {
		st.letGo()
	}
}

// releaseUnexposed marks the stream ended, and frees the received data if
// the session was closed locally and nothing of it has been handed out.
func (st *Stream) releaseUnexposed(local bool) {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.ended.Store(true) // before letGo's look at the writer: see unlockWriter
	if local && !st.reader.exposed() {
		_ = st.s.access(st.reader.releaseAll)
	}
}

func (st *Stream) dropRef() {
	if st.refDropped.CompareAndSwap(false, true) {
		st.dropKept()
		if st.peerRefs != nil {
			if err := st.s.access(st.s.buf.localClose); err != nil {
				st.s.closeWithError(err)
			}
		}
		st.s.buf.region.release()
		st.s.queueRegion.release()
		if p := st.peerRefs; p != nil {
			p.buf.region.release()
			p.queueRegion.release()
		}
	}
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
// buffer region, and one sending fallback data over the socket. A zero time
// means no deadline; a write then waits for at most WriteSpaceTimeout for
// space and ConnectionWriteTimeout for the socket. The deadline a write
// starts with applies to it.
//
// Fallback data (see Config.FallbackWhenFull) goes over the socket in
// frames. A deadline that passes before a frame starts fails the write and
// leaves the session usable; frames already sent stay sent, so a message
// sent in several frames may arrive in part. A deadline that passes in the
// middle of a frame leaves the socket unusable, since the peer can no longer
// find where frames start: the write fails with a timeout error and the
// session ends (its error says the frame was cut short).
func (st *Stream) SetWriteDeadline(t time.Time) error {
	st.wDeadline.Store(&t)
	return nil
}

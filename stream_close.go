package shmipc

import "cmp"

// Close closes the stream in both directions. If the peer had not closed
// it, the peer is told (docs/protocol.md §9.4). Slices returned by reads and
// Reserve become invalid. Close is idempotent.
//
// Close does not wait for a write in progress on the stream: that call
// fails with ErrStreamClosed at its next step, and discards its message,
// tells the peer and lets go of the region as it returns. A fallback frame
// being written goes out whole (cutting it would break the connection) and
// the peer is told after it; the rest of the message is not sent.
func (st *Stream) Close() error {
	first, tellPeer, err := st.closeReader()
	if !first {
		return nil
	}
	st.writeClosed.Store(true)
	st.notify()
	owed := uint32(closeSilent)
	if tellPeer {
		owed = closeTell
	}
	st.closeOwed.Store(owed)
	return cmp.Or(err, st.finishClose())
}

// What Close left to its writer's part (Stream.closeOwed).
const (
	closeSilent = 1
	closeTell   = 2
)

// finishClose does the writer's part of Close, unless a writer holds wmu:
// then that writer does it as it lets go (unlockWriter, handoverMutex).
func (st *Stream) finishClose() error {
	for st.closeOwed.Load() != 0 {
		if !st.wmu.tryLockOrLeave() {
			return nil
		}
		owed := st.closeOwed.Swap(0)
		if owed == 0 {
			st.wmu.Unlock()
			continue
		}
		tell := owed == closeTell
		if len(st.writer.segs) > 0 {
			st.writer.closedUnsent = true
		}
		err := st.s.access(st.writer.discard)
		st.wmu.Unlock()
		// The close goes out before the stream leaves the table, which
		// OpenStream counts against Config.MaxStreams: the next stream
		// opened must not reach the server before this close.
		if tell {
			_ = st.s.access(func() error {
				st.s.sendStreamClose(st.id, st.fallback.Load())
				return nil
			})
		}
		st.s.forgetStream(st, tell || st.failed())
		st.dropRef()
		return err
	}
	return nil
}

// closeReader marks the stream closed and frees what it received; first says
// this was the first Close, tellPeer that the peer still expects a close.
func (st *Stream) closeReader() (first, tellPeer bool, err error) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.closed {
		return false, false, nil
	}
	st.closed = true
	return true, !st.peerClosed && st.failErr == nil, st.s.access(st.reader.releaseAll)
}

// sessionEnded is called for each stream when its session ends. Unread data
// stays readable unless the session was closed locally and nothing of it
// was handed out. The stream lets go of the mapping now if it holds nothing
// of it (letGo), else at Close.
func (st *Stream) sessionEnded(local bool) {
	st.mu.Lock()
	st.life.Or(lifeEnded) // before letGo's look at the writer: see unlockWriter
	if local && !st.reader.exposed() {
		_ = st.s.access(st.reader.releaseAll)
	}
	st.mu.Unlock()
	st.writeClosed.Store(true)
	st.notify()
	st.letGo()
}

// letGo drops the stream's references on the regions if its session has
// ended and it holds nothing of them: no received data and no unsent
// message. A writer busy meanwhile does it when done (unlockWriter), lest a
// Write overlapping the session's end keep the region mapped until Close.
func (st *Stream) letGo() {
	if st.life.Load()&lifeDropped != 0 || !st.isEnded() {
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
		if st.closeOwed.Load() != 0 {
			_ = st.finishClose() // a Close that found wmu held by this look
		}
	}
}

// lockWriter serialises writers, Flush and Close.
func (st *Stream) lockWriter() { st.wmu.Lock() }

// unlockWriter unlocks and does what was left to the writer meanwhile
// (handoverMutex): the rest of a Close, and letGo if the session ended.
// The session marks the stream ended before it tries the lock, and the
// writer unlocks before it looks at the mark, so one sees the other.
func (st *Stream) unlockWriter() {
	st.wmu.Unlock()
	if st.closeOwed.Load() != 0 {
		_ = st.finishClose() // the caller's own error stands
	}
	if st.isEnded() {
		st.letGo()
	}
}

func (st *Stream) dropRef() {
	if st.life.Or(lifeDropped)&lifeDropped == 0 {
		st.dropKept()
		st.s.buf.Region().Release()
		st.s.queueRegion.Release()
	}
}

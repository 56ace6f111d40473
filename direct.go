package shmipc

// Copying a Write straight into the buffer of the peer's Read, when the
// peer is a session of this process (paired, see pairLocal).
//
// Through Read and Write a message is copied twice: into shared memory by
// the writer and out of it by the reader. Between two processes that is
// what any transport does, since neither can write into the other's heap.
// Within one process the writer can copy into the very buffer the reader
// waits with, as net.Pipe does, and skip shared memory: a reader waiting in
// Read on a paired session's stream, with nothing unread, offers its buffer
// (Stream.offer), and the peer's writer, if the whole of p fits, copies p
// into it and wakes the reader (copyToReader). The reader returns what was
// copied. Otherwise the message goes the usual way.
//
// The rules that keep the order of what arrives are those of a message
// handed over directly (Session.deliverDirect): nothing published on the
// queue before may still be waiting to take effect. The stream's own
// earlier messages either took effect (the reader has nothing unread, and
// the queue is empty) or were read already. A reader that stops waiting (a
// deadline, a close) takes its offer back under the stream's lock, under
// which the writer copies, so it never returns while its buffer is written.
//
// Only one reader's buffer is on offer at a time, and only while it is the
// stream's only waiting reader: a wake-up goes to one waiter, and the data
// copied in is that reader's alone.

// offer offers p, the buffer of a reader about to wait in Read, to the
// peer's writer. It reports whether it did; the caller then takes the offer
// back (st.offered = nil) when it stops waiting. st.mu is held.
func (st *Stream) offer(p []byte) bool {
	if st.readWaiters != 0 || st.offered != nil || st.reader.unread != 0 ||
		st.s.localPeerSession.Load() == nil || st.reader.holdsShared() {
		return false
	}
	st.offered = p
	return true
}

// copyToReader copies p into the offered buffer of the reader of st's peer
// stream, if the peer session is paired with st's and takes messages
// directly now (see above). It reports whether it did; otherwise nothing
// happened and p goes as a message. st.wmu is held.
func (st *Stream) copyToReader(p []byte) bool {
	if len(p) == 0 || st.fallback.Load() {
		return false
	}
	peer := st.directPeer()
	if peer == nil || st.writer.usable() != nil {
		return false
	}
	done := false
	err := peer.access(func() error {
		if peer.IsClosed() || !peer.recvQ.isEmpty() || peer.cons.token.Load() || peer.closesPending.Load() {
			return nil
		}
		if pst := peer.indexed(st.id); pst != nil {
			done = pst.fillOffer(p)
		}
		return nil
	})
	if err != nil {
		peer.closeWithError(err) // the peer's error: the writer's session goes on
		return false
	}
	if !done {
		return false
	}
	out, in := st.s.counters.of(st.id), peer.counters.of(st.id)
	out.messagesOut.Add(1)
	out.bytesOut.Add(uint64(len(p)))
	out.wakeupsSaved.Add(1)
	out.copiedToReader.Add(1)
	in.messagesIn.Add(1)
	in.bytesIn.Add(uint64(len(p)))
	st.sent()
	return true
}

// fillOffer copies p into the buffer its reader offered, if the reader
// still waits alone with nothing unread and the buffer holds all of p, and
// wakes it.
func (st *Stream) fillOffer(p []byte) bool {
	st.mu.Lock()
	if st.offered == nil || st.offerN != 0 || len(st.offered) < len(p) || st.readWaiters != 1 ||
		st.reader.unread != 0 || st.closed || st.peerClosed || st.ended.Load() {
		st.mu.Unlock()
		return false
	}
	st.offerN = copyCached(st.offered, p)
	if len(p) >= handTurnBytes {
		st.bigIn.Store(true) // its writer yields before the next message (writerTurn)
	}
	st.mu.Unlock()
	st.delivered.Add(1)
	st.awaiting.Store(false)
	st.notify()
	return true
}

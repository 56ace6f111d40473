package shmipc

import (
	"errors"
	"io"
)

// Serve accepts streams on l and calls handler for each one in a new
// goroutine, until l is closed; it then returns ErrListenerClosed (never
// nil, as http.Serve). It does not wait for running handlers: after Close
// they serve their streams until those end; after CloseAll their reads and
// writes fail.
//
// The handler owns its stream while it runs; Serve closes it when the
// handler returns, so the handler must not keep it, nor slices read from it.
func (l *Listener) Serve(handler func(st *Stream)) error {
	for {
		st, err := l.AcceptStream()
		if err != nil {
			return err
		}
		go func() {
			defer st.Close()
			handler(st)
		}()
	}
}

// StreamHandler handles the events of one stream in the asynchronous server
// style (Listener.ServeHandler). The methods of one stream are called one
// at a time from the stream's own goroutine.
type StreamHandler interface {
	// OnData is called each time unread data is available on st; see OnData
	// (the function) for the rules. Returning an error ends the stream.
	OnData(st *Stream) error

	// OnClose is called once, after the last OnData, when the stream has
	// ended: err is nil when the peer closed the stream (or the handler
	// closed it), the error OnData returned, or why reading failed (an error
	// wrapping ErrSessionClosed when the session died, ErrTimeout when a
	// read deadline passed, io.ErrUnexpectedEOF when the peer closed the
	// stream in the middle of what OnData waited for). The stream is closed
	// only when OnClose returns, so OnClose may write a last message.
	OnClose(st *Stream, err error)
}

// ServeHandler accepts streams on l and handles each with h, in a goroutine
// per stream that waits for data and calls h.OnData, then h.OnClose, then
// closes the stream. Like Serve, it runs until l is closed, returns
// ErrListenerClosed, and does not wait for the streams' goroutines.
func (l *Listener) ServeHandler(h StreamHandler) error {
	return l.Serve(func(st *Stream) { h.OnClose(st, dataLoop(st, h.OnData)) }) // Serve closes st
}

// OnData starts a goroutine that calls fn each time unread data is
// available on st, until fn returns an error or the stream ends, and then
// closes st. The channel it returns receives why it stopped (nil when the
// peer closed the stream, or fn closed it) and is then closed. It works on
// either side of a session.
//
// Rules for fn:
//
//   - It is the only reader of st; other goroutines may write to st (their
//     writes must not interleave).
//   - It should handle what it can of st's unread data (at least one byte)
//     and may block reading the rest of a message it has begun: that holds
//     up only this stream.
//   - If it returns while unread data remains, it is called again at once
//     if it consumed something, else only once more data has arrived: it
//     may leave an incomplete message unread until the next call.
//   - Slices it got from BufferReader are valid until it returns; then
//     OnData releases what was read (ReleasePreviousRead).
//
// A read deadline on st bounds its idling: OnData then stops with ErrTimeout.
func OnData(st *Stream, fn func(st *Stream) error) <-chan error {
	done := make(chan error, 1)
	go func() {
		err := dataLoop(st, fn)
		st.Close()
		done <- err
		close(done)
	}()
	return done
}

// dataLoop calls fn while data is available on st, as described at OnData.
// It returns nil when the stream ended normally.
func dataLoop(st *Stream, fn func(*Stream) error) error {
	r := st.BufferReader()
	need := 1
	for {
		if _, err := r.Peek(need); err != nil {
			// A session error may wrap io.EOF too (the connection ended).
			if !errors.Is(err, ErrSessionClosed) && (err == io.EOF || errors.Is(err, ErrStreamClosed)) {
				return nil // the peer closed the stream, or fn closed it
			}
			return err
		}
		before := st.readCount()
		if err := fn(st); err != nil {
			return err
		}
		// If fn consumed nothing, wait for more than is there. Compared by
		// count, not by where the first unread byte lies: a new message can
		// lie exactly where the one fn read did (reuse.go).
		need = 1
		if n := r.Len(); n > 0 && st.readCount() == before {
			need = n + 1
		}
		r.ReleasePreviousRead()
	}
}

// readCount is the number of bytes read from st so far.
func (st *Stream) readCount() uint64 {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.reader.consumed
}

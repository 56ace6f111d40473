package shmipc

import (
	"io"
	"net"
	"sync/atomic"
	"time"

	shm "github.com/goshm/shmipc"
)

// Stream is one bidirectional stream of a session, a net.Conn with
// zero-copy access to shared memory (BufferReader, BufferWriter).
type Stream struct {
	st   *shm.Stream
	sess *Session
	r    reader
	w    writer
	// localClosed: Close was called; ended: a read or write found the
	// stream ended by the peer, or its callbacks have finished.
	localClosed, ended, callbacks atomic.Bool
}

// StreamCallbacks receives the events of a stream after SetCallbacks:
// OnData when data has arrived (it reads what it can), then OnLocalClose
// once the stream ended by its own Close, or OnRemoteClose once it ended
// otherwise (the peer closed it, or its session ended).
type StreamCallbacks interface {
	OnData(reader BufferReader)
	OnLocalClose()
	OnRemoteClose()
}

// BufferReader reads a stream's received bytes, zero-copy where it can:
// ReadBytes, Peek (without consuming), Discard and ReadByte wait until the
// bytes they ask for have arrived, bounded by the read deadline; Len is
// the number not yet read; ReadString copies. Slices returned stay valid
// until ReleasePreviousRead, Stream.ReleaseReadAndReuse, Stream.Read or
// Stream.Close.
type BufferReader interface {
	io.ByteReader
	Len() int
	ReadBytes(size int) ([]byte, error)
	Peek(size int) ([]byte, error)
	Discard(size int) (int, error)
	ReleasePreviousRead()
	ReadString(size int) (string, error)
}

// BufferWriter builds the next message of a stream in shared memory:
// Reserve returns bytes at its end to fill, WriteBytes, WriteString and
// WriteByte append copies, Len is its length. Stream.Flush sends it.
type BufferWriter interface {
	Len() int
	io.ByteWriter
	Reserve(size int) ([]byte, error)
	WriteBytes(data []byte) (n int, err error)
	WriteString(string) error
}

// newStream wraps a stream of the root package that belongs to sess.
func newStream(st *shm.Stream, sess *Session) *Stream {
	s := &Stream{st: st, sess: sess}
	s.r = reader{s: s, r: st.BufferReader()}
	s.w = writer{s: s, w: st.BufferWriter()}
	return s
}

// err translates err and notes an end of the stream it shows.
func (s *Stream) err(err error) error {
	err = compatErr(err)
	if err == io.EOF || err == ErrStreamClosed || err == ErrSessionShutdown {
		s.ended.Store(true)
	}
	return err
}

// BufferReader returns the stream's reader.
func (s *Stream) BufferReader() BufferReader { return &s.r }

// BufferWriter returns the stream's writer.
func (s *Stream) BufferWriter() BufferWriter { return &s.w }

// Close closes the stream in both directions.
func (s *Stream) Close() error {
	s.localClosed.Store(true)
	return s.err(s.st.Close())
}

// Flush sends the message built with BufferWriter. endStream has no effect.
func (s *Stream) Flush(endStream bool) error { return s.err(s.st.Flush(endStream)) }

// IsOpen reports whether the stream is open: not closed, its session up,
// and no read or write has found it ended by the peer.
func (s *Stream) IsOpen() bool {
	return !s.localClosed.Load() && !s.ended.Load() && !s.sess.IsClosed()
}

// LocalAddr returns the local address of the session's connection.
func (s *Stream) LocalAddr() net.Addr { return s.st.LocalAddr() }

// RemoteAddr returns the remote address of the session's connection.
func (s *Stream) RemoteAddr() net.Addr { return s.st.RemoteAddr() }

// Read copies received bytes into p (releasing earlier zero-copy reads).
func (s *Stream) Read(p []byte) (int, error) {
	n, err := s.st.Read(p)
	return n, s.err(err)
}

// Write sends p as one message.
func (s *Stream) Write(p []byte) (int, error) {
	n, err := s.st.Write(p)
	return n, s.err(err)
}

// ReleaseReadAndReuse releases what has been read; the stream keeps the
// last slice it read for its next message by itself.
func (s *Stream) ReleaseReadAndReuse() { s.r.r.ReleasePreviousRead() }

// Session returns the session of the stream.
func (s *Stream) Session() *Session { return s.sess }

// StreamID returns the stream's id on the wire.
func (s *Stream) StreamID() uint32 { return s.st.ID() }

// SetDeadline sets the read and write deadlines.
func (s *Stream) SetDeadline(t time.Time) error { return s.st.SetDeadline(t) }

// SetReadDeadline sets the read deadline.
func (s *Stream) SetReadDeadline(t time.Time) error { return s.st.SetReadDeadline(t) }

// SetWriteDeadline sets the write deadline.
func (s *Stream) SetWriteDeadline(t time.Time) error { return s.st.SetWriteDeadline(t) }

// SetCallbacks hands the stream's received data to callback: from now on
// a goroutine of the stream calls callback.OnData whenever data has
// arrived, until the stream ends, then closes the stream and calls
// OnLocalClose or OnRemoteClose. OnData may leave an incomplete message
// unread: it is called again when more has arrived. Slices it read stay
// valid until it returns. Nobody else may read the stream meanwhile. A
// second call (or nil callbacks) fails with ErrStreamCallbackHadExisted.
func (s *Stream) SetCallbacks(callback StreamCallbacks) error {
	if callback == nil || !s.callbacks.CompareAndSwap(false, true) {
		return ErrStreamCallbackHadExisted
	}
	done := shm.OnData(s.st, func(*shm.Stream) error {
		callback.OnData(&s.r)
		return nil
	})
	go func() {
		<-done
		s.ended.Store(true)
		if s.localClosed.Load() {
			callback.OnLocalClose()
		} else {
			callback.OnRemoteClose()
		}
	}()
	return nil
}

// reader is a Stream's BufferReader.
type reader struct {
	s *Stream
	r shm.BufferReader
}

func (r *reader) Len() int             { return r.r.Len() }
func (r *reader) ReleasePreviousRead() { r.r.ReleasePreviousRead() }

func (r *reader) ReadByte() (byte, error) {
	b, err := r.r.ReadByte()
	return b, r.s.err(err)
}

func (r *reader) ReadBytes(size int) ([]byte, error) {
	p, err := r.r.ReadBytes(size)
	return p, r.s.err(err)
}

func (r *reader) Peek(size int) ([]byte, error) {
	p, err := r.r.Peek(size)
	return p, r.s.err(err)
}

func (r *reader) Discard(size int) (int, error) {
	n, err := r.r.Discard(size)
	return n, r.s.err(err)
}

func (r *reader) ReadString(size int) (string, error) {
	p, err := r.r.ReadBytes(size)
	if err != nil {
		return "", r.s.err(err)
	}
	return string(p), nil
}

// writer is a Stream's BufferWriter.
type writer struct {
	s *Stream
	w shm.BufferWriter
}

func (w *writer) Len() int               { return w.w.Len() }
func (w *writer) WriteByte(b byte) error { return w.s.err(w.w.WriteByte(b)) }

func (w *writer) Reserve(size int) ([]byte, error) {
	p, err := w.w.Reserve(size)
	return p, w.s.err(err)
}

func (w *writer) WriteBytes(data []byte) (int, error) {
	n, err := w.w.WriteBytes(data)
	return n, w.s.err(err)
}

func (w *writer) WriteString(str string) error {
	_, err := w.w.WriteString(str)
	return w.s.err(err)
}

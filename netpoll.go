package shmipc

import (
	"io"
	"unsafe"

	"github.com/cloudwego/netpoll"
)

// A Stream through the nocopy interfaces of CloudWeGo netpoll, for RPC
// frameworks whose codecs use netpoll.Reader and netpoll.Writer (Kitex,
// Hertz). Which calls are zero-copy:
//
//	Reader.Next, Peek, Until  when the bytes lie in one slice (or fallback
//	                          frame); else a copy into the read arena,
//	                          reused after Release.
//	Reader.Skip, Len          touch no data.
//	Reader.ReadString,        always copy (their contract).
//	ReadBinary, ReadByte
//	Reader.Slice              copies into a new netpoll.LinkBuffer.
//	Writer.Malloc, WriteByte  shared memory (private memory, sent as
//	                          fallback data, when shared memory cannot
//	                          give it, as for BufferWriter.Reserve).
//	Writer.WriteString,       copy their argument; the caller may reuse it
//	WriteBinary, Append       at once.
//	Writer.WriteDirect        copies p now and the bytes after the insertion
//	                          point again at Flush.

var (
	_ netpoll.Reader = (*netpollReader)(nil)
	_ netpoll.Writer = (*netpollWriter)(nil)
)

// NetpollReader returns a netpoll.Reader over the bytes the stream receives.
//
// It shares the stream's receive buffer with BufferReader and Read: Release
// is BufferReader.ReleasePreviousRead, and slices returned by Next, Peek and
// Until stay valid until Release, ReleasePreviousRead, Read or Close. They
// may be shared memory: do not write into them, and since the peer still
// can (see BufferReader), validate a copy (ReadBinary, ReadString, Read)
// when the peer is not trusted.
//
// Reads block until enough bytes have arrived, the read deadline passes
// (ErrTimeout), the peer closes the stream (io.EOF, or io.ErrUnexpectedEOF
// when some but not enough bytes are left), the stream is closed
// (ErrStreamClosed) or the session ends (its Err).
//
// Like BufferReader, the Reader is not safe for concurrent use.
func (st *Stream) NetpollReader() netpoll.Reader { return (*netpollReader)(st) }

type netpollReader Stream

// Next returns the next n bytes and consumes them, blocking until they have
// arrived. They are valid until Release.
func (b *netpollReader) Next(n int) ([]byte, error) { return (*Stream)(b).next(n, true) }

// Peek is Next without consuming the bytes.
func (b *netpollReader) Peek(n int) ([]byte, error) { return (*Stream)(b).next(n, false) }

// Skip consumes the next n bytes, blocking until they arrive; on error, none.
func (b *netpollReader) Skip(n int) error {
	_, err := (*Stream)(b).skip(n, false)
	return err
}

// Until returns the bytes up to and including the next delim, blocking until
// it arrives. If the stream ends or fails first, it consumes and returns
// what was left with the error (io.EOF when the peer closed it).
func (b *netpollReader) Until(delim byte) (line []byte, err error) {
	st := (*Stream)(b)
	st.mu.Lock()
	defer st.mu.Unlock()
	r := &st.reader
	take := func(n int) error {
		return st.s.access(func() error { line = r.take(n); return nil })
	}
	scanned := 0
	for {
		if scanned > r.unread {
			scanned = 0 // someone else read meanwhile
		}
		i := -1
		if err := st.s.access(func() error { i = r.indexByte(delim, scanned); return nil }); err != nil {
			return nil, err
		}
		if i >= 0 {
			if err := take(i + 1); err != nil {
				return nil, err
			}
			return line, nil
		}
		scanned = r.unread
		if err := st.waitReadable(scanned + 1); err != nil {
			if r.unread > 0 {
				if terr := take(r.unread); terr != nil {
					return nil, terr
				}
			}
			if err == io.ErrUnexpectedEOF {
				err = io.EOF
			}
			return line, err
		}
	}
}

// ReadString returns the next n bytes as a string (a copy).
func (b *netpollReader) ReadString(n int) (string, error) {
	p, err := b.ReadBinary(n)
	if err != nil || n == 0 {
		return "", err
	}
	return unsafe.String(unsafe.SliceData(p), len(p)), nil
}

// ReadBinary returns a copy of the next n bytes that the caller owns.
func (b *netpollReader) ReadBinary(n int) ([]byte, error) {
	return (*Stream)(b).readInto(n, func(n int) ([]byte, error) { return make([]byte, n), nil })
}

// readInto waits for n bytes, copies them into the buffer get returns and
// consumes them. get runs only once the bytes are there: n is often a
// length the peer announced, and memory must grow with bytes received.
func (st *Stream) readInto(n int, get func(int) ([]byte, error)) ([]byte, error) {
	if n < 0 {
		return nil, errNegative
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if err := st.waitReadable(n); err != nil {
		return nil, err
	}
	p, err := get(n)
	if err != nil {
		return nil, err
	}
	if err := st.s.access(func() error { st.reader.copyOut(p); return nil }); err != nil {
		return nil, err
	}
	st.reader.advance(n)
	return p, nil
}

// ReadByte returns the next byte.
func (b *netpollReader) ReadByte() (byte, error) { return (*bufferReader)(b).ReadByte() }

// Slice returns a netpoll.Reader holding the next n bytes and then releases
// this Reader, as netpoll specifies. The bytes cannot stay in shared memory
// beyond the release, so they are copied into a new netpoll.LinkBuffer,
// which the caller owns.
func (b *netpollReader) Slice(n int) (netpoll.Reader, error) {
	var lb *netpoll.LinkBuffer
	_, err := (*Stream)(b).readInto(n, func(n int) ([]byte, error) {
		lb = netpoll.NewLinkBuffer(n)
		return lb.Malloc(n) // the bytes are copied once, straight into lb
	})
	if err == nil {
		err = lb.Flush()
	}
	if err == nil {
		err = b.Release()
	}
	if err != nil {
		return nil, err
	}
	return lb, nil
}

// Release frees everything read so far (BufferReader.ReleasePreviousRead).
// Slices returned by earlier reads become invalid. An error means the peer
// corrupted the buffer region; the session is then closed.
func (b *netpollReader) Release() error {
	st := (*Stream)(b)
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.s.access(st.reader.release)
}

// Len is the number of received bytes not yet read. It never blocks.
func (b *netpollReader) Len() int { return (*bufferReader)(b).Len() }

package cells

import (
	"fmt"
	"hash/fnv"
)

// FallbackSize is the message size of the cells that force fallback data:
// larger than the 1 MiB buffer region those cells give the client, so that
// no implementation can place it in shared memory, in either direction.
const FallbackSize = 3 << 19

// CloseAfterFallback checks the close ordering of the server's side: on one
// stream it sends a frame too large for the region (fallback data), then
// the zero-length frame. The server's echoes go as fallback data too (a
// stream that received fallback data answers with it), and its close
// follows them on the other path (the IO queue). Every byte must arrive,
// then end-of-stream.
func CloseAfterFallback(lib Lib) error {
	st, err := lib.Open()
	if err != nil {
		return fmt.Errorf("open: %w", err)
	}
	defer st.Close()
	big, zero := Frame(Pattern(FallbackSize, 77)), Frame(nil)
	if _, err := st.Write(big); err != nil {
		return fmt.Errorf("write: %w", err)
	}
	if _, err := st.Write(zero); err != nil {
		return fmt.Errorf("write the zero-length frame: %w", err)
	}
	if err := expectEcho(st, big); err != nil {
		return err
	}
	if err := expectEcho(st, zero); err != nil {
		return fmt.Errorf("zero-length frame: %w", err)
	}
	if err := expectEnd(lib, st); err != nil {
		return err
	}
	return st.Close()
}

// Sent describes what a client sent on a stream: its length and FNV-1a
// 64-bit hash, which the server reports for the stream when it ends.
type Sent struct {
	Bytes int64
	FNV   uint64
}

// String is the part of a server's End line that Sent must match.
func (s Sent) String() string { return fmt.Sprintf("bytes=%d fnv=%016x", s.Bytes, s.FNV) }

// CloseAfterSend checks the close ordering of the client's side: it sends
// frames on one stream, the last of them as fallback data, and closes the
// stream at once without reading the echoes. The server must read every
// byte, then end-of-stream; it reports so in its End for the stream, which
// the caller compares with the returned Sent.
func CloseAfterSend(lib Lib) (Sent, error) {
	st, err := lib.Open()
	if err != nil {
		return Sent{}, fmt.Errorf("open: %w", err)
	}
	defer st.Close()
	h := fnv.New64a()
	var n int64
	for i, size := range []int{100, 5000, FallbackSize} {
		f := Frame(Pattern(size, 90+i))
		if _, err := st.Write(f); err != nil {
			return Sent{}, fmt.Errorf("write a %d-byte frame: %w", size, err)
		}
		h.Write(f)
		n += int64(len(f))
	}
	if err := st.Close(); err != nil {
		return Sent{}, fmt.Errorf("close: %w", err)
	}
	return Sent{Bytes: n, FNV: h.Sum64()}, nil
}

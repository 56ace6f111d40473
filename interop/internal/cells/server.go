package cells

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"io"
)

// End is how a server's stream ended: "eof" (the client closed it), "zero"
// (the server closed it after a zero-length frame) or "error: ...", with
// the number of bytes received and their FNV-1a 64-bit hash.
type End struct {
	How   string
	Bytes int64
	FNV   uint64
}

// String is the line a reference server prints for a stream that ended.
func (e End) String() string {
	return fmt.Sprintf("end %s bytes=%d fnv=%016x", e.How, e.Bytes, e.FNV)
}

// Sent returns the length and hash part of e, to compare with a client's.
func (e End) Sent() Sent { return Sent{Bytes: e.Bytes, FNV: e.FNV} }

// echoChunk is the most of a frame read before its bytes are echoed, so
// that a 40 MiB frame needs no 40 MiB buffer.
const echoChunk = 1 << 20

// Echo serves the echo contract on st until the stream ends and returns how
// it ended. It closes st. After a failed write (the client closed the
// stream while the echo went back) it goes on reading, so that End counts
// every byte the client sent.
func Echo(st Stream, isEOF func(error) bool) End {
	defer st.Close()
	h := fnv.New64a()
	var total int64
	var writeErr error
	write := func(p []byte) {
		if writeErr == nil {
			_, writeErr = st.Write(p)
		}
	}
	end := func(how string) End { return End{How: how, Bytes: total, FNV: h.Sum64()} }
	buf := make([]byte, echoChunk)
	for {
		var head [4]byte
		n, err := io.ReadFull(st, head[:])
		total += int64(n)
		h.Write(head[:n])
		if err != nil {
			if n == 0 && isEOF(err) {
				return end("eof")
			}
			return end("error: " + err.Error())
		}
		write(head[:])
		left := int(binary.BigEndian.Uint32(head[:]))
		if left == 0 {
			if writeErr != nil {
				return end("error: " + writeErr.Error())
			}
			st.Close()
			return end("zero")
		}
		for left > 0 {
			n, err := io.ReadFull(st, buf[:min(left, len(buf))])
			total += int64(n)
			h.Write(buf[:n])
			if err != nil {
				return end("error: " + err.Error())
			}
			write(buf[:n])
			left -= n
		}
	}
}

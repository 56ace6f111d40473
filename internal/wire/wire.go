// Package wire encodes and decodes the Shmipc event frames that travel on the
// socket: the 8-byte header and the payloads of each event type. Socket
// integers are big-endian. The layout lives here and nowhere else.
package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
)

// Header field offsets: length (4 bytes), magic (2), version (1), type (1).
const (
	offsetLength  = 0
	offsetMagic   = 4
	offsetVersion = 6
	offsetType    = 7

	// HeaderSize is the size of every frame header.
	HeaderSize = 8
)

// Magic is the value of every header's magic field.
const Magic uint16 = 0x7758

// Protocol versions.
const (
	// VersionFilePath is protocol version 2: regions named by file paths, no
	// acknowledgement of the handshake.
	VersionFilePath uint8 = 2
	// VersionMemfd is protocol version 3: a version exchange, then memfds over
	// SCM_RIGHTS or file paths, acknowledged.
	VersionMemfd uint8 = 3
	// MaxVersion is the highest version this implementation speaks.
	MaxVersion = VersionMemfd
)

// Type is an event type (the header's type byte).
type Type uint8

// Event types.
const (
	TypeShareMemoryByFilePath Type = 0
	TypePolling               Type = 1
	TypeStreamClose           Type = 2
	TypeFallbackData          Type = 3
	TypeExchangeProtoVersion  Type = 4
	TypeShareMemoryByMemfd    Type = 5
	TypeAckShareMemory        Type = 6
	TypeAckReadyRecvFD        Type = 7
	TypeHotRestart            Type = 8
	TypeHotRestartAck         Type = 9

	maxType = TypeHotRestartAck
)

var typeNames = [...]string{
	"ShareMemoryByFilePath", "Polling", "StreamClose", "FallbackData",
	"ExchangeProtoVersion", "ShareMemoryByMemfd", "AckShareMemory",
	"AckReadyRecvFD", "HotRestart", "HotRestartAck",
}

func (t Type) String() string {
	if t <= maxType {
		return typeNames[t]
	}
	return fmt.Sprintf("type(%d)", uint8(t))
}

// Fixed frame lengths (header included).
const (
	StreamCloseSize   = HeaderSize + 4
	HotRestartSize    = HeaderSize + 8
	FallbackHeadSize  = HeaderSize + 8 // header, stream id, status
	EmptyEventSize    = HeaderSize     // ExchangeProtoVersion and the acks
	pathLengthSize    = 2
	MaxPathPayloadLen = 2*pathLengthSize + 2*0xFFFF
)

// Header is an 8-byte frame header.
type Header []byte

// Length is the total frame length including the header.
func (h Header) Length() uint32 { return binary.BigEndian.Uint32(h[offsetLength:]) }

// Magic is the header's magic field.
func (h Header) Magic() uint16 { return binary.BigEndian.Uint16(h[offsetMagic:]) }

// Version is the header's protocol version byte.
func (h Header) Version() uint8 { return h[offsetVersion] }

// Type is the header's event type.
func (h Header) Type() Type { return Type(h[offsetType]) }

// Encode writes a header into h.
func (h Header) Encode(length uint32, version uint8, t Type) {
	binary.BigEndian.PutUint32(h[offsetLength:], length)
	binary.BigEndian.PutUint16(h[offsetMagic:], Magic)
	h[offsetVersion] = version
	h[offsetType] = uint8(t)
}

func (h Header) String() string {
	return fmt.Sprintf("{length %d, magic %#04x, version %d, type %v}", h.Length(), h.Magic(), h.Version(), h.Type())
}

// Errors returned by Check and the payload decoders.
var (
	ErrBadMagic   = errors.New("bad magic")
	ErrBadVersion = errors.New("bad version")
	ErrBadType    = errors.New("unknown event type")
	ErrBadLength  = errors.New("bad frame length")
)

// Check validates the fields every header must satisfy: the magic, a non-zero
// version and a known type.
func (h Header) Check() error {
	if h.Magic() != Magic {
		return fmt.Errorf("%w %#04x in header %v", ErrBadMagic, h.Magic(), h)
	}
	if h.Version() == 0 {
		return fmt.Errorf("%w 0 in header %v", ErrBadVersion, h)
	}
	if h.Type() > maxType {
		return fmt.Errorf("%w %d in header %v", ErrBadType, uint8(h.Type()), h)
	}
	return nil
}

// AppendEvent appends a frame with no payload (Polling, ExchangeProtoVersion,
// AckShareMemory, AckReadyRecvFD).
func AppendEvent(b []byte, version uint8, t Type) []byte {
	b, h := grow(b, HeaderSize)
	Header(h).Encode(HeaderSize, version, t)
	return b
}

// AppendStreamClose appends a 12-byte StreamClose frame.
func AppendStreamClose(b []byte, version uint8, id uint32) []byte {
	b, f := grow(b, StreamCloseSize)
	Header(f).Encode(StreamCloseSize, version, TypeStreamClose)
	binary.BigEndian.PutUint32(f[HeaderSize:], id)
	return b
}

// AppendHotRestart appends a 16-byte HotRestart or HotRestartAck frame.
func AppendHotRestart(b []byte, version uint8, t Type, epoch uint64) []byte {
	b, f := grow(b, HotRestartSize)
	Header(f).Encode(HotRestartSize, version, t)
	binary.BigEndian.PutUint64(f[HeaderSize:], epoch)
	return b
}

// AppendFallbackHead appends the first 16 bytes of a FallbackData frame that
// carries dataLen bytes of data after them.
func AppendFallbackHead(b []byte, version uint8, id, status uint32, dataLen int) []byte {
	b, f := grow(b, FallbackHeadSize)
	Header(f).Encode(uint32(FallbackHeadSize+dataLen), version, TypeFallbackData)
	binary.BigEndian.PutUint32(f[HeaderSize:], id)
	binary.BigEndian.PutUint32(f[HeaderSize+4:], status)
	return b
}

// DecodeFallbackHead returns the stream id and status of a FallbackData
// payload (the bytes after the header) and the data after them.
func DecodeFallbackHead(payload []byte) (id, status uint32, data []byte, err error) {
	if len(payload) < FallbackHeadSize-HeaderSize {
		return 0, 0, nil, fmt.Errorf("%w: FallbackData payload of %d bytes is shorter than its 8-byte id and status", ErrBadLength, len(payload))
	}
	return binary.BigEndian.Uint32(payload), binary.BigEndian.Uint32(payload[4:]), payload[8:], nil
}

// AppendPaths appends a ShareMemoryByFilePath or ShareMemoryByMemfd frame
// naming the queue region, then the buffer region.
func AppendPaths(b []byte, version uint8, t Type, queuePath, bufferPath string) ([]byte, error) {
	if len(queuePath) > 0xFFFF || len(bufferPath) > 0xFFFF {
		return b, fmt.Errorf("path longer than %d bytes", 0xFFFF)
	}
	n := HeaderSize + 2*pathLengthSize + len(queuePath) + len(bufferPath)
	b, f := grow(b, n)
	Header(f).Encode(uint32(n), version, t)
	p := f[HeaderSize:]
	binary.BigEndian.PutUint16(p, uint16(len(queuePath)))
	p = p[pathLengthSize+copy(p[pathLengthSize:], queuePath):]
	binary.BigEndian.PutUint16(p, uint16(len(bufferPath)))
	copy(p[pathLengthSize:], bufferPath)
	return b, nil
}

// DecodePaths decodes the payload of a ShareMemoryByFilePath or
// ShareMemoryByMemfd frame. The two lengths must account for every byte.
func DecodePaths(payload []byte) (queuePath, bufferPath string, err error) {
	if len(payload) < pathLengthSize {
		return "", "", fmt.Errorf("%w: path payload of %d bytes has no queue path length", ErrBadLength, len(payload))
	}
	qLen := int(binary.BigEndian.Uint16(payload))
	rest := payload[pathLengthSize:]
	if len(rest) < qLen+pathLengthSize {
		return "", "", fmt.Errorf("%w: path payload of %d bytes is shorter than its queue path (%d bytes) and buffer path length", ErrBadLength, len(payload), qLen)
	}
	queue := rest[:qLen]
	rest = rest[qLen:]
	bLen := int(binary.BigEndian.Uint16(rest))
	rest = rest[pathLengthSize:]
	if len(rest) != bLen {
		return "", "", fmt.Errorf("%w: buffer path length %d does not match the %d bytes left in the payload", ErrBadLength, bLen, len(rest))
	}
	if qLen == 0 || bLen == 0 {
		return "", "", fmt.Errorf("%w: empty region path", ErrBadLength)
	}
	return string(queue), string(rest), nil
}

// grow extends b by n bytes and returns the extended slice and the new part.
func grow(b []byte, n int) ([]byte, []byte) {
	l := len(b)
	b = slices.Grow(b, n)[:l+n]
	return b, b[l:]
}

package shmipc

import (
	"cmp"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/goshm/shmipc/internal/shm"
)

// MemMapType says how the client shares its memory regions with the server.
type MemMapType uint8

const (
	// MemMapTypeMemFd creates anonymous memfds and passes them over the Unix
	// socket with SCM_RIGHTS (protocol version 3). It needs a Unix socket.
	// Nothing is left in the file system, even if both processes die.
	MemMapTypeMemFd MemMapType = iota
	// MemMapTypeDevShmFile creates files under ShareMemoryPathPrefix
	// (normally in /dev/shm) and sends their paths (protocol version 2). It
	// works over TCP loopback too. The files are removed when the session
	// ends. A server maps only regular files directly inside its own prefix
	// directory owned by the client's user id (SO_PEERCRED, or /proc/net/tcp
	// over TCP; a client whose user id is unknown is refused), and shares a
	// cached mapping only with sessions of the same client process.
	MemMapTypeDevShmFile
)

// String returns "memfd" or "file".
func (t MemMapType) String() string {
	switch t {
	case MemMapTypeMemFd:
		return "memfd"
	case MemMapTypeDevShmFile:
		return "file"
	}
	return fmt.Sprintf("MemMapType(%d)", uint8(t))
}

// SizePercentPair configures one size class of the buffer region: slices of
// Size data bytes taking Percent of the region.
type SizePercentPair struct {
	Size    uint32
	Percent uint32
}

// Config holds every tunable of a session. Start from DefaultConfig and
// change fields; Client, Server, Dial and Listen call Verify.
type Config struct {
	// InitializeTimeout bounds the whole handshake on either side.
	InitializeTimeout time.Duration

	// ConnectionWriteTimeout bounds each write of an event frame to the
	// socket (wake-ups, fallback data, closes). Dial uses it as its connect
	// timeout too. A peer that stops reading for this long ends the session.
	ConnectionWriteTimeout time.Duration

	// QueueCap is the number of 12-byte elements in each direction's IO
	// queue. It must be a positive multiple of 16 so that the queue header
	// is laid out identically on x86-64 and arm64.
	QueueCap uint32

	// ShareMemoryBufferCap is the size in bytes of the buffer region a client
	// creates for a session: at least 1 MiB.
	ShareMemoryBufferCap uint32

	// BufferSliceSizes are the size classes of the buffer region. Sizes must
	// be distinct multiples of 4 and percentages must add up to 100. Each
	// class gets its percentage of the region in slices; a list never hands
	// out its last slice, so a class of one slice is never used, and at
	// least one class must get two.
	BufferSliceSizes []SizePercentPair

	// ShareMemoryPathPrefix names the regions a client creates:
	// <prefix>_<pid>_<random>_buffer and ..._queue_0. In file mode these are
	// real files; in memfd mode they are only names.
	ShareMemoryPathPrefix string

	// MemMapType selects memfd (default) or file-backed regions.
	MemMapType MemMapType

	// ConsumerSpinTime is how long a reader waiting for data polls the IO
	// queue itself (or the receive loop for parked readers) before it
	// sleeps. While it looks the peer sends no wake-ups, which takes
	// small-message latency well below a socket round trip. It adapts to
	// the traffic, down to nothing when spinning does not pay off; an idle
	// session uses no CPU. Zero disables spinning.
	ConsumerSpinTime time.Duration

	// WriteSpaceTimeout bounds how long a write waits for room when the
	// buffer region or the peer's IO queue is full because the peer has not
	// yet consumed what was sent (back-pressure), unless a write deadline
	// comes sooner. Then the write fails with a timeout error (a net.Error;
	// for a full queue it also wraps ErrQueueFull) and nothing of the
	// message is sent.
	//
	// A writer that holds part of the region waits only 50 ms, then goes on
	// as fallback data: a message that ran out of room part way, or one on a
	// stream whose reader holds slices it read in place and has not released
	// (an echo that reserves its reply before releasing a large request
	// would otherwise wait for itself). Writers that hold nothing wait first
	// come, first served, and on the side that created the region they leave
	// a few slices to writers that hold some. Waiting can still deadlock
	// when every slice is held by streams whose owners wait too (a client
	// that keeps large replies on some streams while it sends on others):
	// size the region for the data in flight, or set FallbackWhenFull.
	WriteSpaceTimeout time.Duration

	// FallbackWhenFull sends a message over the socket as fallback data when
	// the buffer region has no room for it, instead of waiting (the other
	// implementations' behaviour). A stream that has sent fallback data
	// keeps doing so. Messages that can never fit in shared memory (a
	// Reserve larger than the largest slice, a message larger than half the
	// region, or than half of what its slices of an eighth of the largest
	// size or more hold) always go as fallback data.
	FallbackWhenFull bool

	// RequireSealedMemory makes a server refuse regions that the client
	// could still shrink after the handshake: memfds not sealed against
	// shrinking (F_SEAL_SHRINK), and all file-mode regions. The library's
	// own accesses survive a shrunk region (the session ends with an
	// error), but a zero-copy slice held by the application would fault in
	// its code. Clients of this package seal their memfds; the reference
	// implementations do not.
	RequireSealedMemory bool

	// AllowedPeerUIDs, when not empty, restricts a server to clients whose
	// Unix-socket peer credentials carry one of these user ids; others are
	// disconnected before the handshake. Over TCP no credentials exist, so
	// a non-empty list refuses every TCP client.
	AllowedPeerUIDs []uint32

	// SocketFileMode is the permission of the Unix socket file Listen
	// creates. The default, 0600, lets only the owner connect.
	SocketFileMode os.FileMode

	// ShareMemoryFileMode is the permission of region files a client
	// creates in file mode (default 0600; a server running as another user
	// needs more, and a matching umask).
	ShareMemoryFileMode os.FileMode

	// Logger receives the library's log records: sessions starting and
	// ending (Debug), sessions ending with an error and failed handshakes
	// (Warn). Nil, the default, logs nothing.
	Logger *slog.Logger

	// MaxFallbackFrameSize is the largest FallbackData frame accepted from
	// the peer, header included (at least 32 MiB). Larger frames end the
	// session. This implementation sends frames of at most 32 MiB (the Rust
	// reference's read buffer), splitting only larger messages, so that
	// every peer takes its frames whatever its setting.
	MaxFallbackFrameSize uint32

	// Bounds on what a peer can make this side hold. A peer that reaches one
	// is slowed down or cut off, its session ending with an error that wraps
	// ErrLimitExceeded and names the bound; other sessions go on.

	// MaxStreams bounds the streams a client holds open at once in a
	// session (default 65,536): OpenStream fails beyond it. A stream counts
	// until the client closes it, whether or not the server has. A server
	// ends a session whose client has more than twice as many open as far
	// as it can tell. Streams the client has closed and the server's
	// application has not are bounded by MaxPendingAccepts until accepted.
	MaxStreams int

	// MaxPendingAccepts bounds the streams of one session that have been
	// opened by the client and not yet accepted by the application (default
	// 4,096). A client that opens one more ends its session.
	MaxPendingAccepts int

	// MaxFallbackBufferedPerStream and MaxFallbackBuffered bound the
	// fallback data received and not yet read, for one stream and for the
	// whole session (defaults 32 MiB and 64 MiB), whatever API reads it. A
	// FallbackData frame is always taken while its stream (for the
	// session's bound, the session) holds none, so the data held is at most
	// the bound plus one frame. A frame that would exceed a bound waits, and
	// the socket with it, until the application reads; shared-memory
	// messages go on meanwhile. If no room comes within
	// FallbackStallTimeout (default 10 s), that stream fails: its reads and
	// writes return an error that wraps ErrLimitExceeded and names the
	// bound, the peer is told the stream is closed, and the session goes
	// on. A ReadBytes or Peek of more fallback data than a stream's bound
	// fails the same way. Shared-memory messages are bounded by the buffer region itself.
	MaxFallbackBufferedPerStream int
	MaxFallbackBuffered          int
	FallbackStallTimeout         time.Duration

	// PartialFrameTimeout (default 10 s, also when zero) bounds how long a
	// frame may take to arrive once its first bytes have: a peer that
	// announces a frame and stops part way ends its session. The receive
	// buffer grows with the bytes that arrive, not the length announced.
	PartialFrameTimeout time.Duration

	// MaxSessions bounds the sessions a Listener serves at once, handshakes
	// in progress included (default 4,096); a connection beyond it is
	// closed at once. Zero means the default.
	MaxSessions int
}

// Defaults that are not only DefaultConfig's.
const (
	defaultConsumerSpinTime    = 200 * time.Microsecond
	defaultPartialFrameTimeout = 10 * time.Second
	defaultMaxSessions         = 4096

	// maxFallbackFrameSent is the largest FallbackData frame we send: the
	// smallest MaxFallbackFrameSize Verify allows, since a peer's limit is
	// never learnt. It is the Rust reference's read buffer: that reader
	// panics on a larger frame, and leaks every frame but the last that one
	// of its reads spans, so a message goes in as few frames as it can.
	maxFallbackFrameSent = minFallbackFrame

	minBufferCap = 1 << 20
	// maxPathBudget is the file-mode length guard: a prefix longer than
	// 255-48-27 bytes cannot name its regions.
	maxPathBudget = 255 - 48 - 27
)

// DefaultConfig returns the default configuration: a 128 MiB buffer region
// per session with slices of 8 KiB, 32 KiB and 128 KiB (each less the 20-byte
// slice header) and of 1 MiB and 4 MiB (each plus 4 KiB, room for a frame
// header), at 15/6/7/7/65 % of the region (2457, 245, 71, 8 and 20
// slices), 8192-element queues and memfd regions.
//
// The other Shmipc implementations default to 32 MiB of 8, 32 and 128 KiB
// slices (ReferenceSliceSizes); their peers accept any layout. The larger
// classes keep Reserve and ReadBytes zero-copy up to 4 MiB, and 20 slices
// of 4 MiB let 8 streams each hold a 4 MiB request while they reserve a
// 4 MiB reply. The 128 MiB are address space: a region's pages are
// committed only when written (about 11 MiB of slice headers when it is
// created, data pages as traffic needs them).
func DefaultConfig() *Config {
	return &Config{
		InitializeTimeout:      time.Second,
		ConnectionWriteTimeout: 10 * time.Second,
		QueueCap:               8192,
		ShareMemoryBufferCap:   128 << 20,
		BufferSliceSizes: []SizePercentPair{
			{Size: 8<<10 - shm.SliceHeaderSize, Percent: 15},
			{Size: 32<<10 - shm.SliceHeaderSize, Percent: 6},
			{Size: 128<<10 - shm.SliceHeaderSize, Percent: 7},
			{Size: 1<<20 + 4<<10, Percent: 7},
			{Size: 4<<20 + 4<<10, Percent: 65},
		},
		ShareMemoryPathPrefix: "/dev/shm/shmipc",
		MemMapType:            MemMapTypeMemFd,
		MaxFallbackFrameSize:  64 << 20,
		ConsumerSpinTime:      defaultConsumerSpinTime,
		WriteSpaceTimeout:     10 * time.Second,
		SocketFileMode:        0o600,
		ShareMemoryFileMode:   0o600,

		MaxStreams:                   1 << 16,
		MaxPendingAccepts:            4096,
		MaxFallbackBufferedPerStream: 32 << 20,
		MaxFallbackBuffered:          64 << 20,
		FallbackStallTimeout:         10 * time.Second,
		PartialFrameTimeout:          defaultPartialFrameTimeout,
		MaxSessions:                  defaultMaxSessions,
	}
}

// verified returns conf, DefaultConfig() if nil, and conf.Verify's error.
func verified(conf *Config) (*Config, error) {
	if conf == nil {
		conf = DefaultConfig()
	}
	return conf, conf.Verify()
}

// partialFrameTimeout is PartialFrameTimeout, or its default if zero (a
// session's config is verified: never negative).
func (c *Config) partialFrameTimeout() time.Duration {
	return cmp.Or(c.PartialFrameTimeout, defaultPartialFrameTimeout)
}

// maxSessions is MaxSessions, or its default.
func (c *Config) maxSessions() int {
	if c.MaxSessions > 0 {
		return c.MaxSessions
	}
	return defaultMaxSessions
}

// Verify reports the first invalid field, wrapping ErrInvalidConfig.
func (c *Config) Verify() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrInvalidConfig, fmt.Sprintf(format, args...))
	}
	if c == nil {
		return bad("nil config")
	}
	if c.InitializeTimeout <= 0 {
		return bad("InitializeTimeout %v must be positive", c.InitializeTimeout)
	}
	if c.ConnectionWriteTimeout <= 0 {
		return bad("ConnectionWriteTimeout %v must be positive", c.ConnectionWriteTimeout)
	}
	if c.QueueCap == 0 || c.QueueCap%16 != 0 || c.QueueCap > shm.MaxQueueCap {
		return bad("QueueCap %d must be a positive multiple of 16 no larger than %d", c.QueueCap, shm.MaxQueueCap)
	}
	if c.ShareMemoryBufferCap < minBufferCap {
		return bad("ShareMemoryBufferCap %d is below the minimum of %d", c.ShareMemoryBufferCap, minBufferCap)
	}
	if _, err := planLists(c.ShareMemoryBufferCap, c.BufferSliceSizes); err != nil {
		return bad("%v", err)
	}
	switch c.MemMapType {
	case MemMapTypeMemFd, MemMapTypeDevShmFile:
	default:
		return bad("unknown MemMapType %d", c.MemMapType)
	}
	if c.ShareMemoryPathPrefix == "" {
		return bad("empty ShareMemoryPathPrefix")
	}
	if p := c.ShareMemoryPathPrefix + "_x"; c.MemMapType == MemMapTypeDevShmFile && (!filepath.IsAbs(p) || filepath.Clean(p) != p) {
		// The server maps only a file named by a clean absolute path.
		return bad("ShareMemoryPathPrefix %q must be an absolute path without . or .. elements in file mode", c.ShareMemoryPathPrefix)
	}
	if len(c.ShareMemoryPathPrefix) > maxMemfdPrefix {
		return bad("ShareMemoryPathPrefix is %d bytes long; at most %d", len(c.ShareMemoryPathPrefix), maxMemfdPrefix)
	}
	if c.MemMapType == MemMapTypeDevShmFile && len(c.ShareMemoryPathPrefix)+len(pathUniquePart) > maxPathBudget {
		return bad("ShareMemoryPathPrefix %q is too long for file mode (at most %d bytes)", c.ShareMemoryPathPrefix, maxPathBudget-len(pathUniquePart))
	}
	if c.SocketFileMode&^os.ModePerm != 0 || c.ShareMemoryFileMode&^os.ModePerm != 0 {
		return bad("SocketFileMode %v and ShareMemoryFileMode %v may only hold permission bits", c.SocketFileMode, c.ShareMemoryFileMode)
	}
	if c.WriteSpaceTimeout <= 0 {
		return bad("WriteSpaceTimeout %v must be positive", c.WriteSpaceTimeout)
	}
	if c.ConsumerSpinTime < 0 {
		return bad("ConsumerSpinTime %v is negative", c.ConsumerSpinTime)
	}
	if c.MaxFallbackFrameSize < minFallbackFrame {
		return bad("MaxFallbackFrameSize %d is below %d", c.MaxFallbackFrameSize, minFallbackFrame)
	}
	if c.MaxStreams <= 0 || c.MaxPendingAccepts <= 0 || c.MaxFallbackBufferedPerStream <= 0 || c.MaxFallbackBuffered <= 0 {
		return bad("MaxStreams %d, MaxPendingAccepts %d, MaxFallbackBufferedPerStream %d and MaxFallbackBuffered %d must be positive",
			c.MaxStreams, c.MaxPendingAccepts, c.MaxFallbackBufferedPerStream, c.MaxFallbackBuffered)
	}
	if c.FallbackStallTimeout <= 0 {
		return bad("FallbackStallTimeout %v must be positive", c.FallbackStallTimeout)
	}
	if c.PartialFrameTimeout < 0 {
		return bad("PartialFrameTimeout %v is negative", c.PartialFrameTimeout)
	}
	if c.MaxSessions < 0 {
		return bad("MaxSessions %d is negative", c.MaxSessions)
	}
	return nil
}

// ReferenceSliceSizes are the slice sizes the other Shmipc implementations
// use by default, with a 32 MiB region (ReferenceBufferCap).
func ReferenceSliceSizes() []SizePercentPair {
	return []SizePercentPair{
		{Size: 8<<10 - shm.SliceHeaderSize, Percent: 50},
		{Size: 32<<10 - shm.SliceHeaderSize, Percent: 30},
		{Size: 128<<10 - shm.SliceHeaderSize, Percent: 20},
	}
}

// ReferenceBufferCap is the buffer region size the other Shmipc
// implementations use by default.
const ReferenceBufferCap = 32 << 20

// minFallbackFrame is the smallest MaxFallbackFrameSize allowed: the frames
// peers send (maxFallbackFrameSent) must be taken.
const minFallbackFrame = 32 << 20

// fallbackFrameData is the most data a FallbackData frame we send carries
// (less 16 bytes of header, id and status). A variable for benchmarks.
var fallbackFrameData = maxFallbackFrameSent - 16

// maxMemfdPrefix bounds ShareMemoryPathPrefix in memfd mode too (file mode
// has the tighter maxPathBudget): the region names, with what hot restart
// adds, must fit the handshake's 16-bit lengths.
const maxMemfdPrefix = 4096

// pathUniquePart stands for what a client appends to the prefix: "_<pid>_<random>".
const pathUniquePart = "_4294967295_ffffffffffffffff"

// planLists lays out a new region's lists exactly as docs/protocol.md §6.5
// does: by size, each taking its percentage of the space after the headers.
func planLists(size uint32, pairs []SizePercentPair) ([]shm.ListPlan, error) {
	if len(pairs) == 0 {
		return nil, fmt.Errorf("BufferSliceSizes is empty")
	}
	if len(pairs) > 0xFFFF {
		return nil, fmt.Errorf("too many BufferSliceSizes")
	}
	sorted := slices.SortedFunc(slices.Values(pairs), func(a, b SizePercentPair) int { return cmp.Compare(a.Size, b.Size) })
	var total uint64
	for i, p := range sorted {
		if p.Size == 0 || p.Size%4 != 0 {
			return nil, fmt.Errorf("slice size %d must be a positive multiple of 4", p.Size)
		}
		if i > 0 && sorted[i-1].Size == p.Size {
			return nil, fmt.Errorf("slice size %d appears twice", p.Size)
		}
		total += uint64(p.Percent)
	}
	if total != 100 {
		return nil, fmt.Errorf("slice size percentages add up to %d, not 100", total)
	}
	headers := uint64(len(sorted))*shm.ListHeaderSize + shm.BufferHeaderSize
	if uint64(size) <= headers {
		return nil, fmt.Errorf("buffer size %d cannot hold %d lists", size, len(sorted))
	}
	rest := uint64(size) - headers
	plans := make([]shm.ListPlan, len(sorted))
	for i, p := range sorted {
		count := rest * uint64(p.Percent) / 100 / (uint64(p.Size) + shm.SliceHeaderSize)
		if count == 0 {
			return nil, fmt.Errorf("slice size %d at %d%% of %d bytes gives no slices (a smaller region needs smaller BufferSliceSizes, e.g. ReferenceSliceSizes())", p.Size, p.Percent, size)
		}
		plans[i] = shm.ListPlan{SliceCap: p.Size, Count: uint32(count)}
	}
	// A free list never hands out its last slice (shm.Buffer.Alloc): a
	// layout of one-slice classes would send everything over the socket.
	if !slices.ContainsFunc(plans, func(p shm.ListPlan) bool { return p.Count >= 2 }) {
		return nil, fmt.Errorf("no slice size gets the 2 slices a size class needs to hand one out (a list keeps its last) in %d bytes: use smaller BufferSliceSizes, e.g. ReferenceSliceSizes()", size)
	}
	return plans, nil
}

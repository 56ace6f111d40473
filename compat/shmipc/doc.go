// Package shmipc offers the API of CloudWeGo's shmipc-go on top of
// github.com/goshm/shmipc, so that a program written for shmipc-go builds
// with only its import path changed:
//
//	import "github.com/cloudwego/shmipc-go"          // before
//	import "github.com/goshm/shmipc/compat/shmipc"   // after
//
// Every exported name of shmipc-go (commit 55c241e) is here with the same
// signature. The types wrap those of the root package, which does the
// work; Stream.Session, Session.Err and the root package's own API give
// what this package leaves out.
//
// # Behaviour that differs from shmipc-go
//
// Where shmipc-go falls back silently, races or trusts its peer, this
// package keeps the root package's behaviour:
//
//   - Everything read from the socket or shared memory is checked. A peer
//     that breaks the protocol ends its session with an error; it cannot
//     crash the process or harm other sessions.
//   - When shared memory or the peer's IO queue is full, a write waits for
//     room, bounded by its write deadline and 10 s, instead of sending the
//     data over the socket; then it fails with ErrTimeout (ErrQueueFull
//     for a full queue) and nothing is sent. Messages larger than shared
//     memory can hold still go over the socket.
//   - Reads (BufferReader, Read) wait until the bytes they ask for have
//     arrived, bounded by the read deadline; ErrNotEnoughData and
//     ErrNoMoreBuffer are never returned.
//   - Errors that programs compare with == are returned as the variables
//     themselves (ErrEndOfStream, which is io.EOF, ErrStreamClosed,
//     ErrSessionShutdown, ErrTimeout, ErrQueueFull, ErrSessionUnhealthy,
//     ErrStreamsExhausted); Session.Err tells why a session ended.
//
// Other differences:
//
//   - DefaultConfig has this library's defaults: a 128 MiB buffer region
//     with slices of up to 4 MiB, memfd regions (MemMapTypeMemFd), a
//     10 s ConnectionWriteTimeout; logs go to os.Stdout at warn level.
//     QueuePath is not used: the queue region is named after
//     ShareMemoryPathPrefix.
//   - NewListener and Listen replace a socket already at the path
//     atomically (shmipc-go removes it and binds): clients connected
//     before still reach the old server. SetUnlinkOnClose has no effect;
//     Close removes the socket file only while it is still the listener's
//     and no hot restart has handed it on.
//   - Listener.Close stops accepting and leaves the streams already
//     accepted open; each session ends with its last stream.
//   - Run calls OnNewStream in a goroutine per stream, so a slow
//     OnNewStream holds up no other stream.
//   - ListenWithBacklog's backlog is not a bound: streams not yet accepted
//     are bounded per session (4096), and a client that opens more ends its
//     session.
//   - SetCallbacks: slices OnData reads stay valid until it returns, after
//     which what it read is released; when the stream ends it is closed
//     and OnLocalClose (after Close) or OnRemoteClose (peer closed it, the
//     session ended, or the read deadline passed) is called.
//   - Flush's endStream has no effect on the wire. IsOpen learns that the
//     peer closed the stream when a read or write finds it.
//   - IsHotRestartDone is true once every session acknowledged the latest
//     HotRestart; after one that timed out (2 s) it stays false, the old
//     sessions stay up, and HotRestart may be called again.
//   - Metrics: the counters of GetMetrics and of Monitor reports count
//     since the previous one of the session. Monitors get a report of each
//     session every 30 s and a last one when it ends, each followed by
//     Flush. AllocShmErrorCount counts writes that waited for room;
//     QueueFullErrorCount is 0; EventConnErrorCount is 1 in the report of
//     a session that ended by an error; hot restart counts are those of the
//     session's listener or manager.
//   - CloseChan is closed within about 20 ms of the session's end.
//   - InitGlobalSessionManager returns the manager it made before when
//     called again. ID names a session "client-N" or "server-N".
//   - DebugBufferListDetail and DebugQueueDetail print the file's size and
//     the regions of this process's open sessions as they see them, not a
//     dump of the file's contents.
package shmipc

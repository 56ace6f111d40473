// Package shmipc offers the API of CloudWeGo's shmipc-go on top of
// github.com/goshm/shmipc, so that a program written for shmipc-go builds
// with only its import path changed:
//
//	import "github.com/cloudwego/shmipc-go"          // before
//	import "github.com/goshm/shmipc/compat/shmipc"   // after
//
// Every exported name of shmipc-go (commit 55c241e) is here with the same
// signature. The types wrap those of the root package, which does the
// work. Differences from shmipc-go, first those where it falls back
// silently, races or trusts its peer:
//
//   - Everything read from the socket or shared memory is checked: a peer
//     that breaks the protocol ends its session with an error, and cannot
//     crash the process or harm other sessions.
//   - When shared memory or the peer's IO queue is full, a write waits for
//     room, bounded by its write deadline and 10 s, instead of going over
//     the socket; then it fails with ErrTimeout (ErrQueueFull for a full
//     queue) and nothing is sent. Messages larger than shared memory can
//     hold still go over the socket.
//   - Reads wait until the bytes they ask for have arrived, bounded by the
//     read deadline: ErrNotEnoughData and ErrNoMoreBuffer never come.
//   - The errors programs compare with == are returned as the variables
//     themselves; Session.Err tells why a session ended.
//   - DefaultConfig has this library's defaults: a 128 MiB buffer region
//     with slices of up to 4 MiB, memfd regions, a 10 s
//     ConnectionWriteTimeout, logs to os.Stdout at warn level. QueuePath
//     is not used.
//   - NewListener and Listen replace a socket already at the path
//     atomically (shmipc-go removes it and binds); clients connected before
//     still reach the old server. SetUnlinkOnClose has no effect: Close
//     removes the socket file only while it is still the listener's and no
//     hot restart has handed it on.
//   - Listener.Close stops accepting and leaves accepted streams open; each
//     session ends with its last stream. Run calls OnNewStream in a
//     goroutine per stream. ListenWithBacklog's backlog is not a bound:
//     streams not yet accepted are bounded per session (4096), and a client
//     that opens more ends its session.
//   - SetCallbacks: slices OnData reads stay valid until it returns; when
//     the stream ends it is closed, and OnLocalClose (after Close) or
//     OnRemoteClose (the peer closed it, the session ended or the read
//     deadline passed) is called.
//   - Flush's endStream has no effect on the wire. IsOpen learns that the
//     peer closed the stream when a read or write finds it.
//   - IsHotRestartDone is true once every session acknowledged the latest
//     HotRestart; after one that timed out (2 s) it stays false, the old
//     sessions stay up, and HotRestart may be called again.
//   - GetMetrics and Monitor reports count since the previous one of the
//     session. Monitors get a report of each session every 30 s and a last
//     one when it ends, each followed by Flush. AllocShmErrorCount counts
//     writes that waited for room; QueueFullErrorCount is 0.
//   - CloseChan closes within about 20 ms of the session's end. A second
//     InitGlobalSessionManager returns the first manager. ID is
//     "client-N" or "server-N". DebugBufferListDetail and DebugQueueDetail
//     print the file's size and the regions of this process's open
//     sessions, not a dump of the file.
package shmipc

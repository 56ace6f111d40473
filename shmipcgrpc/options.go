package shmipcgrpc

import (
	"github.com/goshm/shmipc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/experimental"
)

// Target is a gRPC target for a client whose options come from DialOptions:
// the dialer ignores the address gRPC passes it (the manager dials the
// address it was configured with), and the passthrough scheme hands the
// name to the dialer without resolving it.
const Target = "passthrough:///shmipc"

// Sizes tuned for a lossless local transport. Flow control then only has to
// bound memory, not probe a network: the windows are large enough that a
// message of a few MiB never waits for a WINDOW_UPDATE, and they turn off
// gRPC's bandwidth-delay estimation (a PING per burst of data). Up to
// streamWindow bytes per stream and connWindow per connection may be in
// flight; they must fit in the shared buffer region (shmipc.Config's
// ShareMemoryBufferCap, 128 MiB by default), or the writes that find it full
// go over the socket.
const (
	// streamWindow is the flow-control window of each RPC.
	streamWindow = 16 << 20
	// connWindow is the flow-control window of each gRPC connection.
	connWindow = 64 << 20
	// writeBuffer is gRPC's write buffer: each time it is flushed is one
	// shared-memory message, so a 1 MiB message is 5 writes instead of the
	// 35 of gRPC's default 32 KiB. Larger buffers measured slower: the two
	// processes copy one piece while the next is written.
	writeBuffer = 256 << 10
	// readBuffer is gRPC's read buffer: none. A read from shared memory
	// makes no system call, so a read buffer would only add a copy; gRPC
	// reads each frame straight into its own buffers.
	readBuffer = 0
)

// pool is the buffer pool of every client and server these options make.
var pool = &dirtyPool{}

// DialOptions returns the options of a gRPC client over m: the context
// dialer, which opens a new stream of one of m's sessions for each
// connection, and the transport options (the windows and buffer sizes
// above, and a buffer pool that does not clear buffers). Use Target as
// the client's target. Credentials are the caller's:
// grpc.WithTransportCredentials(local.NewCredentials()) or
// insecure.NewCredentials(). Options given after these override them.
func DialOptions(m *shmipc.SessionManager) []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithContextDialer(m.DialContext),
		grpc.WithInitialWindowSize(streamWindow),
		grpc.WithInitialConnWindowSize(connWindow),
		grpc.WithWriteBufferSize(writeBuffer),
		grpc.WithReadBufferSize(readBuffer),
		experimental.WithBufferPool(pool),
	}
}

// ServerOptions returns the options of a gRPC server that serves a
// shmipc.Listener: the server side of DialOptions' transport options.
// Credentials are the caller's: grpc.Creds(local.NewCredentials()), or none
// for insecure ones. Options given after these override them.
func ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.InitialWindowSize(streamWindow),
		grpc.InitialConnWindowSize(connWindow),
		grpc.WriteBufferSize(writeBuffer),
		grpc.ReadBufferSize(readBuffer),
		experimental.BufferPool(pool),
	}
}

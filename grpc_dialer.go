package shmipc

import (
	"context"
	"net"
)

// Connections for RPC frameworks that dial a net.Conn themselves, such as
// gRPC: a stream of a SessionManager is the connection, and a Listener is
// the net.Listener the server serves.
//
//	m, err := shmipc.NewSessionManager(shmipc.SessionManagerConfig{Network: "unix", Address: sock})
//	conn, err := grpc.NewClient("passthrough:///shmipc", grpc.WithContextDialer(m.DialContext), ...)
//
//	ln, err := shmipc.Listen("unix", sock, nil)
//	err = grpcServer.Serve(ln)

// DialContext opens a new stream on one of the manager's sessions and returns
// it as a net.Conn (a *Stream), for grpc.WithContextDialer. addr is ignored:
// the manager dials its configured address (a gRPC target such as
// "passthrough:///shmipc" is fine).
//
// The stream is always new, never one from the pool: a protocol such as
// HTTP/2 must start at its beginning, which a pooled stream has passed. The
// caller owns the stream and must Close it, not give it to PutBack.
//
// While every session is down it waits, as GetStreamContext does, for one
// to be re-dialed until ctx is done, and then fails with an error wrapping
// ErrNoHealthySession and ctx.Err(); with ctx already done, with ctx.Err().
// After Close it fails with ErrSessionManagerClosed.
func (m *SessionManager) DialContext(ctx context.Context, addr string) (net.Conn, error) {
	st, err := m.getStreamContext(ctx, false)
	if err != nil {
		return nil, err // not a net.Conn holding a nil *Stream
	}
	return st, nil
}

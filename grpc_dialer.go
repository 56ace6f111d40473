package shmipc

import (
	"context"
	"fmt"
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
//
// The framework owns each connection for its lifetime and closes it, so a
// stream handed out this way never goes back to the manager's pool. Each
// connection is one stream of one of the manager's sessions; several
// connections (of one or several gRPC clients) share the sessions and their
// shared memory.

// DialContext opens a new stream on one of the manager's sessions and returns
// it as a net.Conn (a *Stream). Its signature is the one
// grpc.WithContextDialer takes; addr is ignored, since the manager dials the
// address it was configured with (a gRPC target such as
// "passthrough:///shmipc" is fine).
//
// The stream is always new, never an idle stream from the pool: a byte stream
// for a protocol such as HTTP/2 must start at the protocol's beginning, and a
// pooled stream has carried other requests whose server side is not expecting
// a new connection. The caller owns the stream and must Close it; it must not
// give it to PutBack.
//
// While every session of the manager is down (the server is restarting) it
// waits for one to be re-dialed, until ctx is done, and then fails with an
// error wrapping ErrNoHealthySession and ctx.Err(). With ctx already done
// it fails with ctx.Err(), as net.Dialer.DialContext does. After Close it
// fails with ErrSessionManagerClosed.
func (m *SessionManager) DialContext(ctx context.Context, addr string) (net.Conn, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	st, err := m.openStreamContext(ctx)
	if err != nil {
		return nil, err
	}
	return st, nil
}

// openStreamContext opens a stream on the next session that is up, taking
// the sessions in turn, and waits for one to come back while none is.
func (m *SessionManager) openStreamContext(ctx context.Context) (*Stream, error) {
	n := len(m.slots)
	for {
		m.mu.Lock()
		healthy, closed := m.healthy, m.closed
		m.mu.Unlock()
		if closed {
			return nil, ErrSessionManagerClosed
		}
		start := int(m.next.Add(1)-1) % n
		var lastErr error
		for k := range n {
			st, err := m.slots[(start+k)%n].openStream()
			if err == nil {
				return st, nil
			}
			lastErr = err
		}
		err := fmt.Errorf("%w: all %d sessions to %s %s are down: %w",
			ErrNoHealthySession, n, m.conf.Network, m.conf.Address, lastErr)
		select {
		case <-healthy:
		case <-m.ctx.Done():
			return nil, ErrSessionManagerClosed
		case <-ctx.Done():
			return nil, fmt.Errorf("%w (%w)", err, ctx.Err())
		}
	}
}

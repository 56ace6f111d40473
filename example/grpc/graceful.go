package main

import (
	"net"
	"sync"

	"github.com/goshm/shmipc"
)

// closeOnlyStopsAccepting gives grpc.Server a listener whose Close stops
// Accept but leaves the streams already accepted, and their sessions, open.
//
// grpc.Server.GracefulStop closes its listeners first and then waits for
// the calls in progress. shmipc's Listener.Close also closes every session
// of the listener, which would end those calls. So the server hands gRPC
// this listener, and closes the shmipc Listener itself once GracefulStop
// (or Stop) has returned. Streams that clients open after Close are closed
// at once; gRPC clients see that as a failed connection attempt.
//
// This is needed only while shmipc's Listener.Close closes the sessions
// (see "Graceful stop" in README.md); a net.Listener's
// Close, by contract, ends Accept only.
func closeOnlyStopsAccepting(ln *shmipc.Listener) net.Listener {
	l := &acceptOnly{Listener: ln, conns: make(chan net.Conn), closed: make(chan struct{})}
	go l.pump()
	return l
}

type acceptOnly struct {
	*shmipc.Listener
	conns  chan net.Conn
	closed chan struct{}
	once   sync.Once
}

// pump accepts streams until the shmipc Listener is closed, and hands them
// to Accept until Close.
func (l *acceptOnly) pump() {
	for {
		conn, err := l.Listener.Accept()
		if err != nil {
			return
		}
		select {
		case l.conns <- conn:
		case <-l.closed:
			conn.Close()
		}
	}
}

func (l *acceptOnly) Accept() (net.Conn, error) {
	select {
	case conn := <-l.conns:
		return conn, nil
	case <-l.closed:
		return nil, shmipc.ErrListenerClosed
	}
}

// Close stops Accept; the shmipc Listener stays open.
func (l *acceptOnly) Close() error {
	l.once.Do(func() { close(l.closed) })
	return nil
}

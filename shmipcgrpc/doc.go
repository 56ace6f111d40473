// Package shmipcgrpc runs gRPC over shmipc: one call for the client's
// options and one for the server's.
//
//	m, err := shmipc.NewSessionManager(shmipc.SessionManagerConfig{Network: "unix", Address: sock})
//	conn, err := grpc.NewClient(shmipcgrpc.Target, append(shmipcgrpc.DialOptions(m),
//		grpc.WithTransportCredentials(local.NewCredentials()))...)
//
//	ln, err := shmipc.Listen("unix", sock, nil)
//	srv := grpc.NewServer(append(shmipcgrpc.ServerOptions(), grpc.Creds(local.NewCredentials()))...)
//	err = srv.Serve(ln)
//
// Each gRPC connection is a new stream of one of the manager's sessions
// (see shmipc.SessionManager.DialContext); gRPC owns it and closes it.
//
// The options set the dialer and tune gRPC for a transport that neither
// loses nor reorders data and whose peer is on the same host: large
// flow-control windows, a large write buffer, no read buffer, and a buffer
// pool that does not clear the buffers it hands out. Credentials stay the
// caller's choice. credentials/local accepts a shmipc stream over a Unix
// socket (its addresses are of network "unix") and over TCP loopback.
//
// The package is a module of its own, so that gRPC is not a requirement of
// github.com/goshm/shmipc.
package shmipcgrpc

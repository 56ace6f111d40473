// Package shmipc is inter-process communication through shared memory for
// processes on one Linux host, speaking the Shmipc wire protocol of
// CloudWeGo's Go and Rust implementations.
//
// Two processes connect over a Unix socket (or TCP loopback). The client
// creates two shared regions, a buffer region of size-classed slices and an
// IO queue region, and hands them to the server: as memfds over SCM_RIGHTS
// (protocol version 3, the default) or as /dev/shm file paths (version 2).
// From then on message bytes travel through shared memory. The socket only
// carries small event frames: wake-ups, stream closes, and fallback data
// when shared memory cannot hold a message.
//
// A server accepts streams, which are net.Conns:
//
//	ln, err := shmipc.Listen("unix", "/tmp/echo.sock", nil)
//	...
//	for {
//		conn, err := ln.Accept()
//		if err != nil {
//			return err
//		}
//		go func() { defer conn.Close(); io.Copy(conn, conn) }()
//	}
//
// A client dials a session and opens streams on it:
//
//	sess, err := shmipc.Dial("unix", "/tmp/echo.sock", nil)
//	...
//	st, err := sess.OpenStream()
//	st.Write([]byte("hello"))
//	reply, err := st.BufferReader().ReadBytes(5) // zero-copy
//
// Stream.BufferWriter and Stream.BufferReader read and write shared memory
// directly; their documentation says how long returned slices stay valid.
// Stream.NetpollReader and Stream.NetpollWriter offer the same through
// CloudWeGo netpoll's interfaces, for RPC frameworks.
//
// Beyond one session: a SessionManager pools sessions to one address, hands
// out reusable streams and reconnects; Listener.Serve, Listener.ServeHandler
// and OnData serve streams with callbacks; Listener.HotRestart hands the
// clients of one server process over to the next. Session.Stats,
// AggregateStats and PublishExpvar report what is going on, and
// Config.Logger receives log records (none by default).
//
// When shared memory or the peer's queue is full, writers wait for room
// (bounded by their write deadline and Config.WriteSpaceTimeout) rather
// than degrade silently; see Config.FallbackWhenFull for the alternative.
//
// Everything read from the socket or from shared memory is checked before
// use. A peer that breaks the protocol ends its session with an error
// wrapping ErrProtocol that says what was wrong; other sessions go on.
//
// The wire protocol is that of the other Shmipc implementations, so a
// shmipc client can talk to their servers and the other way round; the
// README lists what has been checked, and docs/protocol.md describes the
// protocol and what this implementation adds locally.
package shmipc

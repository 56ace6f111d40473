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
// # Listening and dialling
//
// Listen returns a Listener, a net.Listener whose Accept returns the streams
// clients open; Dial returns a Session (Client and Server do the same over
// a net.Conn of your own):
//
//	ln, err := shmipc.Listen("unix", "/tmp/echo.sock", nil) // nil: DefaultConfig()
//	...
//	for {
//		conn, err := ln.Accept()
//		if err != nil {
//			return err
//		}
//		go func() { defer conn.Close(); io.Copy(conn, conn) }()
//	}
//
//	sess, err := shmipc.Dial("unix", "/tmp/echo.sock", nil)
//	...
//	defer sess.Close()
//	st, err := sess.OpenStream()
//	...
//	defer st.Close()
//	st.Write([]byte("hello"))
//	reply, err := st.BufferReader().ReadBytes(5) // zero-copy
//
// Listener.Close stops accepting and leaves the streams already accepted
// open, as a net.Listener's Close leaves its connections; each session then
// ends with its last stream. Listener.CloseAll ends every session at once.
//
// # Sessions and streams
//
// A Session carries any number of streams; the client opens them
// (Session.OpenStream) and the server accepts them (Listener.AcceptStream or
// Session.AcceptStream). A Stream is a net.Conn: Read, Write, deadlines,
// Close.
//
// # Zero-copy buffers
//
// Stream.BufferWriter builds a message directly in shared memory and
// Stream.Flush sends it; Stream.BufferReader returns received bytes in
// place. Their documentation says how long returned slices stay valid, and
// that the peer can still write bytes returned in place: copy what you must
// validate when the peer is not trusted (Stream.Read copies).
// Stream.NetpollReader and Stream.NetpollWriter offer the same through
// CloudWeGo netpoll's interfaces.
//
// # Configuration
//
// Config holds every size and timeout, DefaultConfig its defaults. When
// shared memory or the peer's queue is full, writers wait for room (bounded
// by their write deadline and Config.WriteSpaceTimeout), unless
// Config.FallbackWhenFull is set.
//
// # Errors
//
// Returned errors wrap the sentinels (ErrSessionClosed, ErrProtocol,
// ErrLimitExceeded, ...), for errors.Is. Timeouts satisfy net.Error and
// match os.ErrDeadlineExceeded; the errors of a stream after its own Close
// match net.ErrClosed.
//
// Everything read from the socket or from shared memory is checked before
// use. A peer that breaks the protocol ends its session with an error
// wrapping ErrProtocol that says what was wrong; other sessions go on.
//
// # Serving, pooling, hot restart
//
// Listener.Serve runs a function per stream; Listener.ServeHandler and
// OnData call back when data has arrived. A SessionManager pools sessions to
// one address, hands out reusable streams, re-dials sessions that die, and
// dials streams for gRPC (SessionManager.DialContext). Listener.HotRestart
// and ListenTakeover hand the clients of one server process to the next.
//
// # Statistics
//
// Session.Stats, AggregateStats and PublishExpvar report messages, bytes,
// wake-ups and the memory of the shared regions; Config.Logger receives log
// records (none by default).
//
// A shmipc client can talk to the other implementations' servers and the
// other way round; the README lists what has been checked, and
// docs/protocol.md describes the protocol and this implementation's local
// additions.
package shmipc

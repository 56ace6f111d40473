package shmipc_test

import (
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/goshm/shmipc"
)

// echoServer listens on a Unix socket in a new temporary directory and
// echoes every stream back to its sender. stop closes the listener and
// removes the directory.
func echoServer() (sock string, stop func()) {
	dir, err := os.MkdirTemp("", "shmipc-example")
	if err != nil {
		log.Fatal(err)
	}
	sock = filepath.Join(dir, "echo.sock")
	ln, err := shmipc.Listen("unix", sock, nil)
	if err != nil {
		log.Fatal(err)
	}
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				io.Copy(conn, conn)
			}()
		}
	}()
	return sock, func() {
		ln.Close()
		os.RemoveAll(dir)
	}
}

// A server and a client in one process: the server echoes what it reads.
func ExampleListen() {
	dir, err := os.MkdirTemp("", "shmipc-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "echo.sock")

	// Server: every stream a client opens arrives through Accept as a
	// net.Conn.
	ln, err := shmipc.Listen("unix", sock, nil) // nil: DefaultConfig()
	if err != nil {
		log.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return // the listener was closed
			}
			go func() {
				defer conn.Close()
				io.Copy(conn, conn)
			}()
		}
	}()

	// Client: one session, one stream.
	sess, err := shmipc.Dial("unix", sock, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer sess.Close()
	st, err := sess.OpenStream()
	if err != nil {
		log.Fatal(err)
	}
	defer st.Close()

	if _, err := st.Write([]byte("hello")); err != nil {
		log.Fatal(err)
	}
	reply := make([]byte, 5)
	if _, err := io.ReadFull(st, reply); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s\n", reply)
	// Output: hello
}

// Zero-copy in both directions: the client builds its message directly in
// shared memory, and the server reads it in place.
func ExampleStream_BufferWriter() {
	dir, err := os.MkdirTemp("", "shmipc-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "zc.sock")
	ln, err := shmipc.Listen("unix", sock, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer ln.Close()

	sess, err := shmipc.Dial("unix", sock, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer sess.Close()
	st, err := sess.OpenStream()
	if err != nil {
		log.Fatal(err)
	}
	defer st.Close()

	// Reserve hands out bytes of a shared-memory slice; Flush publishes them.
	buf, err := st.BufferWriter().Reserve(5)
	if err != nil {
		log.Fatal(err)
	}
	copy(buf, "hello")
	if err := st.Flush(false); err != nil {
		log.Fatal(err)
	}

	// The server learns of the stream with its first message.
	srv, err := ln.AcceptStream()
	if err != nil {
		log.Fatal(err)
	}
	defer srv.Close()
	req, err := srv.BufferReader().ReadBytes(5) // points into shared memory
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("server read %q\n", req)
	srv.BufferReader().ReleasePreviousRead() // req must not be used after this

	// The reply is built the same way, in the same region.
	if _, err := srv.BufferWriter().WriteString("world"); err != nil {
		log.Fatal(err)
	}
	if err := srv.Flush(false); err != nil {
		log.Fatal(err)
	}
	reply, err := st.BufferReader().ReadBytes(5)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("client read %q\n", reply)
	st.BufferReader().ReleasePreviousRead()
	// Output:
	// server read "hello"
	// client read "world"
}

// A read deadline makes a read that finds no data fail with a timeout. The
// stream stays usable: clear the deadline and read again.
func ExampleStream_SetReadDeadline() {
	sock, stop := echoServer()
	defer stop()

	sess, err := shmipc.Dial("unix", sock, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer sess.Close()
	st, err := sess.OpenStream()
	if err != nil {
		log.Fatal(err)
	}
	defer st.Close()

	// Nothing has been sent, so nothing comes back.
	st.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	buf := make([]byte, 4)
	_, err = st.Read(buf)
	fmt.Println("deadline exceeded:", errors.Is(err, os.ErrDeadlineExceeded))
	var ne net.Error
	fmt.Println("net.Error timeout:", errors.As(err, &ne) && ne.Timeout())

	st.SetReadDeadline(time.Time{})
	if _, err := st.Write([]byte("ping")); err != nil {
		log.Fatal(err)
	}
	if _, err := io.ReadFull(st, buf); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("then read %q\n", buf)
	// Output:
	// deadline exceeded: true
	// net.Error timeout: true
	// then read "ping"
}

// A configuration for file-backed regions, which also work over TCP
// loopback, with a smaller buffer region laid out like the other Shmipc
// implementations' default.
func ExampleConfig() {
	dir, err := os.MkdirTemp("", "shmipc-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)

	conf := shmipc.DefaultConfig()
	conf.MemMapType = shmipc.MemMapTypeDevShmFile
	// Region files are created next to this prefix (normally in /dev/shm). A
	// server only maps region files from the directory of its own prefix.
	conf.ShareMemoryPathPrefix = filepath.Join(dir, "shmipc")
	conf.ShareMemoryBufferCap = 4 << 20
	conf.BufferSliceSizes = shmipc.ReferenceSliceSizes() // 8, 32, 128 KiB at 50/30/20 %
	conf.QueueCap = 1024
	if err := conf.Verify(); err != nil {
		log.Fatal(err)
	}

	ln, err := shmipc.Listen("tcp", "127.0.0.1:0", conf)
	if err != nil {
		log.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				io.Copy(conn, conn)
			}()
		}
	}()

	// Memfd regions (the default) need a Unix socket.
	_, err = shmipc.Dial("tcp", ln.Addr().String(), nil)
	fmt.Println("memfd over TCP refused:", errors.Is(err, shmipc.ErrInvalidConfig))

	sess, err := shmipc.Dial("tcp", ln.Addr().String(), conf)
	if err != nil {
		log.Fatal(err)
	}
	defer sess.Close()
	st, err := sess.OpenStream()
	if err != nil {
		log.Fatal(err)
	}
	defer st.Close()
	if _, err := st.Write([]byte("hello over TCP")); err != nil {
		log.Fatal(err)
	}
	reply := make([]byte, len("hello over TCP"))
	if _, err := io.ReadFull(st, reply); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s\n", reply)
	// Output:
	// memfd over TCP refused: true
	// hello over TCP
}

// Only a client opens streams. There is no open message: the server learns
// of a stream when its first message arrives, and streams whose first
// messages are sent in order are accepted in that order.
func ExampleSession_OpenStream() {
	dir, err := os.MkdirTemp("", "shmipc-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "streams.sock")
	ln, err := shmipc.Listen("unix", sock, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer ln.Close()

	sess, err := shmipc.Dial("unix", sock, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer sess.Close()
	for _, msg := range []string{"first", "second"} {
		st, err := sess.OpenStream()
		if err != nil {
			log.Fatal(err)
		}
		defer st.Close()
		fmt.Printf("client opened stream %d\n", st.ID())
		if _, err := st.Write([]byte(msg)); err != nil {
			log.Fatal(err)
		}
	}

	var srvSess *shmipc.Session
	for _, n := range []int{len("first"), len("second")} {
		st, err := ln.AcceptStream()
		if err != nil {
			log.Fatal(err)
		}
		defer st.Close()
		msg, err := st.BufferReader().ReadBytes(n)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("server accepted stream %d: %q\n", st.ID(), msg)
		srvSess = st.Session()
	}

	// A server session cannot open streams.
	_, err = srvSess.OpenStream()
	fmt.Println("server session:", errors.Is(err, shmipc.ErrNotSupported))
	// Output:
	// client opened stream 2
	// client opened stream 3
	// server accepted stream 2: "first"
	// server accepted stream 3: "second"
	// server session: true
}

// A client pool: the manager keeps sessions to one server, hands out
// streams, takes them back for the next request, and re-dials a session that
// dies. The server answers each stream with Listener.Serve.
func ExampleSessionManager() {
	dir, err := os.MkdirTemp("", "shmipc-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "pool.sock")
	ln, err := shmipc.Listen("unix", sock, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer ln.Close()
	go ln.Serve(func(st *shmipc.Stream) { // a goroutine per stream
		defer st.Close()
		buf := make([]byte, 64)
		for {
			n, err := st.Read(buf)
			if err != nil {
				return
			}
			if _, err := st.Write(buf[:n]); err != nil {
				return
			}
		}
	})

	m, err := shmipc.NewSessionManager(shmipc.SessionManagerConfig{Network: "unix", Address: sock, SessionNum: 2})
	if err != nil {
		log.Fatal(err)
	}
	defer m.Close()
	for i := range 3 {
		st, err := m.GetStream()
		if err != nil {
			log.Fatal(err)
		}
		msg := fmt.Sprintf("request %d", i)
		if _, err := st.Write([]byte(msg)); err != nil {
			log.Fatal(err)
		}
		reply := make([]byte, len(msg))
		if _, err := io.ReadFull(st, reply); err != nil {
			log.Fatal(err)
		}
		fmt.Println(string(reply))
		m.PutBack(st) // reused by the next GetStream
	}
	// Output:
	// request 0
	// request 1
	// request 2
}

package shmipc_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/goshm/shmipc"
)

// exampleSocket returns a socket path in a new temporary directory, and a
// function that removes the directory.
func exampleSocket(name string) (string, func()) {
	dir, err := os.MkdirTemp("", "shmipc-example")
	if err != nil {
		log.Fatal(err)
	}
	return filepath.Join(dir, name), func() { os.RemoveAll(dir) }
}

// ask sends msg on a new stream of sess and returns the reply, which is
// as long as msg.
func ask(sess *shmipc.Session, msg string) string {
	st, err := sess.OpenStream()
	if err != nil {
		log.Fatal(err)
	}
	defer st.Close()
	if _, err := st.Write([]byte(msg)); err != nil {
		log.Fatal(err)
	}
	reply := make([]byte, len(msg))
	if _, err := io.ReadFull(st, reply); err != nil {
		log.Fatal(err)
	}
	return string(reply)
}

// A synchronous server: Serve runs the handler in a goroutine of its own for
// every stream, and the handler reads requests and writes replies in a loop,
// as a net/http handler would.
func ExampleListener_Serve() {
	sock, cleanup := exampleSocket("serve.sock")
	defer cleanup()
	ln, err := shmipc.Listen("unix", sock, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer ln.Close()
	go ln.Serve(func(st *shmipc.Stream) { // Serve closes st when this returns
		buf := make([]byte, 4096)
		for {
			n, err := st.Read(buf)
			if err != nil {
				return // io.EOF: the client closed the stream
			}
			if _, err := st.Write([]byte(strings.ToUpper(string(buf[:n])))); err != nil {
				return
			}
		}
	})

	sess, err := shmipc.Dial("unix", sock, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer sess.Close()
	fmt.Println(ask(sess, "hello"))
	// Output: HELLO
}

// lineReverser answers every newline-terminated line with the line
// reversed. Its OnData is called whenever data has arrived; a line not yet
// complete is left unread until more data comes.
type lineReverser struct{}

func (lineReverser) OnData(st *shmipc.Stream) error {
	r := st.BufferReader()
	for {
		buf, err := r.Peek(r.Len())
		if err != nil {
			return err
		}
		i := strings.IndexByte(string(buf), '\n')
		if i < 0 {
			return nil // an incomplete line: wait for the rest
		}
		line, err := r.ReadBytes(i + 1) // valid until OnData returns
		if err != nil {
			return err
		}
		out := []byte(string(line[:i]))
		for a, b := 0, len(out)-1; a < b; a, b = a+1, b-1 {
			out[a], out[b] = out[b], out[a]
		}
		if _, err := st.Write(append(out, '\n')); err != nil {
			return err
		}
	}
}

func (lineReverser) OnClose(st *shmipc.Stream, err error) {
	if err != nil {
		log.Printf("stream %d: %v", st.ID(), err)
	}
}

// An asynchronous server: ServeHandler calls the handler's OnData each time
// data arrives on a stream, and OnClose once when the stream ends.
func ExampleListener_ServeHandler() {
	sock, cleanup := exampleSocket("handler.sock")
	defer cleanup()
	ln, err := shmipc.Listen("unix", sock, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer ln.Close()
	go ln.ServeHandler(lineReverser{})

	sess, err := shmipc.Dial("unix", sock, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer sess.Close()
	fmt.Print(ask(sess, "stressed\ndrawer\n"))
	// Output:
	// desserts
	// reward
}

// reverserSession starts a lineReverser server and dials it; stop closes
// both.
func reverserSession() (sess *shmipc.Session, stop func()) {
	sock, cleanup := exampleSocket("reverser.sock")
	ln, err := shmipc.Listen("unix", sock, nil)
	if err != nil {
		log.Fatal(err)
	}
	go ln.ServeHandler(lineReverser{})
	sess, err = shmipc.Dial("unix", sock, nil)
	if err != nil {
		log.Fatal(err)
	}
	return sess, func() {
		sess.Close()
		ln.Close()
		cleanup()
	}
}

// OnData also serves the client side: here the client handles its replies
// as they come instead of waiting for each one.
func ExampleOnData() {
	sess, stop := reverserSession() // a ServeHandler(lineReverser{}) server
	defer stop()
	st, err := sess.OpenStream()
	if err != nil {
		log.Fatal(err)
	}
	replies := make(chan string, 3)
	done := shmipc.OnData(st, func(st *shmipc.Stream) error {
		r := st.BufferReader()
		buf, err := r.ReadBytes(r.Len())
		if err != nil {
			return err
		}
		replies <- string(buf) // copied: buf is valid only until we return
		return nil
	})
	var got strings.Builder
	for _, word := range []string{"live\n", "stop\n", "loop\n"} {
		if _, err := st.Write([]byte(word)); err != nil {
			log.Fatal(err)
		}
	}
	for got.Len() < 15 {
		got.WriteString(<-replies)
	}
	fmt.Print(got.String())
	st.Close() // ends the OnData goroutine
	if err := <-done; err != nil {
		log.Fatal(err)
	}
	// Output:
	// evil
	// pots
	// pool
}

// Hot restart: a new server takes over the socket path of a running one,
// the old server tells its clients, and a SessionManager moves to the new
// server without failing a request. (Here both servers are in one process;
// in practice the new one is a new process, told out of band when to start.)
func ExampleListener_HotRestart() {
	sock, cleanup := exampleSocket("restart.sock")
	defer cleanup()
	serve := func(ln *shmipc.Listener, name string) {
		ln.Serve(func(st *shmipc.Stream) {
			buf := make([]byte, 64)
			for {
				n, err := st.Read(buf)
				if err != nil {
					return
				}
				if _, err := st.Write([]byte(name + ":" + string(buf[:n]))); err != nil {
					return
				}
			}
		})
	}
	old, err := shmipc.Listen("unix", sock, nil)
	if err != nil {
		log.Fatal(err)
	}
	go serve(old, "old")

	m, err := shmipc.NewSessionManager(shmipc.SessionManagerConfig{Network: "unix", Address: sock})
	if err != nil {
		log.Fatal(err)
	}
	defer m.Close()
	request := func() string {
		st, err := m.GetStream()
		if err != nil {
			log.Fatal(err)
		}
		if _, err := st.Write([]byte("ping")); err != nil {
			log.Fatal(err)
		}
		reply := make([]byte, 8)
		if _, err := io.ReadFull(st, reply); err != nil {
			log.Fatal(err)
		}
		m.PutBack(st)
		return string(reply)
	}
	fmt.Println(request())

	// The new server answers on the path from now on.
	next, err := shmipc.ListenTakeover(sock, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer next.Close()
	go serve(next, "new")

	// The old server tells its clients and waits until they have moved.
	for {
		err = old.HotRestart(1)
		if !errors.Is(err, shmipc.ErrHotRestartHandshaking) {
			break
		}
		time.Sleep(10 * time.Millisecond) // a client is still connecting
	}
	if err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := old.WaitHotRestart(ctx); err != nil {
		log.Fatal(err)
	}
	old.Close() // leaves the path to the new server

	fmt.Println(request())
	// Output:
	// old:ping
	// new:ping
}

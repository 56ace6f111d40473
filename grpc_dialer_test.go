package shmipc_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goshm/shmipc"
)

// dialerServer echoes every stream it accepts and counts them.
type dialerServer struct {
	ln       *shmipc.Listener
	accepted atomic.Int64
	ended    chan struct{} // a stream's echo ended (the client closed it)
}

func startDialerServer(t testing.TB, sock string) *dialerServer {
	t.Helper()
	ln, err := shmipc.Listen("unix", sock, nil)
	if err != nil {
		t.Fatal(err)
	}
	s := &dialerServer{ln: ln, ended: make(chan struct{}, 16)}
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			s.accepted.Add(1)
			go func() {
				defer conn.Close()
				io.Copy(conn, conn)
				s.ended <- struct{}{}
			}()
		}
	}()
	return s
}

func dialerManager(t testing.TB, sock string) *shmipc.SessionManager {
	t.Helper()
	m, err := shmipc.NewSessionManager(shmipc.SessionManagerConfig{
		Network:             "unix",
		Address:             sock,
		MinReconnectBackoff: 5 * time.Millisecond,
		MaxReconnectBackoff: 50 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// echoOnce writes msg on conn and reads it back.
func echoOnce(conn net.Conn, msg string) error {
	if _, err := io.WriteString(conn, msg); err != nil {
		return err
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(conn, got); err != nil {
		return err
	}
	if string(got) != msg {
		return fmt.Errorf("echo %q, want %q", got, msg)
	}
	return nil
}

func dialerSock(t testing.TB) string {
	return filepath.Join(t.TempDir(), "dialer.sock")
}

// DialContext opens a new stream even when the pool holds an idle one, and
// the stream it returns never goes into the pool.
func TestDialContextOpensNewStreams(t *testing.T) {
	sock := dialerSock(t)
	srv := startDialerServer(t, sock)
	defer srv.ln.Close()
	m := dialerManager(t, sock)

	pooled, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	if err := echoOnce(pooled, "pooled"); err != nil {
		t.Fatal(err)
	}
	m.PutBack(pooled)
	if n := m.IdleStreams(); n != 1 {
		t.Fatalf("%d idle streams after PutBack, want 1", n)
	}

	conn, err := m.DialContext(context.Background(), "ignored")
	if err != nil {
		t.Fatal(err)
	}
	st, ok := conn.(*shmipc.Stream)
	if !ok {
		t.Fatalf("DialContext returned a %T, want a *shmipc.Stream", conn)
	}
	if st.ID() == pooled.ID() {
		t.Fatalf("DialContext handed out the pooled stream %d", st.ID())
	}
	if err := echoOnce(conn, "dialed"); err != nil {
		t.Fatal(err)
	}
	if got := srv.accepted.Load(); got != 2 {
		t.Fatalf("the server accepted %d streams, want 2 (the pooled one and the dialed one)", got)
	}
	if n := m.IdleStreams(); n != 1 {
		t.Fatalf("%d idle streams while the dialed stream is in use, want 1", n)
	}

	conn.Close()
	select {
	case <-srv.ended:
	case <-time.After(10 * time.Second):
		t.Fatal("the server's end of the dialed stream did not see it close")
	}
	if n := m.IdleStreams(); n != 1 {
		t.Fatalf("%d idle streams after the dialed stream was closed, want 1: it must not be pooled", n)
	}
}

// While the server is down, DialContext waits for the manager to re-dial:
// until its context ends (the error says both why), or until the server is
// back (it then succeeds).
func TestDialContextWaitsForSession(t *testing.T) {
	sock := dialerSock(t)
	srv := startDialerServer(t, sock)
	m := dialerManager(t, sock)
	srv.ln.Close()
	waitFor(t, "the manager sees its session die", func() bool { return len(m.Sessions()) == 0 })

	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	_, err := m.DialContext(ctx, "")
	cancel()
	if !errors.Is(err, shmipc.ErrNoHealthySession) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("DialContext while the server is down: %v, want ErrNoHealthySession and DeadlineExceeded", err)
	}

	type result struct {
		conn net.Conn
		err  error
	}
	dialed := make(chan result, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := m.DialContext(ctx, "")
		dialed <- result{conn, err}
	}()
	srv = startDialerServer(t, sock)
	defer srv.ln.Close()
	r := <-dialed
	if r.err != nil {
		t.Fatalf("DialContext after the server came back: %v", r.err)
	}
	defer r.conn.Close()
	if err := echoOnce(r.conn, "back"); err != nil {
		t.Fatal(err)
	}
}

// Closing the manager ends a DialContext that waits for a session, and later
// calls fail at once, with ErrSessionManagerClosed.
func TestDialContextAfterClose(t *testing.T) {
	sock := dialerSock(t)
	srv := startDialerServer(t, sock)
	m := dialerManager(t, sock)
	srv.ln.Close()
	waitFor(t, "the manager sees its session die", func() bool { return len(m.Sessions()) == 0 })

	errc := make(chan error, 1)
	go func() {
		_, err := m.DialContext(context.Background(), "")
		errc <- err
	}()
	time.Sleep(20 * time.Millisecond) // usually long enough for it to wait; the result is the same if not
	m.Close()
	if err := <-errc; !errors.Is(err, shmipc.ErrSessionManagerClosed) {
		t.Fatalf("DialContext waiting when the manager closed: %v, want ErrSessionManagerClosed", err)
	}
	if _, err := m.DialContext(context.Background(), ""); !errors.Is(err, shmipc.ErrSessionManagerClosed) {
		t.Fatalf("DialContext after Close: %v, want ErrSessionManagerClosed", err)
	}
}

func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 10s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// A gRPC client takes DialContext as its dialer, and a gRPC server serves the
// Listener (example/grpc has the whole program):
//
//	conn, err := grpc.NewClient("passthrough:///shmipc",
//		grpc.WithContextDialer(manager.DialContext),
//		grpc.WithTransportCredentials(insecure.NewCredentials()))
//
//	err = grpcServer.Serve(listener)
//
// Here the connection is used directly, as any net.Conn.
func ExampleSessionManager_DialContext() {
	// The server: an echo over shmipc.Listen (with gRPC, grpcServer.Serve(ln)).
	sock, stop := echoServer()
	defer stop()

	manager, err := shmipc.NewSessionManager(shmipc.SessionManagerConfig{Network: "unix", Address: sock})
	if err != nil {
		log.Fatal(err)
	}
	defer manager.Close()

	conn, err := manager.DialContext(context.Background(), "shmipc") // what gRPC calls
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close() // the caller owns the connection: close it, never PutBack
	io.WriteString(conn, "hello over shared memory")
	reply := make([]byte, 24)
	if _, err := io.ReadFull(conn, reply); err != nil {
		log.Fatal(err)
	}
	fmt.Println(string(reply))
	// Output: hello over shared memory
}

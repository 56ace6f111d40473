package shmipc

// Closing a stream or its session: end-of-stream both ways, half-close,
// what streams do when either session closes, and Flush after Close.

import (
	"bytes"
	"errors"
	"io"
	"testing"
	"time"
)

// TestStreamCloseSemantics checks end-of-stream in both directions, writes
// after the peer's close, use after a local close, and that Close is
// idempotent.
func TestStreamCloseSemantics(t *testing.T) {
	forEachStreamMode(t, func(t *testing.T, mode MemMapType) {
		p := newStreamTestPair(t, mode, nil)

		t.Run("ClientCloseServerReadsAllThenEOF", func(t *testing.T) {
			st := openStreamT(t, p.client)
			var msgs [][]byte
			for i, n := range []int{100, 8173, 300000, 1, 131053, 64} {
				msgs = append(msgs, streamPattern(n, uint64(1000+i)))
			}
			writeAll(t, st, msgs)
			if err := st.Close(); err != nil { // right after the writes
				t.Fatalf("Close: %v", err)
			}
			srv := acceptStreamT(t, p.server)
			got, err := readUntilError(srv)
			if err != io.EOF {
				t.Fatalf("server read ended with %v after %d bytes, want io.EOF", err, len(got))
			}
			if want := bytes.Join(msgs, nil); !bytes.Equal(got, want) {
				t.Fatalf("server read %d bytes, want the %d bytes sent before the close", len(got), len(want))
			}
			if _, err := srv.Read(make([]byte, 1)); err != io.EOF {
				t.Fatalf("second Read after end of stream: %v, want io.EOF", err)
			}
			_, err = srv.Write([]byte("late"))
			requireErrorIs(t, err, ErrStreamPeerClosed, "server Write after the client closed")
			if err := srv.Close(); err != nil {
				t.Fatalf("server Close of a half-closed stream: %v", err)
			}
			waitFreeListsFull(t, p.client)
		})

		t.Run("ServerCloseAfterReply", func(t *testing.T) {
			st := openStreamT(t, p.client)
			writeAll(t, st, [][]byte{[]byte("ping")})
			srv := acceptStreamT(t, p.server)
			req := make([]byte, 4)
			if _, err := io.ReadFull(srv, req); err != nil || string(req) != "ping" {
				t.Fatalf("server read %q, %v", req, err)
			}
			reply := [][]byte{streamPattern(5000, 1), streamPattern(200000, 2), []byte("end")}
			writeAll(t, srv, reply)
			if err := srv.Close(); err != nil {
				t.Fatalf("server Close: %v", err)
			}
			got, err := readUntilError(st)
			if err != io.EOF {
				t.Fatalf("client read ended with %v after %d bytes, want io.EOF", err, len(got))
			}
			if want := bytes.Join(reply, nil); !bytes.Equal(got, want) {
				t.Fatalf("client read %d bytes, want the %d-byte reply", len(got), len(want))
			}
			_, err = st.Write([]byte("after close"))
			requireErrorIs(t, err, ErrStreamPeerClosed, "client Write after the server closed")
			if err := st.Close(); err != nil {
				t.Fatalf("client Close of a half-closed stream: %v", err)
			}
			waitFreeListsFull(t, p.client)
		})

		t.Run("UseAfterLocalClose", func(t *testing.T) {
			st := openStreamT(t, p.client)
			writeAll(t, st, [][]byte{[]byte("x")})
			srv := acceptStreamT(t, p.server)
			if err := st.Close(); err != nil {
				t.Fatalf("Close: %v", err)
			}
			if err := st.Close(); err != nil {
				t.Fatalf("second Close: %v, want nil", err)
			}
			buf := make([]byte, 8)
			_, err := st.Read(buf)
			requireErrorIs(t, err, ErrStreamClosed, "Read after Close")
			_, err = st.Write([]byte("y"))
			requireErrorIs(t, err, ErrStreamClosed, "Write after Close")
			br, bw := st.BufferReader(), st.BufferWriter()
			_, err = br.ReadBytes(1)
			requireErrorIs(t, err, ErrStreamClosed, "ReadBytes after Close")
			_, err = br.Peek(1)
			requireErrorIs(t, err, ErrStreamClosed, "Peek after Close")
			_, err = br.ReadByte()
			requireErrorIs(t, err, ErrStreamClosed, "ReadByte after Close")
			_, err = br.Discard(1)
			requireErrorIs(t, err, ErrStreamClosed, "Discard after Close")
			_, err = bw.Reserve(1)
			requireErrorIs(t, err, ErrStreamClosed, "Reserve after Close")
			_, err = bw.WriteBytes([]byte("z"))
			requireErrorIs(t, err, ErrStreamClosed, "WriteBytes after Close")

			// The peer sees the data, then the end of the stream.
			got, err := readUntilError(srv)
			if err != io.EOF || string(got) != "x" {
				t.Fatalf("server read %q then %v, want \"x\" then io.EOF", got, err)
			}
		})

		t.Run("CloseWakesBlockedRead", func(t *testing.T) {
			st := openStreamT(t, p.client)
			done := make(chan error, 1)
			go func() {
				_, err := st.Read(make([]byte, 8))
				done <- err
			}()
			time.Sleep(20 * time.Millisecond) // let the Read block
			if err := st.Close(); err != nil {
				t.Fatalf("Close: %v", err)
			}
			requireErrorIs(t, waitResult(t, done, "Read on a closed stream"), ErrStreamClosed, "Read blocked during Close")
		})

		t.Run("ConcurrentClose", func(t *testing.T) {
			st := openStreamT(t, p.client)
			writeAll(t, st, [][]byte{streamPattern(10000, 3)})
			errs := make(chan error, 8)
			for range 8 {
				go func() { errs <- st.Close() }()
			}
			for range 8 {
				if err := <-errs; err != nil {
					t.Errorf("concurrent Close: %v", err)
				}
			}
			srv := acceptStreamT(t, p.server)
			got, err := readUntilError(srv)
			if err != io.EOF || len(got) != 10000 {
				t.Fatalf("server read %d bytes then %v, want 10000 then io.EOF", len(got), err)
			}
			srv.Close()
			waitFreeListsFull(t, p.client)
		})
	})
}

// TestStreamHalfClose checks that data the peer sent before closing stays
// readable, with the right Len, and that the end of the stream follows it.
func TestStreamHalfClose(t *testing.T) {
	forEachStreamMode(t, func(t *testing.T, mode MemMapType) {
		p := newStreamTestPair(t, mode, nil)
		a := openStreamT(t, p.client)
		writeAll(t, a, [][]byte{[]byte("A")})
		b := openStreamT(t, p.client)
		writeAll(t, b, [][]byte{[]byte("B")})
		srvA, srvB := acceptStreamT(t, p.server), acceptStreamT(t, p.server)
		one := make([]byte, 1)
		if _, err := io.ReadFull(srvA, one); err != nil {
			t.Fatal(err)
		}
		if one[0] == 'B' {
			srvA, srvB = srvB, srvA
		}
		if _, err := io.ReadFull(srvB, one); err != nil {
			t.Fatal(err)
		}

		msgs := [][]byte{streamPattern(100, 1), streamPattern(9000, 2), streamPattern(300000, 3)}
		want := bytes.Join(msgs, nil)
		writeAll(t, srvA, msgs)
		if err := srvA.Close(); err != nil {
			t.Fatalf("server Close: %v", err)
		}
		// Stream b's message is queued after a's close, so once it has arrived
		// the client has processed the close of a.
		writeAll(t, srvB, [][]byte{[]byte("done")})
		done := make([]byte, 4)
		if _, err := io.ReadFull(b, done); err != nil {
			t.Fatalf("read barrier message: %v", err)
		}

		br := a.BufferReader()
		if n := br.Len(); n != len(want) {
			t.Fatalf("Len() of the half-closed stream = %d, want %d", n, len(want))
		}
		_, err := a.Write([]byte("no"))
		requireErrorIs(t, err, ErrStreamPeerClosed, "Write on a stream the peer closed")

		peek, err := br.Peek(10)
		if err != nil || !bytes.Equal(peek, want[:10]) {
			t.Fatalf("Peek(10) = %x, %v", peek, err)
		}
		head, err := br.ReadBytes(150) // spans the first two messages
		if err != nil || !bytes.Equal(head, want[:150]) {
			t.Fatalf("ReadBytes(150) on the half-closed stream: %v (equal=%v)", err, bytes.Equal(head, want[:150]))
		}
		rest := make([]byte, len(want)-150-3)
		if _, err := io.ReadFull(a, rest); err != nil || !bytes.Equal(rest, want[150:len(want)-3]) {
			t.Fatalf("reading the buffered data: %v", err)
		}
		if n := br.Len(); n != 3 {
			t.Fatalf("Len() = %d with 3 bytes left", n)
		}
		if _, err := br.ReadBytes(10); err != io.ErrUnexpectedEOF {
			t.Fatalf("ReadBytes(10) with 3 bytes left before the end: %v, want io.ErrUnexpectedEOF", err)
		}
		tail, err := readUntilError(a)
		if err != io.EOF {
			t.Fatalf("read after the buffered data: %v, want io.EOF", err)
		}
		if len(tail) > 3 || !bytes.Equal(tail, want[len(want)-len(tail):]) {
			t.Fatalf("last bytes read = %x, want a suffix of %x", tail, want[len(want)-3:])
		}
		if _, err := br.ReadBytes(1); err != io.EOF {
			t.Fatalf("ReadBytes(1) at the end of the stream: %v, want io.EOF", err)
		}
		if _, err := br.ReadByte(); err != io.EOF {
			t.Fatalf("ReadByte at the end of the stream: %v, want io.EOF", err)
		}
		if err := a.Close(); err != nil {
			t.Fatalf("Close: %v", err)
		}
		b.Close()
		srvB.Close()
		waitFreeListsFull(t, p.client)
	})
}

// TestStreamSessionClose checks what streams and sessions do when a session
// is closed, and the role restrictions of OpenStream and AcceptStream.
func TestStreamSessionClose(t *testing.T) {
	forEachStreamMode(t, func(t *testing.T, mode MemMapType) {
		t.Run("ClientCloseWakesReads", func(t *testing.T) {
			p := newStreamTestPair(t, mode, nil)
			st := openStreamT(t, p.client)
			writeAll(t, st, [][]byte{[]byte("x")})
			srv := acceptStreamT(t, p.server)
			if _, err := io.ReadFull(srv, make([]byte, 1)); err != nil {
				t.Fatal(err)
			}
			clientRead, serverRead := make(chan error, 1), make(chan error, 1)
			go func() {
				_, err := st.Read(make([]byte, 8))
				clientRead <- err
			}()
			go func() {
				_, err := srv.Read(make([]byte, 8))
				serverRead <- err
			}()
			time.Sleep(20 * time.Millisecond) // let the Reads block
			if err := p.client.Close(); err != nil {
				t.Fatalf("Session.Close: %v", err)
			}
			requireErrorIs(t, waitResult(t, clientRead, "client Read"), ErrSessionClosed, "client Read blocked during Session.Close")
			requireErrorIs(t, waitResult(t, serverRead, "server Read"), ErrSessionClosed, "server Read when the client session closed")
			_, err := p.client.OpenStream()
			requireErrorIs(t, err, ErrSessionClosed, "OpenStream on a closed session")
			if err := p.client.Close(); err != nil {
				t.Fatalf("second Session.Close: %v", err)
			}
			if err := st.Close(); err != nil {
				t.Fatalf("stream Close after Session.Close: %v", err)
			}
		})

		t.Run("WriteAfterSessionClose", func(t *testing.T) {
			// ErrSessionClosed is documented for "the methods of a closed
			// session and of its streams"; ErrStreamClosed only for a stream's
			// own Close and a peer's close of the stream.
			p := newStreamTestPair(t, mode, nil)
			st := openStreamT(t, p.client)
			writeAll(t, st, [][]byte{[]byte("x")})
			srv := acceptStreamT(t, p.server)
			p.client.Close()
			if _, err := st.Write([]byte("y")); !errors.Is(err, ErrSessionClosed) {
				t.Errorf("Write on a stream of a session closed locally: got %v, want an error wrapping ErrSessionClosed", err)
			}
			waitSessionClosed(t, p.server, 5*time.Second)
			if _, err := srv.Write([]byte("y")); !errors.Is(err, ErrSessionClosed) {
				t.Errorf("Write on a stream whose session the peer closed: got %v, want an error wrapping ErrSessionClosed", err)
			}
		})

		t.Run("ServerSession", func(t *testing.T) {
			p := newStreamTestPair(t, mode, nil)
			_, err := p.server.OpenStream()
			requireErrorIs(t, err, ErrNotSupported, "OpenStream on a server session")
			_, err = p.client.AcceptStream()
			requireErrorIs(t, err, ErrNotSupported, "AcceptStream on a client session")

			st := openStreamT(t, p.client)
			writeAll(t, st, [][]byte{[]byte("x")})
			srv := acceptStreamT(t, p.server)
			if _, err := io.ReadFull(srv, make([]byte, 1)); err != nil {
				t.Fatal(err)
			}
			accept, read := make(chan error, 1), make(chan error, 1)
			go func() {
				_, err := p.server.AcceptStream()
				accept <- err
			}()
			go func() {
				_, err := srv.Read(make([]byte, 8))
				read <- err
			}()
			time.Sleep(20 * time.Millisecond) // let both block
			if err := p.server.Close(); err != nil {
				t.Fatalf("server Session.Close: %v", err)
			}
			requireErrorIs(t, waitResult(t, read, "server Read"), ErrSessionClosed, "server Read blocked during Session.Close")
			requireErrorIs(t, waitResult(t, accept, "AcceptStream"), ErrSessionClosed, "AcceptStream blocked during Session.Close")
			_, err = p.server.AcceptStream()
			requireErrorIs(t, err, ErrSessionClosed, "AcceptStream on a closed server session")
			_, err = p.server.OpenStream()
			requireErrorIs(t, err, ErrNotSupported, "OpenStream on a closed server session")
		})
	})
}

// TestStreamPeerSessionClosedKeepsData checks that data received before the
// peer's session ended stays readable, followed by ErrSessionClosed.
func TestStreamPeerSessionClosedKeepsData(t *testing.T) {
	forEachStreamMode(t, func(t *testing.T, mode MemMapType) {
		p := newStreamTestPair(t, mode, nil)
		st := openStreamT(t, p.client)
		writeAll(t, st, [][]byte{[]byte("req")})
		srv := acceptStreamT(t, p.server)
		if _, err := io.ReadFull(srv, make([]byte, 3)); err != nil {
			t.Fatal(err)
		}
		msgs := [][]byte{streamPattern(100, 1), streamPattern(300000, 2)}
		want := bytes.Join(msgs, nil)
		writeAll(t, srv, msgs)
		if err := p.server.Close(); err != nil {
			t.Fatalf("server Session.Close: %v", err)
		}
		waitSessionClosed(t, p.client, 5*time.Second)
		requireErrorIs(t, p.client.Err(), ErrSessionClosed, "client Session.Err after the server closed")

		if n := st.BufferReader().Len(); n != len(want) {
			t.Fatalf("Len() after the peer session ended = %d, want %d", n, len(want))
		}
		got, err := readUntilError(st)
		if !bytes.Equal(got, want) {
			t.Fatalf("read %d bytes after the peer session ended, want %d (first difference at %d)", len(got), len(want), firstDiff(got, want))
		}
		requireErrorIs(t, err, ErrSessionClosed, "Read after the buffered data of an ended session")
		if err := st.Close(); err != nil {
			t.Fatalf("Close: %v", err)
		}
	})
}

// TestFlushAfterCloseFails builds a message with each writing API, has
// another goroutine Close the stream, which discards the message, and
// then flushes: the Flush must fail with ErrStreamClosed, not report the
// message sent.
func TestFlushAfterCloseFails(t *testing.T) {
	s := dialEchoSession(t, nil)
	msg := []byte("a message Close discards")
	for _, api := range []string{"WriteBytes", "Reserve", "Malloc"} {
		t.Run(api, func(t *testing.T) {
			st, err := s.OpenStream()
			if err != nil {
				t.Fatal(err)
			}
			var p []byte
			switch api {
			case "WriteBytes":
				_, err = st.BufferWriter().WriteBytes(msg)
			case "Reserve":
				p, err = st.BufferWriter().Reserve(len(msg))
			case "Malloc":
				p, err = st.NetpollWriter().Malloc(len(msg))
			}
			if err != nil {
				t.Fatal(err)
			}
			copy(p, msg)
			closed := make(chan error, 1)
			go func() { closed <- st.Close() }()
			if err := errWithin(t, closed, peerTimeout, "Close"); err != nil {
				t.Fatal(err)
			}
			if api == "Malloc" {
				err = st.NetpollWriter().Flush()
			} else {
				err = st.Flush(false)
			}
			if !errors.Is(err, ErrStreamClosed) {
				t.Errorf("Flush after Close discarded the message: %v, want ErrStreamClosed", err)
			}
		})
	}
}

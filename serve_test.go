package shmipc

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestServeSync: Listener.Serve runs a handler per stream, closes the stream
// when the handler returns, and returns ErrListenerClosed after Close.
func TestServeSync(t *testing.T) {
	before := runtime.NumGoroutine()
	srv := smStartEcho(t, filepath.Join(t.TempDir(), "s.sock"))
	const sessions, streams = 3, 8
	var wg sync.WaitGroup
	errs := make(chan error, sessions*streams)
	for range sessions {
		sess, err := Dial("unix", srv.ln.Addr().String(), smTestConfig())
		if err != nil {
			t.Fatal(err)
		}
		defer sess.Close()
		for i := range streams {
			wg.Add(1)
			go func() {
				defer wg.Done()
				st, err := sess.OpenStream()
				if err != nil {
					errs <- err
					return
				}
				defer st.Close()
				st.SetDeadline(time.Now().Add(20 * time.Second))
				for j := range 10 {
					if err := smRoundTrip(st, bytes.Repeat([]byte{byte(i)}, 1+j*1000)); err != nil {
						errs <- err
						return
					}
				}
				// The handler returns on a zero length; Serve closes the stream.
				if _, err := st.Write(make([]byte, 4)); err != nil {
					errs <- err
					return
				}
				if n, err := st.Read(make([]byte, 1)); n != 0 || err != io.EOF {
					errs <- fmt.Errorf("read after the handler returned: %d, %v; want io.EOF", n, err)
				}
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if n := srv.accepted.Load(); n != sessions*streams {
		t.Errorf("handler ran for %d streams, want %d", n, sessions*streams)
	}

	// A handler blocked in a read returns when the listener closes.
	sess, err := Dial("unix", srv.ln.Addr().String(), smTestConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	if err := smRoundTrip(st, []byte("x")); err != nil {
		t.Fatal(err)
	}
	srv.close(t) // checks that Serve returned ErrListenerClosed
	if _, err := st.Read(make([]byte, 1)); !errors.Is(err, ErrSessionClosed) {
		t.Errorf("read after the server closed: %v, want ErrSessionClosed", err)
	}
	st.Close() // what the client read stays mapped until its stream closes
	sess.Close()
	smWaitGoroutines(t, before)
}

// svFramer is an asynchronous framed echo: OnData never blocks. It waits
// for a whole frame (u32 length, body) before it answers, leaving partial
// frames unread. A length above limit is an error; OnClose then writes
// "bad frame" to the client.
type svFramer struct {
	limit  int
	calls  atomic.Int64
	frames atomic.Int64
	closes chan error
}

func (f *svFramer) OnData(st *Stream) error {
	f.calls.Add(1)
	r := st.BufferReader()
	for r.Len() >= 4 {
		hdr, err := r.Peek(4)
		if err != nil {
			return err
		}
		n := int(binary.BigEndian.Uint32(hdr))
		if n > f.limit {
			return fmt.Errorf("frame of %d bytes is over the limit", n)
		}
		if r.Len() < 4+n {
			return nil // wait for the rest
		}
		frame, err := r.ReadBytes(4 + n)
		if err != nil {
			return err
		}
		st.BufferWriter().WriteBytes(frame)
		if err := st.Flush(false); err != nil {
			return err
		}
		f.frames.Add(1)
	}
	return nil
}

func (f *svFramer) OnClose(st *Stream, err error) {
	if err != nil && !errors.Is(err, ErrSessionClosed) {
		st.Write([]byte("bad frame"))
	}
	f.closes <- err
}

func TestServeHandlerAsync(t *testing.T) {
	before := runtime.NumGoroutine()
	ln, err := Listen("unix", filepath.Join(t.TempDir(), "s.sock"), smTestConfig())
	if err != nil {
		t.Fatal(err)
	}
	h := &svFramer{limit: 1 << 20, closes: make(chan error, 100)}
	served := make(chan error, 1)
	go func() { served <- ln.ServeHandler(h) }()
	sess, err := Dial("unix", ln.Addr().String(), smTestConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	closeErr := func(what string) error {
		t.Helper()
		select {
		case err := <-h.closes:
			return err
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: no OnClose", what)
			return nil
		}
	}

	// A frame sent in pieces: OnData leaves the partial frame and is called
	// again only when more has arrived.
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	st.SetDeadline(time.Now().Add(20 * time.Second))
	body := bytes.Repeat([]byte("0123456789"), 1000)
	frame := binary.BigEndian.AppendUint32(nil, uint32(len(body)))
	frame = append(frame, body...)
	for _, piece := range [][]byte{frame[:2], frame[2:4], frame[4:5000], frame[5000:]} {
		if _, err := st.Write(piece); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	got, err := st.BufferReader().ReadBytes(len(frame))
	if err != nil || !bytes.Equal(got, frame) {
		t.Fatalf("echo of a frame sent in 4 pieces: %v", err)
	}
	if c := h.calls.Load(); c < 1 || c > 8 { // once if all pieces came before the first call
		t.Errorf("OnData called %d times for a frame sent in 4 pieces", c)
	}
	st.BufferReader().ReleasePreviousRead()

	// Pipelined frames in one write, answered in order.
	var batch, want []byte
	for i := range 50 {
		f := binary.BigEndian.AppendUint32(nil, uint32(i*10))
		f = append(f, bytes.Repeat([]byte{byte(i)}, i*10)...)
		batch = append(batch, f...)
	}
	want = batch
	if _, err := st.Write(batch); err != nil {
		t.Fatal(err)
	}
	if got, err := st.BufferReader().ReadBytes(len(want)); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("echo of 50 pipelined frames: %v", err)
	}
	if n := h.frames.Load(); n != 51 {
		t.Errorf("%d frames answered, want 51", n)
	}
	// The client closes: OnClose(nil).
	st.Close()
	if err := closeErr("client close"); err != nil {
		t.Errorf("OnClose after the client closed: %v, want nil", err)
	}

	// OnData fails: OnClose gets the error and can still write.
	st, err = sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	st.SetDeadline(time.Now().Add(20 * time.Second))
	if _, err := st.Write([]byte{0xff, 0xff, 0xff, 0xff}); err != nil {
		t.Fatal(err)
	}
	if msg, err := io.ReadAll(st); err != nil || string(msg) != "bad frame" {
		t.Errorf("after a bad frame the client read %q, %v; want \"bad frame\" and EOF", msg, err)
	}
	if err := closeErr("bad frame"); err == nil || !bytes.Contains([]byte(err.Error()), []byte("over the limit")) {
		t.Errorf("OnClose after a bad frame: %v", err)
	}
	st.Close()

	// The client session dies: OnClose gets ErrSessionClosed.
	st, err = sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	if err := smRoundTrip(st, []byte("hi")); err != nil {
		t.Fatal(err)
	}
	sess.Close()
	st.Close() // what the client read stays mapped until its stream closes
	if err := closeErr("session close"); !errors.Is(err, ErrSessionClosed) {
		t.Errorf("OnClose after the session died: %v, want ErrSessionClosed", err)
	}

	ln.Close()
	if err := <-served; !errors.Is(err, ErrListenerClosed) {
		t.Errorf("ServeHandler returned %v, want ErrListenerClosed", err)
	}
	smWaitGoroutines(t, before)
}

// TestServeOnDataClient uses OnData on the client side to take responses
// asynchronously while the main goroutine pipelines requests.
func TestServeOnDataClient(t *testing.T) {
	srv := smStartEcho(t, filepath.Join(t.TempDir(), "s.sock"))
	defer srv.close(t)
	sess, err := Dial("unix", srv.ln.Addr().String(), smTestConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}

	const requests = 200
	responses := make(chan []byte, requests)
	done := OnData(st, func(st *Stream) error {
		r := st.BufferReader()
		for r.Len() >= 4 {
			hdr, _ := r.Peek(4)
			n := int(binary.BigEndian.Uint32(hdr))
			if r.Len() < 4+n {
				return nil
			}
			frame, err := r.ReadBytes(4 + n)
			if err != nil {
				return err
			}
			responses <- append([]byte(nil), frame[4:]...) // frame is valid only during the call
		}
		return nil
	})
	for i := range requests {
		msg := binary.BigEndian.AppendUint32(nil, uint32(1+i%300))
		msg = append(msg, bytes.Repeat([]byte{byte(i)}, 1+i%300)...)
		if _, err := st.Write(msg); err != nil {
			t.Fatal(err)
		}
	}
	for i := range requests {
		select {
		case got := <-responses:
			if want := bytes.Repeat([]byte{byte(i)}, 1+i%300); !bytes.Equal(got, want) {
				t.Fatalf("response %d: %d bytes, differs", i, len(got))
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("response %d did not come", i)
		}
	}
	// The server closes the stream on a zero length: OnData ends with nil.
	if _, err := st.Write(make([]byte, 4)); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("OnData ended with %v, want nil", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("OnData did not end when the server closed the stream")
	}
	if _, err := st.Write([]byte("x")); !errors.Is(err, ErrStreamClosed) {
		t.Errorf("write after OnData ended: %v, want ErrStreamClosed (OnData closes the stream)", err)
	}

	// A read deadline ends an idle stream with ErrTimeout.
	st, err = sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	st.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	select {
	case err := <-OnData(st, func(*Stream) error { return errors.New("no data expected") }):
		if !errors.Is(err, ErrTimeout) {
			t.Errorf("OnData on an idle stream with a read deadline: %v, want ErrTimeout", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("read deadline did not end OnData")
	}

	// fn closing the stream ends OnData without an error.
	st, err = sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	done = OnData(st, func(st *Stream) error { return st.Close() })
	if _, err := st.Write([]byte{0, 0, 0, 1, 'z'}); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("OnData after fn closed the stream: %v, want nil", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("OnData did not end after fn closed the stream")
	}
}

// TestOnDataNextRequestInSameSlice: a request/reply exchange whose server
// handles each request with OnData, reading it with io.ReadFull (Read
// releases what it read at once) and writing the reply, then doing some
// work before returning. The client reads the reply with ReadBytes and
// sends the next request of the same size.
//
// A stream keeps the slice it received for its next message (reuse.go), so
// the request, the reply and the next request all travel in the same slice
// of shared memory: when the next request has arrived by the time fn
// returns, it lies where the one fn read did, with the same length. OnData
// must still see that fn consumed something, and hand it the next request.
func TestOnDataNextRequestInSameSlice(t *testing.T) {
	waitsInParallel(t)
	mzModes(t, func(t *testing.T) {
		_, cli, srv := mzPair(t, nil)
		const size = 64
		handled := make(chan int, 1000)
		count := 0
		done := OnData(srv, func(st *Stream) error {
			// One request per call: OnData calls again at once when unread
			// data remains and something was consumed.
			if st.BufferReader().Len() >= size {
				req := make([]byte, size)
				if _, err := io.ReadFull(st, req); err != nil {
					return err
				}
				if _, err := st.Write(req); err != nil {
					return err
				}
				count++
				handled <- count
				time.Sleep(2 * time.Millisecond) // some work after the reply
			}
			return nil
		})
		msg := make([]byte, size)
		cli.SetReadDeadline(time.Now().Add(mzTimeout))
		for i := range shortOr(200, 60) { // each takes 2 ms of the callback's work
			msg[0] = byte(i)
			if _, err := cli.Write(msg); err != nil {
				t.Fatal(err)
			}
			select {
			case <-handled:
			case <-time.After(3 * time.Second):
				t.Fatalf("request %d (of the same size as the one before it) was never handed to the OnData callback: "+
					"server stream has %d unread bytes", i, srv.BufferReader().Len())
			}
			rep, err := cli.BufferReader().ReadBytes(size)
			if err != nil {
				t.Fatalf("reply %d: %v", i, err)
			}
			if rep[0] != byte(i) {
				t.Fatalf("reply %d: got %d", i, rep[0])
			}
			cli.BufferReader().ReleasePreviousRead()
		}
		cli.Close()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("OnData: %v", err)
			}
		case <-time.After(mzTimeout):
			t.Errorf("OnData did not end")
		}
	})
}

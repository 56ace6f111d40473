package shmipc

import (
	"context"
	"errors"
	"io"
	"net"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cloudwego/netpoll"
)

// mzStreamOps is every method of a stream, its BufferReader/Writer and its
// netpoll adapters, each as a call returning its error.
func mzStreamOps(st *Stream) []struct {
	name string
	read bool // a read (io.EOF acceptable after the peer closed)
	zero bool // a zero-length call
	f    func() error
} {
	br, bw := st.BufferReader(), st.BufferWriter()
	nr, nw := st.NetpollReader(), st.NetpollWriter()
	type op = struct {
		name string
		read bool
		zero bool
		f    func() error
	}
	e1 := func(_ any, err error) error { return err }
	return []op{
		{"Read", true, false, func() error { return e1(st.Read(make([]byte, 8))) }},
		{"Read(empty)", true, true, func() error { return e1(st.Read(nil)) }},
		{"Write", false, false, func() error { return e1(st.Write([]byte("abc"))) }},
		{"Write(empty)", false, true, func() error { return e1(st.Write(nil)) }},
		{"Flush", false, false, func() error { return st.Flush(false) }},
		{"Reserve", false, false, func() error { return e1(bw.Reserve(8)) }},
		{"Reserve(0)", false, true, func() error { return e1(bw.Reserve(0)) }},
		{"WriteBytes", false, false, func() error { return e1(bw.WriteBytes([]byte("abc"))) }},
		{"WriteBytes(empty)", false, true, func() error { return e1(bw.WriteBytes(nil)) }},
		{"WriteString", false, false, func() error { return e1(bw.WriteString("abc")) }},
		{"WriteByte", false, false, func() error { return bw.WriteByte('a') }},
		{"ReadBytes", true, false, func() error { return e1(br.ReadBytes(4)) }},
		{"ReadBytes(0)", true, true, func() error { return e1(br.ReadBytes(0)) }},
		{"Peek", true, false, func() error { return e1(br.Peek(4)) }},
		{"Peek(0)", true, true, func() error { return e1(br.Peek(0)) }},
		{"Discard", true, false, func() error { return e1(br.Discard(4)) }},
		{"Discard(0)", true, true, func() error { return e1(br.Discard(0)) }},
		{"ReadByte", true, false, func() error { return e1(br.ReadByte()) }},
		{"np.Next", true, false, func() error { return e1(nr.Next(4)) }},
		{"np.Next(0)", true, true, func() error { return e1(nr.Next(0)) }},
		{"np.Peek", true, false, func() error { return e1(nr.Peek(4)) }},
		{"np.Skip", true, false, func() error { return nr.Skip(4) }},
		{"np.Skip(0)", true, true, func() error { return nr.Skip(0) }},
		{"np.Until", true, false, func() error { return e1(nr.Until('\n')) }},
		{"np.ReadString", true, false, func() error { return e1(nr.ReadString(4)) }},
		{"np.ReadBinary", true, false, func() error { return e1(nr.ReadBinary(4)) }},
		{"np.ReadByte", true, false, func() error { return e1(nr.ReadByte()) }},
		{"np.Slice", true, false, func() error { return e1(nr.Slice(4)) }},
		{"np.Slice(0)", true, true, func() error { return e1(nr.Slice(0)) }},
		{"np.Malloc", false, false, func() error { return e1(nw.Malloc(8)) }},
		{"np.Malloc(0)", false, true, func() error { return e1(nw.Malloc(0)) }},
		{"np.WriteString", false, false, func() error { return e1(nw.WriteString("abc")) }},
		{"np.WriteBinary", false, false, func() error { return e1(nw.WriteBinary([]byte("abc"))) }},
		{"np.WriteByte", false, false, func() error { return nw.WriteByte('a') }},
		{"np.WriteDirect", false, false, func() error { return nw.WriteDirect([]byte("abc"), 0) }},
		{"np.Append", false, false, func() error {
			lb := netpoll.NewLinkBuffer(8)
			lb.WriteString("abc")
			return nw.Append(lb)
		}},
		{"np.Flush", false, false, func() error { return nw.Flush() }},
	}
}

// TestMisuseStreamUseAfterClose calls every stream method after the
// stream's own Close: each must fail with ErrStreamClosed, not panic or hang.
func TestMisuseStreamUseAfterClose(t *testing.T) {
	mzModes(t, func(t *testing.T) {
		_, cli, _ := mzPair(t, nil)
		if err := cli.Close(); err != nil {
			t.Fatalf("Close: %v", err)
		}
		if err := cli.Close(); err != nil {
			t.Errorf("second Close: %v", err)
		}
		for _, op := range mzStreamOps(cli) {
			err, ok := mzCall(t, op.name, op.f)
			if !ok {
				continue
			}
			if op.zero {
				if err == nil {
					t.Logf("NOTE %s after Close: nil error", op.name)
				} else if !errors.Is(err, ErrStreamClosed) {
					t.Errorf("%s after Close: %v, want ErrStreamClosed", op.name, err)
				}
				continue
			}
			mzWantErr(t, op.name+" after Close", err, ErrStreamClosed)
		}
		// Non-failing methods must not panic.
		mzCall(t, "Len/Release/deadlines", func() error {
			cli.BufferReader().Len()
			cli.BufferReader().ReleasePreviousRead()
			cli.BufferWriter().Len()
			cli.NetpollReader().Len()
			cli.NetpollWriter().MallocLen()
			_ = cli.NetpollReader().Release()
			_ = cli.SetDeadline(time.Now())
			_ = cli.SetReadDeadline(time.Time{})
			_ = cli.SetWriteDeadline(time.Time{})
			_ = cli.LocalAddr()
			_ = cli.RemoteAddr()
			return nil
		})
	})
}

// TestMisuseStreamZeroLengthAfterClose: zero-length reads/writes on a closed
// stream. net.Conn (TCP) returns net.ErrClosed even for an empty Read or
// Write; the package doc says ErrStreamClosed is returned by the methods of a
// stream after its own Close.
func TestMisuseStreamZeroLengthAfterClose(t *testing.T) {
	_, cli, _ := mzPair(t, nil)
	cli.Close()
	for _, op := range mzStreamOps(cli) {
		if !op.zero {
			continue
		}
		err, ok := mzCall(t, op.name, op.f)
		if ok && !errors.Is(err, ErrStreamClosed) {
			t.Errorf("%s after Close: err=%v, want ErrStreamClosed", op.name, err)
		}
	}
}

// TestMisuseStreamAfterPeerClose: the peer closed the stream. Reads give
// io.EOF, writes ErrStreamPeerClosed, which is not net.ErrClosed: the stream
// is still open here.
func TestMisuseStreamAfterPeerClose(t *testing.T) {
	mzModes(t, func(t *testing.T) {
		_, cli, srv := mzPair(t, nil)
		cli.Close()
		srv.SetReadDeadline(time.Now().Add(mzTimeout))
		if _, err := srv.Read(make([]byte, 1)); err != io.EOF {
			t.Fatalf("Read after peer close: %v, want io.EOF", err)
		}
		for _, op := range mzStreamOps(srv) {
			err, ok := mzCall(t, op.name, op.f)
			if !ok || op.zero {
				continue
			}
			if op.read {
				if err != io.EOF && !(op.name == "np.Until" && errors.Is(err, io.EOF)) {
					t.Errorf("%s after peer close: %v, want io.EOF", op.name, err)
				}
				continue
			}
			mzWantErr(t, op.name+" after peer close", err, ErrStreamPeerClosed)
			if errors.Is(err, net.ErrClosed) || errors.Is(err, ErrStreamClosed) {
				t.Errorf("%s after peer close: %v matches net.ErrClosed or ErrStreamClosed, the errors of this side's Close", op.name, err)
			}
		}
	})
}

// TestMisuseStreamAfterSessionClose: every stream method after the session's
// Close fails with an error matching ErrSessionClosed (or the stream's).
func TestMisuseStreamAfterSessionClose(t *testing.T) {
	mzModes(t, func(t *testing.T) {
		p, cli, srv := mzPair(t, nil)
		p.client.Close()
		if err := p.client.Close(); err != nil {
			t.Errorf("second Session.Close: %v", err)
		}
		for _, op := range mzStreamOps(cli) {
			err, ok := mzCall(t, "client "+op.name, op.f)
			if !ok || op.zero {
				continue
			}
			mzWantErr(t, "client "+op.name+" after Session.Close", err, ErrSessionClosed)
		}
		// The server side: its session ends with ErrPeerClosed.
		if err := waitSessionClosed(t, p.server, mzTimeout); !errors.Is(err, ErrSessionClosed) {
			t.Errorf("server session err %v", err)
		}
		for _, op := range mzStreamOps(srv) {
			err, ok := mzCall(t, "server "+op.name, op.f)
			if !ok || op.zero {
				continue
			}
			mzWantErr(t, "server "+op.name+" after peer session ended", err, ErrSessionClosed)
		}
		// Session methods after Close.
		_, err := p.client.OpenStream()
		mzWantErr(t, "OpenStream after Close", err, ErrSessionClosed)
		_, err = p.server.AcceptStream()
		mzWantErr(t, "AcceptStream after end", err, ErrSessionClosed)
		_, err = p.client.AcceptStream()
		mzWantErr(t, "client AcceptStream", err, ErrNotSupported)
		_, err = p.server.OpenStream()
		mzWantErr(t, "server OpenStream", err, ErrNotSupported)
		mzCall(t, "session accessors after Close", func() error {
			_ = p.client.Stats()
			_ = p.client.LocalAddr()
			_ = p.client.RemoteAddr()
			_ = p.client.IsClosed()
			return nil
		})
	})
}

// TestMisuseListenerUseAfterClose: Accept after Close, Close twice, CloseAll
// after Close, Serve after Close.
func TestMisuseListenerUseAfterClose(t *testing.T) {
	ln, err := Listen("unix", sockPath(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	// Accept blocked in several goroutines while Close runs.
	errs := make(chan error, 4)
	for range 4 {
		go func() { _, err := ln.Accept(); errs <- err }()
	}
	time.Sleep(50 * time.Millisecond)
	err, _ = mzCall(t, "Listener.Close", ln.Close)
	if err != nil {
		t.Errorf("Close: %v", err)
	}
	for range 4 {
		select {
		case err := <-errs:
			mzWantErr(t, "Accept during Close", err, ErrListenerClosed)
			mzWantErr(t, "Accept during Close", err, net.ErrClosed)
		case <-time.After(mzTimeout):
			t.Fatal("Accept blocked across Close: HANG")
		}
	}
	_, err = ln.Accept()
	mzWantErr(t, "Accept after Close", err, ErrListenerClosed)
	mzCall(t, "Close again", ln.Close)
	mzCall(t, "CloseAll after Close", ln.CloseAll)
	err, _ = mzCall(t, "Serve after Close", func() error { return ln.Serve(func(*Stream) {}) })
	mzWantErr(t, "Serve after Close", err, ErrListenerClosed)
	mzCall(t, "Addr after Close", func() error { _ = ln.Addr(); return nil })
}

// TestMisuseSessionManagerUseAfterClose: every manager method after Close.
func TestMisuseSessionManagerUseAfterClose(t *testing.T) {
	ln := startEchoListener(t, nil)
	m, err := NewSessionManager(SessionManagerConfig{Network: "unix", Address: ln.Addr().String(), SessionNum: 2})
	if err != nil {
		t.Fatal(err)
	}
	out, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	pooled, err := m.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	m.PutBack(pooled)
	mzCall(t, "Close", m.Close)
	mzCall(t, "Close again", m.Close)
	_, err = m.GetStream()
	mzWantErr(t, "GetStream after Close", err, ErrSessionManagerClosed)
	_, err = m.GetStreamContext(context.Background())
	mzWantErr(t, "GetStreamContext after Close", err, ErrSessionManagerClosed)
	err, _ = mzCall(t, "DialContext after Close", func() error { _, err := m.DialContext(context.Background(), ""); return err })
	mzWantErr(t, "DialContext after Close", err, ErrSessionManagerClosed)
	mzCall(t, "PutBack after Close", func() error { m.PutBack(out); return nil })
	_, err = out.Write([]byte("x"))
	mzWantErr(t, "Write on a stream handed out before Close", err, ErrSessionClosed, ErrStreamClosed)
	mzCall(t, "PutBack nil", func() error { m.PutBack(nil); return nil })
	if n := m.IdleStreams(); n != 0 {
		t.Errorf("IdleStreams after Close: %d", n)
	}
	if s := m.Sessions(); len(s) != 0 {
		t.Errorf("Sessions after Close: %d", len(s))
	}
}

// refusedSocket returns the path of a socket file nobody listens on.
func refusedSocket(t *testing.T) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "refused.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	ln.Close()
	return sock
}

// TestErrorsSayEachThingOnce checks the messages of a refused dial and of
// failed listens, word for word: one prefix, the operation, the address and
// the cause, once each.
func TestErrorsSayEachThingOnce(t *testing.T) {
	sock := refusedSocket(t)
	missing := filepath.Join(t.TempDir(), "no", "such", "dir.sock")
	live := startEchoListener(t, DefaultConfig()).Addr().String()

	_, dialErr := Dial("unix", sock, nil)
	_, listenErr := Listen("unix", missing, nil)
	_, liveErr := Listen("unix", live, nil)
	for _, tc := range []struct {
		err  error
		want string
		is   error
	}{
		{dialErr, "shmipc: dial unix " + sock + ": connect: connection refused", syscall.ECONNREFUSED},
		{listenErr, "shmipc: listen unix " + missing + ": bind: no such file or directory", syscall.ENOENT},
		{liveErr, "shmipc: listen unix " + live + ": bind: address already in use: a live server listens there", syscall.EADDRINUSE},
	} {
		if tc.err == nil {
			t.Errorf("no error, want %q", tc.want)
			continue
		}
		if got := tc.err.Error(); got != tc.want {
			t.Errorf("error %q, want %q", got, tc.want)
		}
		if !errors.Is(tc.err, tc.is) {
			t.Errorf("error %q does not wrap %v", tc.err, tc.is)
		}
	}
}

// TestManagerErrorSaysEachThingOnce: a manager whose server refuses says
// "shmipc: " once and the address once, and wraps both its own sentinel
// and the cause.
func TestManagerErrorSaysEachThingOnce(t *testing.T) {
	sock := refusedSocket(t)
	m, err := NewSessionManager(SessionManagerConfig{Network: "unix", Address: sock})
	if err == nil {
		defer m.Close()
		_, err = m.GetStream()
	}
	if err == nil {
		t.Fatal("no error from a manager whose server refuses")
	}
	msg := err.Error()
	t.Log(msg)
	for _, word := range []string{"shmipc: ", sock, "dial", "connection refused"} {
		if n := strings.Count(msg, word); n != 1 {
			t.Errorf("%q says %q %d times, want once", msg, word, n)
		}
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("%v does not wrap ECONNREFUSED", err)
	}
}

// TestOncePrefixed: the errors a message quotes lose their prefix; its own
// stays.
func TestOncePrefixed(t *testing.T) {
	err := errorf("%w: %w (%w)", ErrSessionClosed, ErrProtocol, ErrQueueFull)
	if got, want := err.Error(), "shmipc: session closed: protocol violation (IO queue full)"; got != want {
		t.Errorf("%q, want %q", got, want)
	}
	for _, e := range []error{ErrSessionClosed, ErrProtocol, ErrQueueFull} {
		if !errors.Is(err, e) {
			t.Errorf("%v does not wrap %v", err, e)
		}
	}
}

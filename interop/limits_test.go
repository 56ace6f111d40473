package interop

import (
	"errors"
	"net"
	"testing"
	"time"

	"github.com/goshm/shmipc/interop/internal/cells"
)

// Known limitations of the references, measured from outside. The tests
// name them where they meet them; README.md's compatibility section lists
// them.
const (
	// rustServerTCP: the Rust server over TCP loopback completes the
	// handshake, but its first session never delivers a stream (its own
	// client fails the same way).
	rustServerTCP = "limitation rust-server-tcp"

	// rustFallbackFrameLimit: the Rust implementation panics on a
	// FallbackData frame larger than its 32 MiB read buffer. This library
	// sends frames of at most 32 MiB, so large messages pass.
	rustFallbackFrameLimit = "limitation rust-fallback-frame-32MiB"

	// goServerStreamClosed: the Go server now and then ends a stream with
	// "stream closed" after it has echoed (or read) every byte.
	goServerStreamClosed = "limitation go-server-stream-closed"

	// rustClosesFD0: after unmapping a file-mode buffer region the Rust
	// implementation closes fd 0 (docs/protocol.md §11), so each cell
	// starts a fresh Rust process.
	rustClosesFD0 = "limitation rust-closes-fd0"
)

// rustServerOverTCP checks how this library fails against the Rust server
// over TCP (rustServerTCP): the handshake completes (version 2 has no
// reply), then the echo never comes, and the stream's read fails with a
// timeout at its deadline, without a hang or a panic; closing the session
// is prompt.
func rustServerOverTCP(t *testing.T, tr transport) {
	n := newNames(t)
	t.Cleanup(func() { n.expectNoShm(t) })
	addr := tr.addr(t, n)
	rustRef.startServer(t, addr)
	s, lib := dialOurs(t, addr, ourConfig(tr, n, regionDefault))
	st, err := lib.Open()
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	if _, err := st.Write(cells.Frame(cells.Pattern(64, 1))); err != nil {
		t.Fatalf("write: %v", err)
	}
	st.SetReadDeadline(time.Now().Add(2 * time.Second))
	start := time.Now()
	var b [1]byte
	_, err = st.Read(b[:])
	var ne net.Error
	switch {
	case err == nil:
		t.Fatalf("%s: no longer seen, the echo came back: update README.md and this test", rustServerTCP)
	case errors.As(err, &ne) && ne.Timeout():
		t.Logf("%s: the echo never came; our read failed at its deadline after %v: %v", rustServerTCP, time.Since(start).Round(time.Millisecond), err)
	default:
		t.Logf("%s: the echo never came; our read failed with: %v", rustServerTCP, err)
	}
	done := make(chan error, 1)
	go func() { done <- s.Close() }()
	select {
	case <-done:
	case <-time.After(time.Second):
		t.Fatal("closing the session took more than a second")
	}
}

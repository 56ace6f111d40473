package shmipc

import (
	"bytes"
	"context"
	"net"
	"testing"
	"time"
)

// TestHotRestartDuringHandshake: connections in their handshake do not
// hold HotRestart up (a client that keeps opening them, and never finishes
// a handshake, would block restarts for ever); a session whose handshake
// ends while the restart runs is told as it starts, and waited for.
func TestHotRestartDuringHandshake(t *testing.T) {
	env := startTestServer(t, 0)
	env.good.Close()
	waitUntil(t, "server forgets the plain client", 5*time.Second, func() bool { return hrSessionCount(env.ln) == 0 })
	dial := func() *net.UnixConn {
		c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: env.addr, Net: "unix"})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	dial() // never handshakes
	late := dial()
	waitUntil(t, "two connections in their handshake", 5*time.Second, func() bool {
		env.ln.mu.Lock()
		defer env.ln.mu.Unlock()
		return len(env.ln.pending) == 2
	})
	if err := env.ln.HotRestart(hrEpoch); err != nil {
		t.Fatalf("HotRestart with connections in their handshake: %v", err)
	}
	conf := peerConfig(t, MemMapTypeMemFd, 0)
	r := createRawRegions(t, conf, MemMapTypeMemFd, rawLayout{})
	v, err := r.handshake(late, MemMapTypeMemFd)
	if err != nil {
		t.Fatalf("handshake during the restart: %v", err)
	}
	p := rawPeerOf(t, late, v, r, conf)
	got, err := p.readFrame()
	if err != nil {
		t.Fatalf("no HotRestart frame for the session that joined: %v", err)
	}
	if want := hrFrame(8, hrEpoch); !bytes.Equal(got, want) {
		t.Fatalf("frame % x, want the HotRestart frame % x", got, want)
	}
	if restartDone(env.ln) {
		t.Error("the restart ended before the session that joined acknowledged")
	}
	p.write(hrFrame(9, hrEpoch))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := env.ln.WaitHotRestart(ctx); err != nil {
		t.Errorf("WaitHotRestart: %v", err)
	}
}

package shmipc

// Zero-copy reads return shared memory that the peer keeps mapped
// read-write: a hostile peer can change the bytes after the read returned.
// Read copies, so what it returned stays as it was.

import (
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/shm"
)

// TestZeroCopyBytesStayWritableByPeer: a server (the raw peer) sends
// "len=0005"; after BufferReader.ReadBytes, Peek and netpoll Next returned
// it in place, the server writes "len=9999" over its slice and the caller's
// bytes change with it. The bytes Read copied out do not.
func TestZeroCopyBytesStayWritableByPeer(t *testing.T) {
	p, victim := acceptRawVictim(t, MemMapTypeMemFd, 0)
	st, err := victim.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	st.SetReadDeadline(time.Now().Add(peerTimeout))
	const li = 0
	for _, c := range []struct {
		name string
		read func() ([]byte, error)
	}{
		{"ReadBytes", func() ([]byte, error) { return st.BufferReader().ReadBytes(8) }},
		{"Peek", func() ([]byte, error) { return st.BufferReader().Peek(8) }},
		{"netpoll Next", func() ([]byte, error) { return st.NetpollReader().Next(8) }},
		{"Read", func() ([]byte, error) {
			b := make([]byte, 8)
			n, err := st.Read(b)
			return b[:n], err
		}},
	} {
		off := p.msgIn(li, "len=0005")
		p.publish(st.ID(), off, shm.StatusOpened)
		got, err := c.read()
		if err != nil || string(got) != "len=0005" {
			t.Fatalf("%s: (%q, %v), want len=0005", c.name, got, err)
		}
		copy(p.bm.SliceData(li, off), "len=9999") // the peer, after the read returned
		if c.name == "Read" {
			if string(got) != "len=0005" {
				t.Errorf("Read's copy changed to %q when the peer wrote its slice", got)
			}
		} else if string(got) != "len=9999" {
			t.Errorf("%s returned bytes in place, yet they read %q after the peer wrote len=9999 over them", c.name, got)
		}
		if c.name == "Peek" {
			if _, err := st.BufferReader().Discard(8); err != nil {
				t.Fatal(err)
			}
		}
		st.BufferReader().ReleasePreviousRead()
	}
}

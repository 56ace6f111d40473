package shmipc

// netpoll.Reader on a stream: Next and Until in place in shared memory,
// across segments, and skipping whole slices.

import (
	"bytes"
	"errors"
	"io"
	"testing"
	"time"
	"unsafe"

	"github.com/cloudwego/netpoll"
	"github.com/goshm/shmipc/internal/shm"
)

// npInShm reports whether p lies in the session's buffer region.
func npInShm(st *Stream, p []byte) bool {
	mem := st.s.buf.Region().Mem()
	lo := uintptr(unsafe.Pointer(unsafe.SliceData(mem)))
	a := uintptr(unsafe.Pointer(unsafe.SliceData(p)))
	return a >= lo && a+uintptr(len(p)) <= lo+uintptr(len(mem))
}

// npAliasesSegment reports whether p lies in one of the stream's received
// segments.
func npAliasesSegment(st *Stream, p []byte) bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	a := uintptr(unsafe.Pointer(unsafe.SliceData(p)))
	for _, seg := range st.reader.segs {
		lo := uintptr(unsafe.Pointer(unsafe.SliceData(seg.Data)))
		if a >= lo && a+uintptr(len(p)) <= lo+uintptr(len(seg.Data)) {
			return true
		}
	}
	return false
}

// npWaitLen waits until r has n bytes.
func npWaitLen(t *testing.T, r netpoll.Reader, n int) {
	t.Helper()
	if _, err := r.Peek(n); err != nil {
		t.Fatalf("waiting for %d bytes: %v", n, err)
	}
}

func TestNetpollNextZeroCopy(t *testing.T) {
	client, server := npSessions(t, nil)
	msg := npPattern(1000, 7)
	if _, err := client.Write(msg); err != nil {
		t.Fatal(err)
	}
	r := server.NetpollReader()
	p, err := r.Peek(10)
	if err != nil {
		t.Fatal(err)
	}
	if !npAliasesSegment(server, p) || !npInShm(server, p) {
		t.Fatal("Peek of single-slice data is not zero-copy")
	}
	p, err = r.Next(1000)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(p, msg) {
		t.Fatal("Next returned other bytes")
	}
	if !npAliasesSegment(server, p) || !npInShm(server, p) {
		t.Fatal("Next of single-slice data is not zero-copy")
	}
	if r.Len() != 0 {
		t.Fatalf("Len %d after reading everything", r.Len())
	}
	if err := r.Release(); err != nil {
		t.Fatal(err)
	}
	if p, err := r.Next(0); err != nil || p == nil || len(p) != 0 {
		t.Fatalf("Next(0) = %v, %v", p, err)
	}
}

func TestNetpollNextAcrossSegments(t *testing.T) {
	client, server := npSessions(t, npSmallSlices)
	msg := npPattern(10000, 8)
	w := client.NetpollWriter()
	for _, part := range [][]byte{msg[:3000], msg[3000:6000], msg[6000:9000], msg[9000:]} {
		p, err := w.Malloc(len(part)) // 3000 bytes take a 4096-byte slice each
		if err != nil {
			t.Fatal(err)
		}
		copy(p, part)
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	r := server.NetpollReader()
	npWaitLen(t, r, len(msg))
	server.mu.Lock()
	nsegs := len(server.reader.segs)
	server.mu.Unlock()
	if nsegs < 2 {
		t.Fatalf("message arrived in %d segment(s); the test needs several", nsegs)
	}
	// The copy path allocates nothing once the arena has grown.
	allocs := testing.AllocsPerRun(100, func() {
		p, err := r.Peek(len(msg))
		if err != nil || !bytes.Equal(p, msg) {
			t.Fatalf("Peek across segments: %v", err)
		}
		if err := r.Release(); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Errorf("Peek across segments + Release: %v allocations per run, want 0", allocs)
	}
	p, err := r.Next(5000) // spans the first two slices (3000 + 2000)
	if err != nil || !bytes.Equal(p, msg[:5000]) {
		t.Fatalf("Next across segments: %v", err)
	}
	if npInShm(server, p) {
		t.Fatal("Next across segments returned shared memory")
	}
	q, err := r.Next(100) // within the second slice (bytes 2000..2100)
	if err != nil || !bytes.Equal(q, msg[5000:5100]) {
		t.Fatalf("Next: %v", err)
	}
	if !npInShm(server, q) {
		t.Fatal("Next within one slice is not zero-copy")
	}
	if !bytes.Equal(p, msg[:5000]) {
		t.Fatal("copy changed before Release")
	}
	if r.Len() != len(msg)-5100 {
		t.Fatalf("Len %d, want %d", r.Len(), len(msg)-5100)
	}
	rest, err := r.Next(len(msg) - 5100)
	if err != nil || !bytes.Equal(rest, msg[5100:]) {
		t.Fatalf("Next rest: %v", err)
	}
	if err := r.Release(); err != nil {
		t.Fatal(err)
	}
}

func TestNetpollUntilSkipSlice(t *testing.T) {
	client, server := npSessions(t, npSmallSlices)
	w := client.NetpollWriter()
	long := bytes.Repeat([]byte("x"), 6000) // a line spanning slices
	text := "hello\nworld\n" + string(long) + "\nnew"
	if _, err := w.WriteString(text); err != nil {
		t.Fatal(err)
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	r := server.NetpollReader()
	check := func(what string, got []byte, err error, want string) {
		t.Helper()
		if err != nil || string(got) != want {
			t.Fatalf("%s = %q (%d bytes), %v; want %q", what, got[:min(len(got), 20)], len(got), err, want[:min(len(want), 20)])
		}
	}
	line, err := r.Until('\n')
	check("Until", line, err, "hello\n")
	if err := r.Skip(2); err != nil {
		t.Fatal(err)
	}
	line, err = r.Until('\n')
	check("Until after Skip", line, err, "rld\n")
	line, err = r.Until('\n')
	check("Until across slices", line, err, string(long)+"\n")

	// Until waits for the delimiter to arrive.
	done := make(chan struct{})
	go func() {
		defer close(done)
		line, err := r.Until(';')
		if err != nil || string(line) != "new line;" {
			t.Errorf("blocking Until = %q, %v", line, err)
		}
	}()
	time.Sleep(20 * time.Millisecond)
	if _, err := client.Write([]byte(" line")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond)
	if _, err := client.Write([]byte(";slice me, and more")); err != nil {
		t.Fatal(err)
	}
	<-done

	npWaitLen(t, r, len("slice me, and more"))
	s, err := r.Slice(8)
	if err != nil {
		t.Fatal(err)
	}
	if s.Len() != 8 {
		t.Fatalf("Slice Len %d", s.Len())
	}
	sp, err := s.Next(8)
	check("Slice", sp, err, "slice me")
	if str, err := r.ReadString(2); err != nil || str != ", " {
		t.Fatalf("ReadString = %q, %v", str, err)
	}
	b, err := r.ReadBinary(3)
	check("ReadBinary", b, err, "and")
	if npInShm(server, b) {
		t.Fatal("ReadBinary returned shared memory")
	}
	if c, err := r.ReadByte(); err != nil || c != ' ' {
		t.Fatalf("ReadByte = %q, %v", c, err)
	}
	if r.Len() != 4 {
		t.Fatalf("Len %d, want 4", r.Len())
	}

	// After the peer closes: Until returns the rest and io.EOF.
	client.Close()
	line, err = r.Until('\n')
	if string(line) != "more" || !errors.Is(err, io.EOF) {
		t.Fatalf("Until at end = %q, %v; want \"more\", io.EOF", line, err)
	}
	for what, f := range map[string]func() error{
		"Next":       func() error { _, err := r.Next(1); return err },
		"Peek":       func() error { _, err := r.Peek(1); return err },
		"Skip":       func() error { return r.Skip(1) },
		"ReadByte":   func() error { _, err := r.ReadByte(); return err },
		"ReadString": func() error { _, err := r.ReadString(1); return err },
		"ReadBinary": func() error { _, err := r.ReadBinary(1); return err },
		"Slice":      func() error { _, err := r.Slice(1); return err },
		"Until":      func() error { _, err := r.Until('x'); return err },
	} {
		if err := f(); !errors.Is(err, io.EOF) {
			t.Errorf("%s after peer close: %v, want io.EOF", what, err)
		}
	}
	if err := server.NetpollWriter().WriteByte(1); !errors.Is(err, ErrStreamPeerClosed) {
		t.Errorf("WriteByte after peer close: %v, want ErrStreamPeerClosed", err)
	}
	if _, err := server.NetpollWriter().Malloc(1); !errors.Is(err, ErrStreamPeerClosed) {
		t.Errorf("Malloc after peer close: %v, want ErrStreamPeerClosed", err)
	}
}

// Zero-copy reads return shared memory that the peer keeps mapped
// read-write: a hostile peer can change the bytes after the read returned.
// Read copies, so what it returned stays as it was.

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

package shmipc

import (
	"bytes"
	"errors"
	"io"
	"testing"
	"time"

	"github.com/cloudwego/netpoll"
)

func mzReadAll(t *testing.T, st *Stream, n int) []byte {
	t.Helper()
	st.SetReadDeadline(time.Now().Add(mzTimeout))
	b := make([]byte, n)
	if _, err := io.ReadFull(st, b); err != nil {
		t.Fatalf("reading %d bytes: %v (got %q)", n, err, b)
	}
	return b
}

// mzNothingMore checks that nothing more arrives on st.
func mzNothingMore(t *testing.T, st *Stream, what string) {
	t.Helper()
	time.Sleep(50 * time.Millisecond)
	if n := st.BufferReader().Len(); n != 0 {
		p, _ := st.BufferReader().Peek(n)
		t.Errorf("%s: %d unexpected bytes arrived: %q", what, n, p)
	}
}

// TestMisuseBufferInterleave mixes Reserve, WriteBytes, Write, Flush and
// the netpoll writer on one stream, from one goroutine, and checks what the
// peer receives.
func TestMisuseBufferInterleave(t *testing.T) {
	mzModes(t, func(t *testing.T) {
		_, cli, srv := mzPair(t, nil)
		bw := cli.BufferWriter()
		// Reserve, then Write: the reserved bytes go first.
		b, err := bw.Reserve(3)
		if err != nil {
			t.Fatal(err)
		}
		copy(b, "abc")
		if _, err := cli.Write([]byte("def")); err != nil {
			t.Fatal(err)
		}
		if got := mzReadAll(t, srv, 6); string(got) != "abcdef" {
			t.Errorf("Reserve+Write: %q", got)
		}
		// Flush with nothing, Reserve(0)+Flush, empty Write: nothing arrives.
		for i, f := range []func() error{
			func() error { return cli.Flush(false) },
			func() error { _, err := bw.Reserve(0); return errors.Join(err, cli.Flush(true)) },
			func() error { _, err := cli.Write(nil); return err },
			func() error { _, err := bw.WriteBytes(nil); return errors.Join(err, cli.Flush(false)) },
			func() error {
				_, err := cli.NetpollWriter().Malloc(0)
				return errors.Join(err, cli.NetpollWriter().Flush())
			},
		} {
			if err := f(); err != nil {
				t.Errorf("empty op %d: %v", i, err)
			}
		}
		mzNothingMore(t, srv, "empty flushes")
		// WriteBytes + Reserve + WriteString + WriteByte + netpoll, one Flush.
		bw.WriteBytes([]byte("1"))
		r, _ := bw.Reserve(2)
		copy(r, "23")
		bw.WriteString("45")
		bw.WriteByte('6')
		nw := cli.NetpollWriter()
		m, _ := nw.Malloc(2)
		copy(m, "78")
		nw.WriteBinary([]byte("9"))
		if bw.Len() != 9 || nw.MallocLen() != 9 {
			t.Errorf("Len %d MallocLen %d, want 9", bw.Len(), nw.MallocLen())
		}
		if err := cli.Flush(false); err != nil {
			t.Fatal(err)
		}
		if got := mzReadAll(t, srv, 9); string(got) != "123456789" {
			t.Errorf("mixed writers: %q", got)
		}
		// MallocAck shrinks; beyond the size is an error; WriteDirect bounds.
		m, _ = nw.Malloc(10)
		copy(m, "ABCDEFGHIJ")
		if err := nw.MallocAck(11); err == nil {
			t.Errorf("MallocAck beyond the size: nil error")
		}
		if err := nw.MallocAck(-1); err == nil {
			t.Errorf("MallocAck(-1): nil error")
		}
		if err := nw.MallocAck(4); err != nil {
			t.Fatal(err)
		}
		if err := nw.WriteDirect([]byte("x"), 5); err == nil {
			t.Errorf("WriteDirect remainCap beyond size: nil error")
		}
		if err := nw.WriteDirect([]byte("xy"), 2); err != nil {
			t.Fatal(err)
		}
		if err := nw.Flush(); err != nil {
			t.Fatal(err)
		}
		if got := mzReadAll(t, srv, 6); string(got) != "ABxyCD" {
			t.Errorf("Malloc/MallocAck/WriteDirect: %q, want ABxyCD", got)
		}
		if err := nw.Append(cli.NetpollWriter()); err == nil {
			t.Errorf("Append of the stream's own writer: nil error")
		}
		// A message built and Close: Flush after Close fails, nothing arrives.
		bw.WriteString("never")
		cli.Close()
		mzWantErr(t, "Flush of a message built before Close", cli.Flush(false), ErrStreamClosed)
		srv.SetReadDeadline(time.Now().Add(mzTimeout))
		if n, err := srv.Read(make([]byte, 10)); err != io.EOF {
			t.Errorf("peer read after a Close that dropped a built message: n=%d err=%v, want EOF", n, err)
		}
	})
}

// TestMisuseReaderBoundaries: Peek/ReadBytes/Discard/Skip/Next/Slice at and
// beyond the data present when the peer closes.
func TestMisuseReaderBoundaries(t *testing.T) {
	mzModes(t, func(t *testing.T) {
		_, cli, srv := mzPair(t, nil)
		cli.Write([]byte("hello"))
		cli.Write([]byte(" world\npartial"))
		cli.Close()
		br, nr := srv.BufferReader(), srv.NetpollReader()
		srv.SetReadDeadline(time.Now().Add(mzTimeout))
		if _, err := br.ReadBytes(-1); err == nil {
			t.Errorf("ReadBytes(-1): nil error")
		}
		if _, err := nr.Next(-1); err == nil {
			t.Errorf("Next(-1): nil error")
		}
		if _, err := br.Discard(-1); err == nil {
			t.Errorf("Discard(-1): nil error")
		}
		if _, err := nr.ReadBinary(-1); err == nil {
			t.Errorf("ReadBinary(-1): nil error")
		}
		p, err := br.Peek(8) // spans the two messages: a copy
		if err != nil || string(p) != "hello wo" {
			t.Fatalf("Peek(8): %q %v", p, err)
		}
		q, err := br.Peek(2)
		if err != nil || string(q) != "he" {
			t.Fatalf("Peek(2): %q %v", q, err)
		}
		if string(p) != "hello wo" {
			t.Errorf("a second Peek changed the first Peek's bytes: %q", p)
		}
		line, err := nr.Until('\n')
		if err != nil || string(line) != "hello world\n" {
			t.Fatalf("Until: %q %v", line, err)
		}
		if string(p) != "hello wo" {
			t.Errorf("Until changed the bytes of an earlier Peek before any release: %q", p)
		}
		// More than is left, stream ended: ErrUnexpectedEOF, nothing consumed.
		if _, err := br.ReadBytes(100); err != io.ErrUnexpectedEOF {
			t.Errorf("ReadBytes beyond the end: %v, want io.ErrUnexpectedEOF", err)
		}
		if err := nr.Skip(100); err != io.ErrUnexpectedEOF {
			t.Errorf("Skip beyond the end: %v", err)
		}
		if br.Len() != 7 {
			t.Errorf("Len after failed reads: %d, want 7", br.Len())
		}
		br.ReleasePreviousRead()
		br.ReleasePreviousRead()
		if _, err := nr.Slice(100); err != io.ErrUnexpectedEOF {
			t.Errorf("Slice beyond the end: %v", err)
		}
		rest, err := nr.Until('\n')
		if string(rest) != "partial" || err != io.EOF {
			t.Errorf("Until at the end: %q %v, want \"partial\" EOF", rest, err)
		}
		if n, err := br.Discard(5); n != 0 || err != io.EOF {
			t.Errorf("Discard at the end: %d %v", n, err)
		}
		if _, err := br.ReadByte(); err != io.EOF {
			t.Errorf("ReadByte at the end: %v", err)
		}
	})
}

// TestMisuseAppendLinkBuffer: Append of a LinkBuffer with readable and
// unflushed bytes, and of another stream's writer.
func TestMisuseAppendLinkBuffer(t *testing.T) {
	mzModes(t, func(t *testing.T) {
		p, cli, srv := mzPair(t, nil)
		lb := netpoll.NewLinkBuffer(16)
		lb.WriteString("abc")
		lb.Flush()
		lb.WriteString("def") // not flushed
		nw := cli.NetpollWriter()
		if err := nw.Append(lb); err != nil {
			t.Fatal(err)
		}
		other, err := p.client.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		defer other.Close()
		ow := other.NetpollWriter()
		ow.WriteString("ghi")
		if err := nw.Append(ow); err != nil {
			t.Fatal(err)
		}
		if ow.MallocLen() != 0 {
			t.Errorf("the other writer still holds %d bytes", ow.MallocLen())
		}
		// Other stream closed with a message pending: Append must not panic.
		ow.WriteString("jkl")
		other.Close()
		err, _ = mzCall(t, "Append of a closed stream's writer", func() error { return nw.Append(ow) })
		t.Logf("Append of a closed stream's writer: %v", err)
		if err := nw.Flush(); err != nil {
			t.Fatal(err)
		}
		got := mzReadAll(t, srv, 9)
		if !bytes.Equal(got, []byte("abcdefghi")) {
			t.Errorf("got %q", got)
		}
		mzNothingMore(t, srv, "after Append of a closed stream's writer")
	})
}

package shmipc

// netpoll.Writer on a stream: Malloc and MallocAck, WriteDirect, Append,
// and a model check against netpoll.LinkBuffer.

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/cloudwego/netpoll"
)

func TestNetpollMallocAck(t *testing.T) {
	client, server := npSessions(t, npSmallSlices)
	free0 := freeCounts(client.s.buf)
	w := client.NetpollWriter()
	var bufs [][]byte
	for _, c := range []byte("abc") {
		p, err := w.Malloc(3000) // one 4096-byte slice each
		if err != nil {
			t.Fatal(err)
		}
		if len(p) != 3000 {
			t.Fatalf("Malloc(3000) returned %d bytes", len(p))
		}
		for j := range p {
			p[j] = c
		}
		bufs = append(bufs, p)
	}
	if n := len(client.writer.segs); n != 3 {
		t.Fatalf("%d segments, want 3", n)
	}
	// Each buffer is shared memory of its own: none was overwritten by a
	// later Malloc's bytes.
	for i, p := range bufs {
		if !npInShm(client, p) {
			t.Errorf("buffer %d is not in shared memory", i)
		}
		if want := bytes.Repeat([]byte{"abc"[i]}, len(p)); !bytes.Equal(p, want) {
			t.Errorf("buffer %d holds other bytes than the %q written to it", i, "abc"[i])
		}
	}
	if w.MallocLen() != 9000 {
		t.Fatalf("MallocLen %d", w.MallocLen())
	}
	if err := w.MallocAck(9001); err == nil {
		t.Fatal("MallocAck beyond MallocLen succeeded")
	}
	if err := w.MallocAck(4000); err != nil { // into the second segment
		t.Fatal(err)
	}
	if w.MallocLen() != 4000 || len(client.writer.segs) != 2 || client.writer.segs[1].N != 1000 {
		t.Fatalf("after MallocAck(4000): MallocLen %d, %d segments", w.MallocLen(), len(client.writer.segs))
	}
	if err := w.MallocAck(3000); err != nil { // exactly the end of the first
		t.Fatal(err)
	}
	if w.MallocLen() != 3000 || len(client.writer.segs) != 1 {
		t.Fatalf("after MallocAck(3000): MallocLen %d, %d segments", w.MallocLen(), len(client.writer.segs))
	}
	if _, err := w.WriteString("tail"); err != nil {
		t.Fatal(err)
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	want := append(bytes.Repeat([]byte("a"), 3000), "tail"...)
	r := server.NetpollReader()
	got, err := r.Next(len(want))
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("received %d bytes, %v", len(got), err)
	}
	// MallocAck(0) drops everything; Flush then sends nothing.
	if _, err := w.Malloc(100); err != nil {
		t.Fatal(err)
	}
	if err := w.MallocAck(0); err != nil || w.MallocLen() != 0 {
		t.Fatalf("MallocAck(0): %v, MallocLen %d", err, w.MallocLen())
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := r.Release(); err != nil {
		t.Fatal(err)
	}
	if r.Len() != 0 {
		t.Fatalf("%d unexpected bytes", r.Len())
	}
	if free := freeCounts(client.s.buf); !slices.Equal(free, free0) {
		t.Fatalf("free slices %v after everything was released, want %v", free, free0)
	}
}

func TestNetpollWriteDirect(t *testing.T) {
	client, server := npSessions(t, nil)
	w := client.NetpollWriter()
	buf, err := w.Malloc(10)
	if err != nil {
		t.Fatal(err)
	}
	copy(buf, "AAAA")
	if err := w.WriteDirect([]byte("XYZ"), 6); err != nil {
		t.Fatal(err)
	}
	copy(buf[4:], "BBBBBB") // filled after WriteDirect, as netpoll allows
	if w.MallocLen() != 13 {
		t.Fatalf("MallocLen %d, want 13", w.MallocLen())
	}
	if err := w.WriteByte('!'); err != nil {
		t.Fatal(err)
	}
	if err := w.WriteDirect([]byte("<>"), 0); err != nil {
		t.Fatal(err)
	}
	if err := w.WriteDirect([]byte("x"), 100); err == nil {
		t.Fatal("WriteDirect with remainCap beyond MallocLen succeeded")
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	r := server.NetpollReader()
	got, err := r.Next(16)
	if err != nil || string(got) != "AAAAXYZBBBBBB!<>" {
		t.Fatalf("got %q, %v", got, err)
	}
	r.Release()
}

// TestNetpollWriterModel runs random sequences of Malloc, WriteBinary,
// WriteDirect, MallocAck and late fills of Malloc'ed bytes against a stream
// and against a netpoll.LinkBuffer, and checks that the stream sends what
// the LinkBuffer holds, and that no slice of shared memory leaks.
func TestNetpollWriterModel(t *testing.T) {
	for _, tc := range []struct {
		name  string
		tweak func(*Config)
	}{{"default", nil}, {"smallslices", npSmallSlices}} {
		t.Run(tc.name, func(t *testing.T) {
			client, server := npSessions(t, tc.tweak)
			free0 := freeCounts(client.s.buf)
			w := client.NetpollWriter()
			r := server.NetpollReader()
			rng := rand.New(rand.NewPCG(3, 4))
			size := func() int {
				switch rng.IntN(4) {
				case 0:
					return rng.IntN(8)
				case 1:
					return rng.IntN(200)
				case 2:
					return rng.IntN(5000)
				}
				return rng.IntN(20000)
			}
			for msg := range 150 {
				lb := netpoll.NewLinkBuffer()
				type pending struct{ a, b []byte } // ours, the model's
				var open []pending
				fill := func(i int) {
					data := npPattern(len(open[i].a), rng.Uint64())
					copy(open[i].a, data)
					copy(open[i].b, data)
					open = slices.Delete(open, i, i+1)
				}
				var ops []string
				for range 1 + rng.IntN(12) {
					switch k := rng.IntN(10); {
					case k < 3:
						n := size()
						a, err := w.Malloc(n)
						if err != nil {
							t.Fatal(err)
						}
						b, _ := lb.Malloc(n)
						open = append(open, pending{a, b})
						ops = append(ops, fmt.Sprintf("Malloc(%d)", n))
					case k < 5:
						p := npPattern(size(), rng.Uint64())
						if _, err := w.WriteBinary(p); err != nil {
							t.Fatal(err)
						}
						lb.WriteBinary(p)
						ops = append(ops, fmt.Sprintf("WriteBinary(%d)", len(p)))
					case k < 8:
						p := npPattern(1+size(), rng.Uint64())
						remain := rng.IntN(w.MallocLen() + 1)
						if err := w.WriteDirect(p, remain); err != nil {
							t.Fatal(err)
						}
						lb.WriteDirect(p, remain)
						ops = append(ops, fmt.Sprintf("WriteDirect(%d, %d)", len(p), remain))
					case k < 9 && len(open) > 0:
						fill(rng.IntN(len(open)))
						ops = append(ops, "fill")
					default:
						for len(open) > 0 { // MallocAck invalidates slices
							fill(0)
						}
						n := rng.IntN(w.MallocLen() + 1)
						if err := w.MallocAck(n); err != nil {
							t.Fatal(err)
						}
						lb.MallocAck(n)
						ops = append(ops, fmt.Sprintf("MallocAck(%d)", n))
					}
					if w.MallocLen() != lb.MallocLen() {
						t.Fatalf("message %d after %v: MallocLen %d, model %d", msg, ops, w.MallocLen(), lb.MallocLen())
					}
				}
				for len(open) > 0 {
					fill(rng.IntN(len(open)))
				}
				n := w.MallocLen()
				if err := w.Flush(); err != nil {
					t.Fatal(err)
				}
				lb.Flush()
				want, _ := lb.Next(lb.Len())
				got, err := r.Next(n)
				if err != nil {
					t.Fatalf("message %d: %v", msg, err)
				}
				if !bytes.Equal(got, want) {
					t.Fatalf("message %d after %v: %d bytes differ from the model's %d at %d", msg, ops, len(got), len(want), npFirstDiff(got, want))
				}
				if err := r.Release(); err != nil {
					t.Fatal(err)
				}
			}
			if free := freeCounts(client.s.buf); !slices.Equal(free, free0) {
				t.Fatalf("free slices %v after everything was released, want %v", free, free0)
			}
		})
	}
}

func TestNetpollAppend(t *testing.T) {
	client, server := npSessions(t, nil)
	other, otherServer := npSessions(t, npSmallSlices)
	w := client.NetpollWriter()
	if _, err := w.WriteString("head|"); err != nil {
		t.Fatal(err)
	}

	lb := netpoll.NewLinkBuffer()
	lb.WriteString("flushed|")
	lb.Flush()
	p, _ := lb.Malloc(9)
	copy(p, "unflushed")
	if err := w.Append(lb); err != nil {
		t.Fatal(err)
	}
	if lb.Len() != 0 || lb.MallocLen() != 0 {
		t.Fatalf("LinkBuffer not emptied: Len %d, MallocLen %d", lb.Len(), lb.MallocLen())
	}

	ow := other.NetpollWriter()
	big := npPattern(10000, 9) // several slices of the other session
	buf, _ := ow.Malloc(1)
	ow.WriteDirect(big, 1)
	buf[0] = '|'
	if err := w.Append(ow); err != nil {
		t.Fatal(err)
	}
	if ow.MallocLen() != 0 {
		t.Fatalf("appended writer keeps %d bytes", ow.MallocLen())
	}
	if err := w.Append(w); !errors.Is(err, ErrNotSupported) {
		t.Fatalf("Append to itself: %v", err)
	}
	if err := w.Append(netpoll.NewWriter(io.Discard)); !errors.Is(err, ErrNotSupported) {
		t.Fatalf("Append of another writer type: %v", err)
	}
	want := append([]byte("head|flushed|unflushed"), big...)
	want = append(want, '|')
	if w.MallocLen() != len(want) {
		t.Fatalf("MallocLen %d, want %d", w.MallocLen(), len(want))
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	got, err := server.NetpollReader().Next(len(want))
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("got %d bytes, %v", len(got), err)
	}
	// The other stream still works and sent nothing.
	if err := ow.Flush(); err != nil {
		t.Fatal(err)
	}
	if n := otherServer.NetpollReader().Len(); n != 0 {
		t.Fatalf("the appended writer's stream received %d bytes", n)
	}
}

// TestNetpollWriteDirectStale checks that a WriteDirect whose message was
// discarded elsewhere (here by a failed Stream.Flush after Close) does not
// write into memory the writer no longer owns.
func TestNetpollWriteDirectStale(t *testing.T) {
	client, _ := npSessions(t, nil)
	w := client.NetpollWriter()
	buf, _ := w.Malloc(8)
	if err := w.WriteDirect([]byte("direct"), 4); err != nil {
		t.Fatal(err)
	}
	copy(buf, "12345678")
	client.Close()
	if err := w.Flush(); !errors.Is(err, ErrStreamClosed) {
		t.Fatalf("Flush after Close: %v, want ErrStreamClosed", err)
	}
	if w.MallocLen() != 0 {
		t.Fatalf("MallocLen %d after a failed Flush", w.MallocLen())
	}
}

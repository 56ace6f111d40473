package wire

import (
	"bytes"
	"encoding/binary"
	"errors"
	"strings"
	"testing"
)

// hdr builds a raw 8-byte header field by field, independently of Encode.
func hdr(length uint32, magic uint16, version, typ uint8) []byte {
	b := make([]byte, 8)
	binary.BigEndian.PutUint32(b[0:], length)
	binary.BigEndian.PutUint16(b[4:], magic)
	b[6] = version
	b[7] = typ
	return b
}

func TestHeaderEncodeDecodeRoundTrip(t *testing.T) {
	lengths := []uint32{0, 8, 12, 16, 0x01020304, 1<<32 - 1}
	for _, length := range lengths {
		for _, version := range []uint8{1, 2, 3, 255} {
			for typ := Type(0); typ <= TypeHotRestartAck; typ++ {
				h := make(Header, HeaderSize)
				h.Encode(length, version, typ)
				if got := []byte(h); !bytes.Equal(got, hdr(length, 0x7758, version, uint8(typ))) {
					t.Fatalf("Encode(%d, %d, %v) = % x", length, version, typ, got)
				}
				if h.Length() != length || h.Magic() != Magic || h.Version() != version || h.Type() != typ {
					t.Fatalf("decode of Encode(%d, %d, %v) gave %v", length, version, typ, h)
				}
				if err := h.Check(); err != nil {
					t.Fatalf("Check of a valid header %v: %v", h, err)
				}
			}
		}
	}
	// Decoding a header written by hand reads the big-endian fields.
	h := Header(hdr(0xA1B2C3D4, 0x7758, 3, 9))
	if h.Length() != 0xA1B2C3D4 || h.Magic() != 0x7758 || h.Version() != 3 || h.Type() != TypeHotRestartAck {
		t.Fatalf("decode of hand-made header: %v", h)
	}
}

func TestHeaderCheckRejects(t *testing.T) {
	sentinels := []error{ErrBadMagic, ErrBadVersion, ErrBadType, ErrBadLength}
	cases := []struct {
		name string
		h    []byte
		want error
	}{
		{"magic 0", hdr(8, 0, 3, 1), ErrBadMagic},
		{"magic swapped", hdr(8, 0x5877, 3, 1), ErrBadMagic},
		{"magic 0x7759", hdr(8, 0x7759, 3, 1), ErrBadMagic},
		{"magic ffff", hdr(8, 0xFFFF, 2, 0), ErrBadMagic},
		{"version 0", hdr(8, 0x7758, 0, 1), ErrBadVersion},
		{"version 0 type 0", hdr(20, 0x7758, 0, 0), ErrBadVersion},
		{"type 10", hdr(8, 0x7758, 3, 10), ErrBadType},
		{"type 11 v2", hdr(8, 0x7758, 2, 11), ErrBadType},
		{"type 255", hdr(8, 0x7758, 3, 255), ErrBadType},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := Header(c.h).Check()
			if err == nil {
				t.Fatalf("Check(% x) = nil, want %v", c.h, c.want)
			}
			for _, s := range sentinels {
				if got := errors.Is(err, s); got != (s == c.want) {
					t.Errorf("errors.Is(%q, %q) = %v", err, s, got)
				}
			}
		})
	}
	// Any non-zero version is acceptable to Check; it does not enforce 2 or 3.
	for _, v := range []uint8{1, 4, 200} {
		if err := Header(hdr(8, 0x7758, v, 1)).Check(); err != nil {
			t.Errorf("Check with version %d: %v", v, err)
		}
	}
}

func TestTypeString(t *testing.T) {
	want := map[Type]string{
		TypeShareMemoryByFilePath: "ShareMemoryByFilePath",
		TypePolling:               "Polling",
		TypeStreamClose:           "StreamClose",
		TypeFallbackData:          "FallbackData",
		TypeExchangeProtoVersion:  "ExchangeProtoVersion",
		TypeShareMemoryByMemfd:    "ShareMemoryByMemfd",
		TypeAckShareMemory:        "AckShareMemory",
		TypeAckReadyRecvFD:        "AckReadyRecvFD",
		TypeHotRestart:            "HotRestart",
		TypeHotRestartAck:         "HotRestartAck",
	}
	for typ, name := range want {
		if got := typ.String(); got != name {
			t.Errorf("Type(%d).String() = %q, want %q", uint8(typ), got, name)
		}
	}
	if got := Type(10).String(); !strings.Contains(got, "10") {
		t.Errorf("Type(10).String() = %q, want it to show the number", got)
	}
}

// The type numbers are the wire values of docs/protocol.md §3.2.
func TestTypeValues(t *testing.T) {
	got := []Type{TypeShareMemoryByFilePath, TypePolling, TypeStreamClose, TypeFallbackData,
		TypeExchangeProtoVersion, TypeShareMemoryByMemfd, TypeAckShareMemory, TypeAckReadyRecvFD,
		TypeHotRestart, TypeHotRestartAck}
	for i, typ := range got {
		if uint8(typ) != uint8(i) {
			t.Errorf("%v = %d, want %d", typ, uint8(typ), i)
		}
	}
	if Magic != 0x7758 || VersionFilePath != 2 || VersionMemfd != 3 || MaxVersion != 3 || HeaderSize != 8 {
		t.Errorf("constants: magic %#x, versions %d/%d/%d, header %d", Magic, VersionFilePath, VersionMemfd, MaxVersion, HeaderSize)
	}
}

func TestExactFrameBytes(t *testing.T) {
	cases := []struct {
		name string
		got  []byte
		want []byte
	}{
		{"Polling v3", AppendEvent(nil, 3, TypePolling),
			[]byte{0x00, 0x00, 0x00, 0x08, 0x77, 0x58, 0x03, 0x01}},
		{"Polling v2", AppendEvent(nil, 2, TypePolling),
			[]byte{0x00, 0x00, 0x00, 0x08, 0x77, 0x58, 0x02, 0x01}},
		{"ExchangeProtoVersion", AppendEvent(nil, 3, TypeExchangeProtoVersion),
			[]byte{0x00, 0x00, 0x00, 0x08, 0x77, 0x58, 0x03, 0x04}},
		{"AckShareMemory", AppendEvent(nil, 3, TypeAckShareMemory),
			[]byte{0x00, 0x00, 0x00, 0x08, 0x77, 0x58, 0x03, 0x06}},
		{"AckReadyRecvFD", AppendEvent(nil, 3, TypeAckReadyRecvFD),
			[]byte{0x00, 0x00, 0x00, 0x08, 0x77, 0x58, 0x03, 0x07}},
		{"StreamClose", AppendStreamClose(nil, 3, 0x01020304),
			[]byte{0x00, 0x00, 0x00, 0x0c, 0x77, 0x58, 0x03, 0x02, 0x01, 0x02, 0x03, 0x04}},
		{"StreamClose v2 id 7", AppendStreamClose(nil, 2, 7),
			[]byte{0x00, 0x00, 0x00, 0x0c, 0x77, 0x58, 0x02, 0x02, 0x00, 0x00, 0x00, 0x07}},
		{"FallbackData head", AppendFallbackHead(nil, 3, 0x0A0B0C0D, 0x00000001, 5),
			[]byte{0x00, 0x00, 0x00, 0x15, 0x77, 0x58, 0x03, 0x03,
				0x0A, 0x0B, 0x0C, 0x0D, 0x00, 0x00, 0x00, 0x01}},
		{"FallbackData head, 1 MiB of data", AppendFallbackHead(nil, 2, 9, 0, 1<<20),
			[]byte{0x00, 0x10, 0x00, 0x10, 0x77, 0x58, 0x02, 0x03,
				0x00, 0x00, 0x00, 0x09, 0x00, 0x00, 0x00, 0x00}},
		{"HotRestart", AppendHotRestart(nil, 3, TypeHotRestart, 0x0102030405060708),
			[]byte{0x00, 0x00, 0x00, 0x10, 0x77, 0x58, 0x03, 0x08,
				0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08}},
		{"HotRestartAck", AppendHotRestart(nil, 3, TypeHotRestartAck, 1),
			[]byte{0x00, 0x00, 0x00, 0x10, 0x77, 0x58, 0x03, 0x09,
				0, 0, 0, 0, 0, 0, 0, 1}},
	}
	for _, c := range cases {
		if !bytes.Equal(c.got, c.want) {
			t.Errorf("%s:\n got % x\nwant % x", c.name, c.got, c.want)
		}
	}

	paths, err := AppendPaths(nil, 2, TypeShareMemoryByFilePath, "/q", "/bu")
	if err != nil {
		t.Fatal(err)
	}
	want := []byte{0x00, 0x00, 0x00, 0x11, 0x77, 0x58, 0x02, 0x00,
		0x00, 0x02, '/', 'q', 0x00, 0x03, '/', 'b', 'u'}
	if !bytes.Equal(paths, want) {
		t.Errorf("ShareMemoryByFilePath:\n got % x\nwant % x", paths, want)
	}
	paths, err = AppendPaths(nil, 3, TypeShareMemoryByMemfd, "q", "b")
	if err != nil {
		t.Fatal(err)
	}
	want = []byte{0x00, 0x00, 0x00, 0x0e, 0x77, 0x58, 0x03, 0x05, 0x00, 0x01, 'q', 0x00, 0x01, 'b'}
	if !bytes.Equal(paths, want) {
		t.Errorf("ShareMemoryByMemfd:\n got % x\nwant % x", paths, want)
	}
}

// Append functions append: frames pack back to back after what was there.
func TestAppendKeepsPrefix(t *testing.T) {
	b := []byte("xyz")
	b = AppendEvent(b, 3, TypePolling)
	b = AppendStreamClose(b, 3, 5)
	b, err := AppendPaths(b, 3, TypeShareMemoryByMemfd, "qq", "bbb")
	if err != nil {
		t.Fatal(err)
	}
	b = AppendFallbackHead(b, 3, 6, 0, 0)
	if string(b[:3]) != "xyz" {
		t.Fatalf("prefix clobbered: % x", b[:3])
	}
	rest := b[3:]
	var types []Type
	for len(rest) > 0 {
		if len(rest) < HeaderSize {
			t.Fatalf("%d trailing bytes", len(rest))
		}
		h := Header(rest[:HeaderSize])
		if err := h.Check(); err != nil {
			t.Fatal(err)
		}
		n := int(h.Length())
		if h.Type() == TypeFallbackData {
			n = FallbackHeadSize // the head says the length of its data too
		}
		types = append(types, h.Type())
		rest = rest[n:]
	}
	want := []Type{TypePolling, TypeStreamClose, TypeShareMemoryByMemfd, TypeFallbackData}
	if len(types) != len(want) {
		t.Fatalf("frames %v, want %v", types, want)
	}
	for i := range want {
		if types[i] != want[i] {
			t.Fatalf("frames %v, want %v", types, want)
		}
	}
}

func TestDecodeFallbackHead(t *testing.T) {
	frame := AppendFallbackHead(nil, 3, 0xDEADBEEF, 0x11223344, 3)
	frame = append(frame, 'a', 'b', 'c')
	if Header(frame).Length() != uint32(len(frame)) {
		t.Fatalf("length %d, frame %d bytes", Header(frame).Length(), len(frame))
	}
	id, status, data, err := DecodeFallbackHead(frame[HeaderSize:])
	if err != nil || id != 0xDEADBEEF || status != 0x11223344 || string(data) != "abc" {
		t.Fatalf("DecodeFallbackHead = %#x, %#x, %q, %v", id, status, data, err)
	}
	id, status, data, err = DecodeFallbackHead(frame[HeaderSize:FallbackHeadSize])
	if err != nil || id != 0xDEADBEEF || status != 0x11223344 || len(data) != 0 {
		t.Fatalf("empty data: %#x, %#x, %q, %v", id, status, data, err)
	}
	for n := 0; n < 8; n++ {
		if _, _, _, err := DecodeFallbackHead(frame[HeaderSize : HeaderSize+n]); !errors.Is(err, ErrBadLength) {
			t.Errorf("payload of %d bytes: err %v, want ErrBadLength", n, err)
		}
	}
}

func TestPathsRoundTrip(t *testing.T) {
	long := strings.Repeat("p", 0xFFFF)
	cases := [][2]string{
		{"/dev/shm/shmipc_4242_queue_0", "/dev/shm/shmipc_4242_buffer"},
		{"q", "b"},
		{"ünïcødé/queue", "buffer\x00with\xffbytes"},
		{long, "b"},
		{"q", long},
		{long, long},
	}
	for _, typ := range []Type{TypeShareMemoryByFilePath, TypeShareMemoryByMemfd} {
		for _, c := range cases {
			for _, version := range []uint8{2, 3} {
				frame, err := AppendPaths(nil, version, typ, c[0], c[1])
				if err != nil {
					t.Fatalf("AppendPaths(%d, %d): %v", len(c[0]), len(c[1]), err)
				}
				h := Header(frame[:HeaderSize])
				if err := h.Check(); err != nil {
					t.Fatal(err)
				}
				if h.Type() != typ || h.Version() != version {
					t.Fatalf("header %v", h)
				}
				if int(h.Length()) != len(frame) || len(frame) != 12+len(c[0])+len(c[1]) {
					t.Fatalf("length field %d, frame %d bytes, paths %d+%d", h.Length(), len(frame), len(c[0]), len(c[1]))
				}
				if len(frame)-HeaderSize > MaxPathPayloadLen {
					t.Fatalf("payload %d exceeds MaxPathPayloadLen %d", len(frame)-HeaderSize, MaxPathPayloadLen)
				}
				q, b, err := DecodePaths(frame[HeaderSize:])
				if err != nil || q != c[0] || b != c[1] {
					t.Fatalf("DecodePaths: %d/%d bytes, %v; want %d/%d", len(q), len(b), err, len(c[0]), len(c[1]))
				}
			}
		}
	}
}

func TestAppendPathsTooLong(t *testing.T) {
	long := strings.Repeat("x", 0x10000)
	prefix := []byte("keep")
	for _, c := range [][2]string{{long, "b"}, {"q", long}} {
		out, err := AppendPaths(prefix, 3, TypeShareMemoryByMemfd, c[0], c[1])
		if err == nil {
			t.Fatalf("AppendPaths with a %d/%d-byte path succeeded", len(c[0]), len(c[1]))
		}
		if string(out) != "keep" {
			t.Fatalf("AppendPaths failed but returned % x", out)
		}
	}
}

// paths builds a path payload by hand: u16 length, bytes, u16 length, bytes.
func paths(qLen uint16, q string, bLen uint16, b string) []byte {
	p := binary.BigEndian.AppendUint16(nil, qLen)
	p = append(p, q...)
	p = binary.BigEndian.AppendUint16(p, bLen)
	return append(p, b...)
}

func TestDecodePathsRejects(t *testing.T) {
	good := paths(3, "que", 3, "buf")
	if q, b, err := DecodePaths(good); err != nil || q != "que" || b != "buf" {
		t.Fatalf("good payload: %q %q %v", q, b, err)
	}
	cases := []struct {
		name    string
		payload []byte
	}{
		{"nil", nil},
		{"one byte", []byte{0}},
		{"queue length only", []byte{0, 3}},
		{"queue path cut", paths(3, "que", 3, "buf")[:4]},
		{"buffer length missing", paths(3, "que", 3, "buf")[:5]},
		{"buffer length cut", paths(3, "que", 3, "buf")[:6]},
		{"buffer path cut", paths(3, "que", 3, "buf")[:9]},
		{"trailing byte", append(paths(3, "que", 3, "buf"), 'x')},
		{"queue length too big", paths(4, "que", 3, "buf")},
		{"queue length too small", paths(2, "que", 3, "buf")},
		{"buffer length too big", paths(3, "que", 4, "buf")},
		{"buffer length too small", paths(3, "que", 2, "buf")},
		{"queue length ffff", paths(0xFFFF, "que", 3, "buf")},
		{"buffer length ffff", paths(3, "que", 0xFFFF, "buf")},
		{"empty queue path", paths(0, "", 3, "buf")},
		{"empty buffer path", paths(3, "que", 0, "")},
		{"both empty", paths(0, "", 0, "")},
	}
	for _, c := range cases {
		q, b, err := DecodePaths(c.payload)
		if err == nil {
			t.Errorf("%s: DecodePaths(% x) = %q, %q, nil; want an error", c.name, c.payload, q, b)
			continue
		}
		if !errors.Is(err, ErrBadLength) {
			t.Errorf("%s: error %v does not wrap ErrBadLength", c.name, err)
		}
	}
	// Every strict prefix of a good payload is rejected.
	for n := 0; n < len(good); n++ {
		if _, _, err := DecodePaths(good[:n]); err == nil {
			t.Errorf("prefix of %d bytes accepted", n)
		}
	}
}

func FuzzDecodePaths(f *testing.F) {
	f.Add(paths(3, "que", 3, "buf"))
	f.Add(paths(28, "/dev/shm/shmipc_4242_queue_0", 27, "/dev/shm/shmipc_4242_buffer"))
	f.Add([]byte{})
	f.Add([]byte{0})
	f.Add([]byte{0, 1, 'q'})
	f.Add([]byte{0, 1, 'q', 0, 1})
	f.Add(paths(0, "", 1, "b"))
	f.Add(paths(1, "q", 0, ""))
	f.Add(paths(0xFFFF, "q", 1, "b"))
	f.Add(append(paths(1, "q", 1, "b"), 0))
	f.Fuzz(func(t *testing.T, payload []byte) {
		q, b, err := DecodePaths(payload)
		if err != nil {
			if !errors.Is(err, ErrBadLength) {
				t.Fatalf("error %v does not wrap ErrBadLength", err)
			}
			if q != "" || b != "" {
				t.Fatalf("error %v with paths %q %q", err, q, b)
			}
			return
		}
		if q == "" || b == "" {
			t.Fatalf("accepted an empty path: %q %q", q, b)
		}
		// Accepted payloads are exactly what AppendPaths produces.
		frame, err := AppendPaths(nil, 3, TypeShareMemoryByMemfd, q, b)
		if err != nil {
			t.Fatalf("re-encode: %v", err)
		}
		if !bytes.Equal(frame[HeaderSize:], payload) {
			t.Fatalf("re-encoded payload % x differs from % x", frame[HeaderSize:], payload)
		}
		if int(Header(frame).Length()) != len(payload)+HeaderSize {
			t.Fatalf("length field %d for a %d-byte payload", Header(frame).Length(), len(payload))
		}
	})
}

func FuzzHeader(f *testing.F) {
	f.Add([]byte{0x00, 0x00, 0x00, 0x08, 0x77, 0x58, 0x03, 0x01})
	f.Add([]byte{0x00, 0x00, 0x00, 0x0c, 0x77, 0x58, 0x02, 0x02})
	f.Add([]byte{0x00, 0x00, 0x00, 0x08, 0x77, 0x58, 0x00, 0x04})
	f.Add([]byte{0x00, 0x00, 0x00, 0x08, 0x77, 0x58, 0x03, 0x0a})
	f.Add([]byte{0x00, 0x00, 0x00, 0x08, 0x58, 0x77, 0x03, 0x04})
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{0x00, 0x00, 0x00, 0x10, 0x77, 0x58, 0x03, 0x09, 1, 2, 3})
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) < HeaderSize {
			return
		}
		raw := append([]byte(nil), data[:HeaderSize]...)
		h := Header(raw)
		_ = h.String()
		_ = h.Type().String()
		length := binary.BigEndian.Uint32(raw[0:])
		magic := binary.BigEndian.Uint16(raw[4:])
		if h.Length() != length || h.Magic() != magic || h.Version() != raw[6] || uint8(h.Type()) != raw[7] {
			t.Fatalf("accessors disagree with the bytes % x: %v", raw, h)
		}
		err := h.Check()
		valid := magic == 0x7758 && raw[6] != 0 && raw[7] <= 9
		if valid != (err == nil) {
			t.Fatalf("Check(% x) = %v, valid by the spec: %v", raw, err, valid)
		}
		switch {
		case magic != 0x7758:
			if !errors.Is(err, ErrBadMagic) {
				t.Fatalf("bad magic: %v", err)
			}
		case raw[6] == 0:
			if !errors.Is(err, ErrBadVersion) {
				t.Fatalf("version 0: %v", err)
			}
		case raw[7] > 9:
			if !errors.Is(err, ErrBadType) {
				t.Fatalf("type %d: %v", raw[7], err)
			}
		}
		// Encoding the decoded fields reproduces the header whenever the
		// magic is right (Encode always writes the magic).
		again := make(Header, HeaderSize)
		again.Encode(h.Length(), h.Version(), h.Type())
		if magic == Magic && !bytes.Equal(again, raw) {
			t.Fatalf("re-encoded % x, want % x", []byte(again), raw)
		}
		if again.Length() != length || again.Version() != raw[6] || uint8(again.Type()) != raw[7] || again.Magic() != Magic {
			t.Fatalf("Encode/decode mismatch: %v from % x", again, raw)
		}
	})
}

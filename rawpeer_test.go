package shmipc

// The raw peer: the far side of a session played by hand. It writes frames
// byte by byte (docs/protocol.md §3), reads and writes its own mapping of the IO
// queues (§7) and of the buffer region (§6), and so can both behave like a
// correct peer and break any rule of the protocol.

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/goshm/shmipc/internal/shm"
)

// ---- frames, written by hand (docs/protocol.md §3) ----

// rawMagic is the magic field of every frame header.
const rawMagic = 0x7758

// rawFrame builds a header (docs/protocol.md §3.1) followed by payload.
func rawFrame(length uint32, magic uint16, version, typ byte, payload ...byte) []byte {
	b := binary.BigEndian.AppendUint32(nil, length)
	b = binary.BigEndian.AppendUint16(b, magic)
	b = append(b, version, typ)
	return append(b, payload...)
}

// rawPathFrame builds a ShareMemoryByFilePath or ShareMemoryByMemfd frame:
// queue path first, then buffer path.
func rawPathFrame(version, typ byte, queuePath, bufPath string) []byte {
	b := rawFrame(uint32(12+len(queuePath)+len(bufPath)), rawMagic, version, typ)
	b = binary.BigEndian.AppendUint16(b, uint16(len(queuePath)))
	b = append(b, queuePath...)
	b = binary.BigEndian.AppendUint16(b, uint16(len(bufPath)))
	return append(b, bufPath...)
}

// rawFallbackFrame builds a FallbackData frame; length 0 means the length
// its payload gives.
func rawFallbackFrame(version byte, length uint32, id, status uint32, data string) []byte {
	p := binary.BigEndian.AppendUint32(nil, id)
	p = binary.BigEndian.AppendUint32(p, status)
	p = append(p, data...)
	if length == 0 {
		length = uint32(8 + len(p))
	}
	return rawFrame(length, rawMagic, version, 3, p...)
}

func decodeRawPaths(p []byte) (queuePath, bufPath string, err error) {
	if len(p) < 2 {
		return "", "", fmt.Errorf("path payload of %d bytes", len(p))
	}
	q := int(binary.BigEndian.Uint16(p))
	if len(p) < 4+q {
		return "", "", fmt.Errorf("path payload of %d bytes, queue path %d", len(p), q)
	}
	b := int(binary.BigEndian.Uint16(p[2+q:]))
	if len(p) != 4+q+b {
		return "", "", fmt.Errorf("path payload of %d bytes, paths %d+%d", len(p), q, b)
	}
	return string(p[2 : 2+q]), string(p[4+q:]), nil
}

func readN(c net.Conn, n int) ([]byte, error) {
	b := make([]byte, n)
	_, err := io.ReadFull(c, b)
	return b, err
}

// ---- raw access to one queue half (docs/protocol.md §7) ----

type rawQueue struct {
	mem []byte
	cap uint32 // the capacity the region's size gives, whatever the header says
}

func (q rawQueue) i64(off int) *int64   { return (*int64)(unsafe.Pointer(&q.mem[off])) }
func (q rawQueue) u32(off int) *uint32  { return (*uint32)(unsafe.Pointer(&q.mem[off])) }
func (q rawQueue) head() int64          { return atomic.LoadInt64(q.i64(queueHeadOff)) }
func (q rawQueue) tail() int64          { return atomic.LoadInt64(q.i64(queueTailOff)) }
func (q rawQueue) setHead(v int64)      { atomic.StoreInt64(q.i64(queueHeadOff), v) }
func (q rawQueue) setTail(v int64)      { atomic.StoreInt64(q.i64(queueTailOff), v) }
func (q rawQueue) flag() uint32         { return atomic.LoadUint32(q.u32(queueFlagOff)) }
func (q rawQueue) casFlag() bool        { return atomic.CompareAndSwapUint32(q.u32(queueFlagOff), 0, 1) }
func (q rawQueue) setCapField(v uint32) { atomic.StoreUint32(q.u32(queueCapOff), v) }

func (q rawQueue) slot(c int64) []byte {
	off := queueHeaderSize + int(uint64(c)%uint64(q.cap))*queueElemSize
	return q.mem[off : off+queueElemSize]
}

// put writes an element at the tail and publishes it, as a producer does.
func (q rawQueue) put(id, offset, status uint32) {
	t := q.tail()
	s := q.slot(t)
	binary.LittleEndian.PutUint32(s[0:], id)
	binary.LittleEndian.PutUint32(s[4:], offset)
	binary.LittleEndian.PutUint32(s[8:], status)
	q.setTail(t + 1)
}

func (q rawQueue) pop() (shm.Elem, bool) {
	h, t := q.head(), q.tail()
	if h >= t {
		return shm.Elem{}, false
	}
	s := q.slot(h)
	e := shm.Elem{
		ID:     binary.LittleEndian.Uint32(s[0:]),
		Offset: binary.LittleEndian.Uint32(s[4:]),
		Status: binary.LittleEndian.Uint32(s[8:]),
	}
	q.setHead(h + 1)
	return e, true
}

// ---- the raw peer ----

// rawPeer is the hostile side of a session, after a correct handshake: its
// connection, its own mapping of the buffer region and its queue halves.
type rawPeer struct {
	t       *testing.T
	conn    *net.UnixConn
	version byte
	buf     []byte
	bm      *shm.Buffer // our own view of the buffer region, to build valid messages
	lists   []rawList   // the region's lists, read once, as the victim reads them
	send    rawQueue    // the queue we produce into: the victim's receive queue
	recv    rawQueue    // the queue the victim produces into
}

func (p *rawPeer) write(b []byte) {
	p.conn.SetWriteDeadline(time.Now().Add(peerTimeout))
	if _, err := p.conn.Write(b); err != nil {
		p.t.Logf("raw peer write of %d bytes: %v", len(b), err)
	}
}

// poll sends a Polling frame.
func (p *rawPeer) poll() { p.write(rawFrame(8, rawMagic, p.version, 1)) }

// publish puts an element on the victim's receive queue and wakes the
// victim as a correct producer does: with a Polling frame only if the
// working flag was clear. It reports whether it sent one.
func (p *rawPeer) publish(id, off, status uint32) bool {
	p.send.put(id, off, status)
	if p.send.casFlag() {
		p.poll()
		return true
	}
	return false
}

func (p *rawPeer) u32(off uint32) uint32 {
	return atomic.LoadUint32((*uint32)(unsafe.Pointer(&p.buf[off])))
}

func (p *rawPeer) setU32(off, v uint32) {
	atomic.StoreUint32((*uint32)(unsafe.Pointer(&p.buf[off])), v)
}

// msg builds a valid one-slice message holding data and returns the
// absolute offset of its slice header.
func (p *rawPeer) msg(data string) uint32 {
	p.t.Helper()
	li, off, err := p.bm.Alloc(len(data), false, false)
	if err != nil || li < 0 {
		p.t.Fatalf("raw peer cannot allocate a slice: list %d, %v", li, err)
	}
	copy(p.bm.SliceData(li, off), data)
	p.bm.LinkSlice(off, len(data), 0)
	return off
}

// msgIn is msg in a slice of list li.
func (p *rawPeer) msgIn(li int, data string) uint32 {
	p.t.Helper()
	off, err := p.bm.Pop(li)
	if err != nil || off == 0 {
		p.t.Fatalf("raw peer cannot take a slice of list %d: %v", li, err)
	}
	copy(p.bm.SliceData(li, off), data)
	p.bm.LinkSlice(off, len(data), 0)
	return off
}

// link makes the slice at a continue with the slice at b.
func (p *rawPeer) link(a, b uint32) {
	p.setU32(a+sliceNextOff, b)
	p.buf[a+sliceFlagsOff] = flagInUse | flagHasNext
}

// rawList is list i of the buffer region as the raw peer reads its layout
// (docs/protocol.md §6.5).
type rawList struct{ header, area, stride, sliceCap, count uint32 }

// end is the offset just past the last slice of l.
func (l rawList) end() uint32 { return l.area + l.count*l.stride }

func (p *rawPeer) list(i int) rawList { return p.lists[i] }

// rawLists reads the lists of the buffer region buf, which must be valid.
func rawLists(buf []byte) []rawList {
	ls := make([]rawList, binary.LittleEndian.Uint16(buf))
	off := uint32(shm.BufferHeaderSize)
	for i := range ls {
		count := binary.LittleEndian.Uint32(buf[off+listCountOff:])
		sliceCap := binary.LittleEndian.Uint32(buf[off+listCapOff:])
		ls[i] = rawList{header: off, area: off + shm.ListHeaderSize, stride: sliceCap + shm.SliceHeaderSize, sliceCap: sliceCap, count: count}
		off = ls[i].end()
	}
	return ls
}

// readMsg reads the message at root and frees its slices.
func (p *rawPeer) readMsg(root uint32) (string, error) {
	slices, err := p.bm.ReadChain(nil, root)
	if err != nil {
		return "", err
	}
	var b []byte
	for _, s := range slices {
		b = append(b, s.Data...)
	}
	for _, s := range slices {
		if err := p.bm.Push(int(s.List), s.Off); err != nil {
			return "", err
		}
	}
	return string(b), nil
}

// waitElem waits for the victim to publish an element.
func (p *rawPeer) waitElem() (shm.Elem, error) {
	deadline := time.Now().Add(peerTimeout)
	for {
		if e, ok := p.recv.pop(); ok {
			return e, nil
		}
		if time.Now().After(deadline) {
			return shm.Elem{}, fmt.Errorf("no element from the victim within %v", peerTimeout)
		}
		time.Sleep(200 * time.Microsecond)
	}
}

// readFrame returns the next frame from the victim that is not Polling.
func (p *rawPeer) readFrame() ([]byte, error) {
	p.conn.SetReadDeadline(time.Now().Add(peerTimeout))
	defer p.conn.SetReadDeadline(time.Time{})
	for {
		h, err := readN(p.conn, 8)
		if err != nil {
			return nil, err
		}
		n := binary.BigEndian.Uint32(h)
		if n < 8 || n > 1<<20 {
			return nil, fmt.Errorf("frame header % x", h)
		}
		rest, err := readN(p.conn, int(n)-8)
		if err != nil {
			return nil, err
		}
		if h[7] != 1 {
			return append(h, rest...), nil
		}
	}
}

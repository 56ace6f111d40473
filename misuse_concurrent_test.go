package shmipc

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// mzAcceptable reports whether err is one a closed stream or session may
// return.
func mzAcceptable(err error) bool {
	return err == nil || errors.Is(err, ErrStreamClosed) || errors.Is(err, ErrSessionClosed) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, ErrTimeout)
}

// TestMisuseConcurrentCloseStream races the stream's Close against every
// kind of call from several goroutines, many times. Nothing may panic, hang,
// or fail with an error other than the documented ones.
func TestMisuseConcurrentCloseStream(t *testing.T) {
	mzModes(t, func(t *testing.T) {
		p := newStreamTestPair(t, MemMapTypeMemFd, nil)
		go func() { // the server reads and echoes everything
			for {
				st, err := p.server.AcceptStream()
				if err != nil {
					return
				}
				go echoStream(st)
			}
		}()
		base := runtime.NumGoroutine()
		rounds := 200
		if testing.Short() {
			rounds = 50
		}
		var bad atomic.Int32
		for r := range rounds {
			st, err := p.client.OpenStream()
			if err != nil {
				t.Fatal(err)
			}
			st.SetDeadline(time.Now().Add(mzTimeout))
			var wg sync.WaitGroup
			start := make(chan struct{})
			report := func(what string, err error) {
				if !mzAcceptable(err) && bad.Add(1) < 10 {
					t.Errorf("round %d %s: unexpected error %v", r, what, err)
				}
			}
			ops := []func(){
				func() { _, err := st.Write(bytes.Repeat([]byte{'w'}, 100)); report("Write", err) },
				func() { _, err := st.Write(make([]byte, 200000)); report("Write big", err) },
				func() { _, err := st.Read(make([]byte, 64)); report("Read", err) },
				func() {
					bw := st.BufferWriter()
					b, err := bw.Reserve(64)
					if err == nil {
						b[0] = 1 // write into the reserved memory after a racing Close
					}
					report("Reserve", err)
					report("Flush", st.Flush(false))
				},
				func() { _, err := st.BufferReader().ReadBytes(16); report("ReadBytes", err) },
				func() { st.BufferReader().ReleasePreviousRead() },
				func() { st.SetDeadline(time.Now().Add(mzTimeout)) },
				func() {
					nw := st.NetpollWriter()
					b, err := nw.Malloc(32)
					if err == nil {
						b[0] = 1
					}
					report("np.Malloc", err)
					report("np.Flush", nw.Flush())
				},
				func() { _, err := st.NetpollReader().Next(8); report("np.Next", err) },
				func() { report("Close", st.Close()) },
				func() { report("Close2", st.Close()) },
			}
			for _, op := range ops {
				wg.Add(1)
				go func() {
					defer wg.Done()
					defer func() {
						if r := recover(); r != nil {
							t.Errorf("PANIC: %v", r)
						}
					}()
					<-start
					op()
				}()
			}
			close(start)
			done := make(chan struct{})
			go func() { wg.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(2 * mzTimeout):
				buf := make([]byte, 1<<20)
				t.Fatalf("round %d: HANG\n%s", r, buf[:runtime.Stack(buf, true)])
			}
			st.Close()
		}
		mzGoroutines(t, base, 2)
		// The session must still work.
		if err := echoRoundTrip(p.client, "still alive"); err != nil {
			t.Fatalf("session after the races: %v", err)
		}
	})
}

// TestMisuseConcurrentCloseSession closes the session while streams are in
// the middle of reads and writes.
func TestMisuseConcurrentCloseSession(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: races kept up for seconds")
	}
	mzModes(t, func(t *testing.T) {
		for r := range 20 {
			p := newStreamTestPair(t, MemMapTypeMemFd, nil)
			go func() {
				for {
					st, err := p.server.AcceptStream()
					if err != nil {
						return
					}
					go echoStream(st)
				}
			}()
			var wg sync.WaitGroup
			for i := range 8 {
				st, err := p.client.OpenStream()
				if err != nil {
					t.Fatal(err)
				}
				st.SetDeadline(time.Now().Add(mzTimeout))
				wg.Add(2)
				go func() {
					defer wg.Done()
					msg := make([]byte, 1000*(i+1)*(i+1))
					for {
						if _, err := st.Write(msg); err != nil {
							if !mzAcceptable(err) {
								t.Errorf("round %d Write: %v", r, err)
							}
							return
						}
					}
				}()
				go func() {
					defer wg.Done()
					buf := make([]byte, 4096)
					for {
						if i%2 == 0 {
							if _, err := st.Read(buf); err != nil {
								if !mzAcceptable(err) {
									t.Errorf("round %d Read: %v", r, err)
								}
								return
							}
						} else {
							br := st.BufferReader()
							if _, err := br.ReadBytes(100); err != nil {
								if !mzAcceptable(err) {
									t.Errorf("round %d ReadBytes: %v", r, err)
								}
								return
							}
							br.ReleasePreviousRead()
						}
					}
				}()
			}
			time.Sleep(time.Duration(r%5) * 5 * time.Millisecond)
			if r%2 == 0 {
				mzCall(t, "client Session.Close", p.client.Close)
			} else {
				mzCall(t, "server Session.Close", p.server.Close)
			}
			done := make(chan struct{})
			go func() { wg.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(2 * mzTimeout):
				buf := make([]byte, 1<<20)
				t.Fatalf("round %d: HANG after Session.Close\n%s", r, buf[:runtime.Stack(buf, true)])
			}
		}
	})
}

// TestMisuseConcurrentReaders: several goroutines Read the same stream at
// once. Every byte sent must be read exactly once.
func TestMisuseConcurrentReaders(t *testing.T) {
	mzModes(t, func(t *testing.T) {
		_, cli, srv := mzPair(t, nil)
		const n = 200000
		const readers = 4
		var mu sync.Mutex
		got := make([]int, 256)
		total := 0
		var wg sync.WaitGroup
		for range readers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				buf := make([]byte, 777)
				for {
					k, err := srv.Read(buf)
					mu.Lock()
					for _, c := range buf[:k] {
						got[c]++
					}
					total += k
					mu.Unlock()
					if err != nil {
						if err != io.EOF {
							t.Errorf("Read: %v", err)
						}
						return
					}
				}
			}()
		}
		want := make([]int, 256)
		msg := make([]byte, 0, 1000)
		for i := 0; i < n; i += len(msg) {
			msg = msg[:0]
			for j := range min(1000, n-i) {
				msg = append(msg, byte((i+j)%251))
			}
			for _, c := range msg {
				want[c]++
			}
			if _, err := cli.Write(msg); err != nil {
				t.Fatal(err)
			}
		}
		cli.Close()
		done := make(chan struct{})
		go func() { wg.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(2 * mzTimeout):
			buf := make([]byte, 1<<20)
			t.Fatalf("HANG: readers did not finish; read %d of %d\n%s", total, n, buf[:runtime.Stack(buf, true)])
		}
		if total != n {
			t.Errorf("read %d bytes, sent %d", total, n)
		}
		for c := range want {
			if want[c] != got[c] {
				t.Errorf("byte %d: read %d times, sent %d", c, got[c], want[c])
				break
			}
		}
	})
}

// TestMisuseConcurrentWriters: several goroutines Write the same stream at
// once. net.Conn allows it; Write sends p as one message, so each record
// must arrive whole (not interleaved with another Write's bytes).
func TestMisuseConcurrentWriters(t *testing.T) {
	mzModes(t, func(t *testing.T) {
		_, cli, srv := mzPair(t, nil)
		const writers = 4
		const per = 50
		sizes := []int{10, 5000, 70000, 300000}
		var wg sync.WaitGroup
		for w := range writers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range per {
					size := sizes[(i+w)%len(sizes)]
					rec := make([]byte, 8+size)
					binary.BigEndian.PutUint32(rec, uint32(size))
					binary.BigEndian.PutUint32(rec[4:], uint32(w<<16|i))
					for j := range size {
						rec[8+j] = byte(w*31 + i)
					}
					if _, err := cli.Write(rec); err != nil {
						t.Errorf("Write: %v", err)
						return
					}
				}
			}()
		}
		srv.SetReadDeadline(time.Now().Add(2 * mzTimeout))
		seen := 0
		for seen < writers*per {
			var hdr [8]byte
			if _, err := io.ReadFull(srv, hdr[:]); err != nil {
				t.Fatalf("record %d: %v", seen, err)
			}
			size := int(binary.BigEndian.Uint32(hdr[:]))
			tag := binary.BigEndian.Uint32(hdr[4:])
			w, i := int(tag>>16), int(tag&0xffff)
			if w >= writers || i >= per || size > 300000 {
				t.Fatalf("record %d: garbage header size=%d tag=%x: Writes interleaved", seen, size, tag)
			}
			body := make([]byte, size)
			if _, err := io.ReadFull(srv, body); err != nil {
				t.Fatal(err)
			}
			for j, c := range body {
				if c != byte(w*31+i) {
					t.Fatalf("record %d (writer %d #%d): byte %d is %d: Writes interleaved", seen, w, i, j, c)
				}
			}
			seen++
		}
		wg.Wait()
	})
}

// TestMisuseConcurrentWritersSmallRegion is TestMisuseConcurrentWriters with
// a 1 MiB region, so that large records go as fallback data while others
// wait for room.
func TestMisuseConcurrentWritersSmallRegion(t *testing.T) {
	mzModes(t, func(t *testing.T) {
		_, cli, srv := mzPair(t, func(c *Config) {
			c.ShareMemoryBufferCap = 1 << 20
			c.BufferSliceSizes = ReferenceSliceSizes()
			c.QueueCap = 64
		})
		const writers, per = 4, 40
		sizes := []int{10, 5000, 70000, 700000}
		var wg sync.WaitGroup
		for w := range writers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range per {
					size := sizes[(i+w)%len(sizes)]
					rec := make([]byte, 8+size)
					binary.BigEndian.PutUint32(rec, uint32(size))
					binary.BigEndian.PutUint32(rec[4:], uint32(w<<16|i))
					for j := range size {
						rec[8+j] = byte(w*31 + i)
					}
					if _, err := cli.Write(rec); err != nil {
						t.Errorf("Write: %v", err)
						return
					}
				}
			}()
		}
		srv.SetReadDeadline(time.Now().Add(3 * mzTimeout))
		for seen := 0; seen < writers*per; seen++ {
			var hdr [8]byte
			if _, err := io.ReadFull(srv, hdr[:]); err != nil {
				t.Fatalf("record %d: %v", seen, err)
			}
			size := int(binary.BigEndian.Uint32(hdr[:]))
			tag := binary.BigEndian.Uint32(hdr[4:])
			w, i := int(tag>>16), int(tag&0xffff)
			if w >= writers || i >= per || size > 700000 {
				t.Fatalf("record %d: garbage header size=%d tag=%x: Writes interleaved", seen, size, tag)
			}
			body := make([]byte, size)
			if _, err := io.ReadFull(srv, body); err != nil {
				t.Fatal(err)
			}
			if k := bytes.IndexFunc(body, func(r rune) bool { return byte(r) != byte(w*31+i) }); k >= 0 && size > 0 {
				for j, c := range body {
					if c != byte(w*31+i) {
						t.Fatalf("record %d: byte %d is %d: Writes interleaved", seen, j, c)
					}
				}
			}
		}
		wg.Wait()
	})
}

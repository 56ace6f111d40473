package shmipc

// The size of the FallbackData frames sent and taken (docs/protocol.md §9.5).

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

// rawFallbackSizes reads the victim's frames until it has data bytes of
// fallback data for stream id and returns the data size of each
// FallbackData frame (Polling frames are skipped), checking the bytes
// against want.
func rawFallbackSizes(t *testing.T, p *rawPeer, id uint32, want []byte) []int {
	t.Helper()
	p.conn.SetReadDeadline(time.Now().Add(4 * peerTimeout))
	defer p.conn.SetReadDeadline(time.Time{})
	var sizes []int
	got := 0
	for got < len(want) {
		h, err := readN(p.conn, 8)
		if err != nil {
			t.Fatalf("after %d bytes in frames %v: %v", got, sizes, err)
		}
		n := int(binary.BigEndian.Uint32(h))
		if n < 8 || n > 64<<20 {
			t.Fatalf("frame header % x", h)
		}
		rest, err := readN(p.conn, n-8)
		if err != nil {
			t.Fatal(err)
		}
		if h[7] != 3 {
			continue
		}
		if binary.BigEndian.Uint32(rest) != id {
			t.Fatalf("FallbackData for stream %d, want %d", binary.BigEndian.Uint32(rest), id)
		}
		data := rest[8:]
		if !bytes.Equal(data, want[got:got+len(data)]) {
			t.Fatalf("frame %d: the bytes differ from those written", len(sizes))
		}
		sizes = append(sizes, len(data))
		got += len(data)
	}
	return sizes
}

// TestFallbackOneFramePerMessage: a flushed message that goes over the
// socket is one FallbackData frame up to 32 MiB (header included), as the
// reference implementations send it, and frames of at most that beyond.
func TestFallbackOneFramePerMessage(t *testing.T) {
	p, victim := acceptRawVictim(t, MemMapTypeMemFd, 0)
	defer victim.Close()
	st := openPinged(t, p, victim)
	const most = 32<<20 - 16
	for _, tc := range []struct {
		size int
		want []int
	}{
		{5 << 20, []int{5 << 20}},              // more than the region gives: fallback
		{most, []int{most}},                    // the largest single frame
		{40 << 20, []int{most, 40<<20 - most}}, // split beyond it
	} {
		msg := mpPayload(tc.size, uint64(tc.size))
		errc := make(chan error, 1)
		go func() { _, err := st.Write(msg); errc <- err }()
		sizes := rawFallbackSizes(t, p, st.ID(), msg)
		if err := <-errc; err != nil {
			t.Fatalf("Write of %d bytes: %v", tc.size, err)
		}
		if !slices.Equal(sizes, tc.want) {
			t.Errorf("a message of %d bytes went in frames of %v bytes of data, want %v", tc.size, sizes, tc.want)
		}
	}
}

// TestFallbackTakesLargestFrame: a session configured with the smallest
// MaxFallbackFrameSize allowed takes the largest frame this
// implementation (or a reference one) sends: 32 MiB, header included.
func TestFallbackTakesLargestFrame(t *testing.T) {
	p, victim := acceptRawVictimWith(t, MemMapTypeMemFd, 0, func(c *Config) {
		c.MaxFallbackFrameSize = minFallbackFrame
	})
	defer victim.Close()
	st := openPinged(t, p, victim)
	data := mpPayload(32<<20-16, 7)
	go p.write(rawFallbackFrame(p.version, 0, st.ID(), 0, string(data)))
	st.SetReadDeadline(time.Now().Add(4 * peerTimeout))
	got := make([]byte, len(data))
	if _, err := io.ReadFull(st, got); err != nil {
		t.Fatalf("reading a 32 MiB frame: %v (session: %v)", err, victim.Err())
	}
	if !bytes.Equal(got, data) {
		t.Error("the bytes read differ from the frame's")
	}
}

// TestFallbackLatencyChild serves BenchmarkFallbackFrameLatency on SOCK: a
// stream whose first byte is 'A' is read and discarded, any other is
// echoed.
func TestFallbackLatencyChild(t *testing.T) {
	if proctest.Role() == "" {
		t.Skip("runs only as the child process of BenchmarkFallbackFrameLatency")
	}
	ln, err := Listen("unix", proctest.MustArg(t, "SOCK"), DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go serveStreams(ln, func(st *Stream) {
		defer st.Close()
		buf := make([]byte, 1<<20)
		n, err := st.Read(buf)
		if err != nil || n == 0 {
			return
		}
		if buf[0] == 'A' {
			_, _ = io.Copy(io.Discard, st)
			return
		}
		for err == nil {
			if _, err = st.Write(buf[:n]); err == nil {
				n, err = st.Read(buf)
			}
		}
	})
	proctest.Ready()
	<-proctest.StdinClosed()
}

// BenchmarkFallbackFrameLatency measures what fallback frames cost the
// other streams of a session: round trips of 64 B on stream B, to a server
// process, while stream A sends 32 MiB messages over the socket (the
// buffer region is too small for them), in frames of 1 MiB and of 32 MiB
// (the frame holds the socket, and B's wake-ups wait behind it). It
// reports the median, 99th percentile and largest round trip, and A's
// throughput.
func BenchmarkFallbackFrameLatency(b *testing.B) {
	sock := filepath.Join(b.TempDir(), "fb.sock")
	c := proctest.Start(b, proctest.Config{TestName: "TestFallbackLatencyChild", Role: "server", Args: map[string]string{"SOCK": sock}})
	defer c.Stop(10 * time.Second)
	if _, err := c.WaitReady(childStartTimeout); err != nil {
		b.Fatal(err, c.Output())
	}
	saved := fallbackFrameData
	defer func() { fallbackFrameData = saved }()
	for _, frame := range []int{1 << 20, 32 << 20} {
		b.Run(fmt.Sprintf("frame=%dMiB", frame>>20), func(b *testing.B) {
			fallbackFrameData = frame - 16
			conf := DefaultConfig()
			conf.ShareMemoryBufferCap = 16 << 20 // a 32 MiB message goes as fallback data
			conf.BufferSliceSizes = ReferenceSliceSizes()
			sess, err := Dial("unix", sock, conf)
			if err != nil {
				b.Fatal(err)
			}
			defer sess.Close()
			bulk, err := sess.OpenStream()
			if err != nil {
				b.Fatal(err)
			}
			big := bytes.Repeat([]byte{'A'}, 32<<20)
			var stop atomic.Bool
			var sent atomic.Int64
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				for !stop.Load() {
					if _, err := bulk.Write(big); err != nil {
						return
					}
					sent.Add(int64(len(big)))
				}
			}()
			small, err := sess.OpenStream()
			if err != nil {
				b.Fatal(err)
			}
			msg, reply := bytes.Repeat([]byte{'b'}, 64), make([]byte, 64)
			rtt := make([]time.Duration, 0, b.N)
			time.Sleep(50 * time.Millisecond) // the bulk stream is under way
			start := time.Now()
			b.ResetTimer()
			for range b.N {
				t0 := time.Now()
				if _, err := small.Write(msg); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(small, reply); err != nil {
					b.Fatal(err)
				}
				rtt = append(rtt, time.Since(t0))
			}
			b.StopTimer()
			elapsed := time.Since(start)
			stop.Store(true)
			bulk.Close()
			wg.Wait()
			slices.Sort(rtt)
			b.ReportMetric(float64(rtt[len(rtt)/2].Microseconds()), "p50-µs")
			b.ReportMetric(float64(rtt[len(rtt)*99/100].Microseconds()), "p99-µs")
			b.ReportMetric(float64(rtt[len(rtt)-1].Microseconds()), "max-µs")
			b.ReportMetric(float64(sent.Load())/elapsed.Seconds()/(1<<20), "bulk-MiB/s")
		})
	}
}

package shmipc

import (
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

// The parallel ping-pong benchmarks: every goroutine of b.RunParallel owns
// one stream (shm) or one connection (UDS) and sends size bytes that a
// server goroutine echoes. Both sides run in this process; the bytes still
// cross shared memory or the kernel exactly as between two processes.

func BenchmarkParallelPingPongByShmipc64B(b *testing.B)   { benchmarkShmipc(b, 64) }
func BenchmarkParallelPingPongByShmipc512B(b *testing.B)  { benchmarkShmipc(b, 512) }
func BenchmarkParallelPingPongByShmipc1KB(b *testing.B)   { benchmarkShmipc(b, 1<<10) }
func BenchmarkParallelPingPongByShmipc4KB(b *testing.B)   { benchmarkShmipc(b, 4<<10) }
func BenchmarkParallelPingPongByShmipc16KB(b *testing.B)  { benchmarkShmipc(b, 16<<10) }
func BenchmarkParallelPingPongByShmipc32KB(b *testing.B)  { benchmarkShmipc(b, 32<<10) }
func BenchmarkParallelPingPongByShmipc64KB(b *testing.B)  { benchmarkShmipc(b, 64<<10) }
func BenchmarkParallelPingPongByShmipc256KB(b *testing.B) { benchmarkShmipc(b, 256<<10) }
func BenchmarkParallelPingPongByShmipc512KB(b *testing.B) { benchmarkShmipc(b, 512<<10) }
func BenchmarkParallelPingPongByShmipc1MB(b *testing.B)   { benchmarkShmipc(b, 1<<20) }
func BenchmarkParallelPingPongByShmipc4MB(b *testing.B)   { benchmarkShmipc(b, 4<<20) }

func BenchmarkParallelPingPongByUds64B(b *testing.B)   { benchmarkUds(b, 64) }
func BenchmarkParallelPingPongByUds512B(b *testing.B)  { benchmarkUds(b, 512) }
func BenchmarkParallelPingPongByUds1KB(b *testing.B)   { benchmarkUds(b, 1<<10) }
func BenchmarkParallelPingPongByUds4KB(b *testing.B)   { benchmarkUds(b, 4<<10) }
func BenchmarkParallelPingPongByUds16KB(b *testing.B)  { benchmarkUds(b, 16<<10) }
func BenchmarkParallelPingPongByUds32KB(b *testing.B)  { benchmarkUds(b, 32<<10) }
func BenchmarkParallelPingPongByUds64KB(b *testing.B)  { benchmarkUds(b, 64<<10) }
func BenchmarkParallelPingPongByUds256KB(b *testing.B) { benchmarkUds(b, 256<<10) }
func BenchmarkParallelPingPongByUds512KB(b *testing.B) { benchmarkUds(b, 512<<10) }
func BenchmarkParallelPingPongByUds1MB(b *testing.B)   { benchmarkUds(b, 1<<20) }
func BenchmarkParallelPingPongByUds4MB(b *testing.B)   { benchmarkUds(b, 4<<20) }

func benchSocketPath(b *testing.B) string {
	return filepath.Join(b.TempDir(), fmt.Sprintf("bench_%d_%x.sock", os.Getpid(), rand.Uint32()))
}

func benchmarkShmipc(b *testing.B, size int) {
	sock := benchSocketPath(b)
	conf := DefaultConfig()
	ln, err := Listen("unix", sock, conf)
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	defer serveEach(ln, func(c net.Conn) { shmEchoServer(c.(*Stream), size) })()
	sess, err := Dial("unix", sock, conf)
	if err != nil {
		b.Fatal(err)
	}
	defer sess.Close()

	b.SetBytes(2 * int64(size))
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		st, err := sess.OpenStream()
		if err != nil {
			b.Error(err)
			return
		}
		defer st.Close()
		w, r := st.BufferWriter(), st.BufferReader()
		for pb.Next() {
			p, err := w.Reserve(size)
			if err != nil {
				b.Error(err)
				return
			}
			p[0], p[size-1] = 1, 2
			if err := st.Flush(false); err != nil {
				b.Error(err)
				return
			}
			reply, err := r.ReadBytes(size)
			if err != nil {
				b.Error(err)
				return
			}
			if reply[0] != 1 || reply[size-1] != 2 {
				b.Error("echo differs")
				return
			}
			st.ReleaseReadAndReuse()
		}
	})
	b.StopTimer()
}

// serveEach runs serve on every connection ln accepts until ln is closed.
// The returned function waits for the servers to finish.
func serveEach(ln net.Listener, serve func(net.Conn)) (wait func()) {
	var servers sync.WaitGroup
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			servers.Add(1)
			go func() {
				defer servers.Done()
				serve(c)
			}()
		}
	}()
	return servers.Wait
}

// shmEchoServer echoes size-byte messages, zero-copy in and out.
func shmEchoServer(st *Stream, size int) {
	defer st.Close()
	w, r := st.BufferWriter(), st.BufferReader()
	for {
		req, err := r.ReadBytes(size)
		if err != nil {
			return
		}
		p, err := w.Reserve(size)
		if err != nil {
			return
		}
		copy(p, req)
		st.ReleaseReadAndReuse()
		if err := st.Flush(false); err != nil {
			return
		}
	}
}

func benchmarkUds(b *testing.B, size int) {
	sock := benchSocketPath(b)
	ln, err := net.Listen("unix", sock)
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	defer serveEach(ln, func(c net.Conn) {
		defer c.Close()
		buf := make([]byte, size)
		for {
			if _, err := io.ReadFull(c, buf); err != nil {
				return
			}
			if _, err := c.Write(buf); err != nil {
				return
			}
		}
	})()

	b.SetBytes(2 * int64(size))
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		c, err := net.Dial("unix", sock)
		if err != nil {
			b.Error(err)
			return
		}
		defer c.Close()
		out, in := make([]byte, size), make([]byte, size)
		for pb.Next() {
			out[0], out[size-1] = 1, 2
			if _, err := c.Write(out); err != nil {
				b.Error(err)
				return
			}
			if _, err := io.ReadFull(c, in); err != nil {
				b.Error(err)
				return
			}
			if in[0] != 1 || in[size-1] != 2 {
				b.Error("echo differs")
				return
			}
		}
	})
	b.StopTimer()
}

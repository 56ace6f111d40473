// Command echo is a shmipc echo server and client following the echo
// contract of the Shmipc conformance kit: on every stream the client sends
// frames (a big-endian u32 length n, then n bytes); the server echoes each
// frame unchanged, and after a frame with n == 0 closes the stream.
//
//	echo -server -addr unix:/tmp/echo.sock          # serve until killed
//	echo -client -addr unix:/tmp/echo.sock -mode memfd
//	echo -client -addr tcp:127.0.0.1:9000 -mode file
//	echo -demo                                      # both, as two processes
//
// The client runs the kit's client sequence (echo sizes, 200 sequential
// frames, 8 concurrent streams, a zero-length frame, client closes), prints
// one line per check and exits 0 only if all passed.
package main

import (
	"bytes"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/goshm/shmipc"
)

func main() {
	server := flag.Bool("server", false, "serve echo streams until killed")
	client := flag.Bool("client", false, "run the client sequence against a server")
	addr := flag.String("addr", "", "unix:/path.sock or tcp:host:port")
	mode := flag.String("mode", "memfd", "client mapping mode: memfd or file")
	prefix := flag.String("prefix", "", "shared-memory path prefix (default /dev/shm/shmipc)")
	demo := flag.Bool("demo", false, "start a server process and run the client against it in both modes")
	flag.Parse()

	if *demo {
		if !runDemo() {
			os.Exit(1)
		}
		return
	}

	network, address, err := parseAddr(*addr)
	if err != nil || *server == *client {
		fmt.Fprintln(os.Stderr, "usage: echo -server|-client -addr unix:/path.sock|tcp:host:port [-mode memfd|file]")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
		}
		os.Exit(2)
	}
	conf := shmipc.DefaultConfig()
	if *prefix != "" {
		conf.ShareMemoryPathPrefix = *prefix
	}
	if *server {
		if err := serve(network, address, conf); err != nil {
			log.Fatal(err)
		}
		return
	}
	switch *mode {
	case "memfd":
		conf.MemMapType = shmipc.MemMapTypeMemFd
	case "file":
		conf.MemMapType = shmipc.MemMapTypeDevShmFile
	default:
		fmt.Fprintf(os.Stderr, "unknown -mode %q: want memfd or file\n", *mode)
		os.Exit(2)
	}
	if !runClient(network, address, conf) {
		os.Exit(1)
	}
}

func parseAddr(addr string) (network, address string, err error) {
	network, address, ok := strings.Cut(addr, ":")
	if !ok || address == "" || (network != "unix" && network != "tcp") {
		return "", "", fmt.Errorf("bad -addr %q: want unix:/path.sock or tcp:host:port", addr)
	}
	return network, address, nil
}

func serve(network, address string, conf *shmipc.Config) error {
	if network == "unix" {
		if fi, err := os.Lstat(address); err == nil && fi.Mode()&os.ModeSocket != 0 {
			os.Remove(address) // a stale socket from an earlier run
		}
	}
	ln, err := shmipc.Listen(network, address, conf)
	if err != nil {
		return err
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		<-sig
		ln.Close()
	}()
	log.Printf("echo server listening on %s:%s", network, address)
	for {
		st, err := ln.AcceptStream()
		if err != nil {
			if errors.Is(err, shmipc.ErrListenerClosed) {
				return nil
			}
			return err
		}
		go echoStream(st)
	}
}

// echoStream echoes frames until the client closes the stream or sends a
// zero-length frame. It reads and writes shared memory directly.
func echoStream(st *shmipc.Stream) {
	defer st.Close()
	r, w := st.BufferReader(), st.BufferWriter()
	for {
		head, err := r.ReadBytes(4)
		if err != nil {
			if !errors.Is(err, io.EOF) {
				log.Printf("stream %d: %v", st.ID(), err)
			}
			return
		}
		n := int(binary.BigEndian.Uint32(head))
		if _, err := w.WriteBytes(head); err != nil {
			log.Printf("stream %d: %v", st.ID(), err)
			return
		}
		body, err := r.ReadBytes(n)
		if err != nil {
			log.Printf("stream %d: frame of %d bytes: %v", st.ID(), n, err)
			return
		}
		if _, err := w.WriteBytes(body); err != nil {
			log.Printf("stream %d: %v", st.ID(), err)
			return
		}
		r.ReleasePreviousRead()
		if err := st.Flush(false); err != nil {
			log.Printf("stream %d: %v", st.ID(), err)
			return
		}
		if n == 0 {
			return
		}
	}
}

const readTimeout = 5 * time.Second

// runClient runs the conformance kit's client sequence and reports each step.
func runClient(network, address string, conf *shmipc.Config) bool {
	sess, err := shmipc.Dial(network, address, conf)
	if err != nil {
		fmt.Println("FAIL connect:", err)
		return false
	}
	ok := true
	check := func(name string, err error) {
		if err != nil {
			ok = false
			fmt.Printf("FAIL %s: %v\n", name, err)
		} else {
			fmt.Printf("PASS %s\n", name)
		}
	}
	check("echo_sizes", echoSizes(sess))
	check("sequential_200x1KiB", sequential(sess))
	check("concurrent_8_streams", concurrent(sess))
	check("zero_length_frame", zeroLength(sess))
	check("close_session", sess.Close())
	return ok
}

// pattern returns n bytes that differ per frame, so misrouted data shows.
func pattern(n, seed int) []byte {
	p := make([]byte, n)
	for i := range p {
		p[i] = byte(i*31 + seed*7 + i>>8)
	}
	return p
}

// sendFrame writes one frame straight into shared memory and flushes it.
func sendFrame(st *shmipc.Stream, payload []byte) error {
	w := st.BufferWriter()
	head, err := w.Reserve(4)
	if err != nil {
		return err
	}
	binary.BigEndian.PutUint32(head, uint32(len(payload)))
	if _, err := w.WriteBytes(payload); err != nil {
		return err
	}
	return st.Flush(false)
}

// expectEcho reads one echoed frame and compares it with payload.
func expectEcho(st *shmipc.Stream, payload []byte) error {
	st.SetReadDeadline(time.Now().Add(readTimeout))
	r := st.BufferReader()
	defer r.ReleasePreviousRead()
	head, err := r.ReadBytes(4)
	if err != nil {
		return fmt.Errorf("stream %d: reading echo header: %w", st.ID(), err)
	}
	if n := binary.BigEndian.Uint32(head); int(n) != len(payload) {
		return fmt.Errorf("stream %d: echo announces %d bytes, sent %d", st.ID(), n, len(payload))
	}
	body, err := r.ReadBytes(len(payload))
	if err != nil {
		return fmt.Errorf("stream %d: reading %d-byte echo: %w", st.ID(), len(payload), err)
	}
	if !bytes.Equal(body, payload) {
		return fmt.Errorf("stream %d: %d-byte echo differs from what was sent", st.ID(), len(payload))
	}
	return nil
}

func roundTrip(st *shmipc.Stream, payload []byte) error {
	if err := sendFrame(st, payload); err != nil {
		return err
	}
	return expectEcho(st, payload)
}

func echoSizes(sess *shmipc.Session) error {
	for i, n := range []int{64, 4096, 300000, 1048576} {
		st, err := sess.OpenStream()
		if err != nil {
			return err
		}
		err = roundTrip(st, pattern(n, i))
		if cerr := st.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func sequential(sess *shmipc.Session) error {
	st, err := sess.OpenStream()
	if err != nil {
		return err
	}
	defer st.Close()
	for i := range 200 {
		if err := roundTrip(st, pattern(1024, i)); err != nil {
			return fmt.Errorf("frame %d: %w", i, err)
		}
	}
	return st.Close()
}

func concurrent(sess *shmipc.Session) error {
	streams := make([]*shmipc.Stream, 8)
	defer func() {
		for _, st := range streams {
			if st != nil {
				st.Close()
			}
		}
	}()
	for i := range streams {
		st, err := sess.OpenStream()
		if err != nil {
			return err
		}
		streams[i] = st
		if err := sendFrame(st, pattern(1000+i, 100+i)); err != nil {
			return err
		}
	}
	for i, st := range streams {
		if err := expectEcho(st, pattern(1000+i, 100+i)); err != nil {
			return err
		}
	}
	for _, st := range streams {
		if err := st.Close(); err != nil {
			return err
		}
	}
	return nil
}

func zeroLength(sess *shmipc.Session) error {
	st, err := sess.OpenStream()
	if err != nil {
		return err
	}
	defer st.Close()
	if err := roundTrip(st, nil); err != nil {
		return err
	}
	st.SetReadDeadline(time.Now().Add(readTimeout))
	if _, err := st.BufferReader().ReadByte(); !errors.Is(err, io.EOF) {
		return fmt.Errorf("after the zero-length frame: got %v, want end of stream", err)
	}
	return st.Close()
}

// runDemo starts this program as a server in a child process, then runs the
// client sequence against it in memfd and in file mode.
func runDemo() bool {
	dir, err := os.MkdirTemp("", "shmipc-echo")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "echo.sock")
	self, err := os.Executable()
	if err != nil {
		log.Fatal(err)
	}
	srv := exec.Command(self, "-server", "-addr", "unix:"+sock)
	srv.Stderr = os.Stderr
	if err := srv.Start(); err != nil {
		log.Fatal(err)
	}
	defer func() {
		srv.Process.Signal(syscall.SIGTERM)
		srv.Wait()
	}()
	for i := 0; ; i++ {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		if i == 100 {
			fmt.Println("FAIL the server did not start")
			return false
		}
		time.Sleep(50 * time.Millisecond)
	}
	ok := true
	for _, mode := range []shmipc.MemMapType{shmipc.MemMapTypeMemFd, shmipc.MemMapTypeDevShmFile} {
		conf := shmipc.DefaultConfig()
		conf.MemMapType = mode
		fmt.Printf("client (pid %d) -> server (pid %d), %v mode:\n", os.Getpid(), srv.Process.Pid, mode)
		ok = runClient("unix", sock, conf) && ok
	}
	return ok
}

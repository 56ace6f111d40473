package main

import (
	"bufio"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/goshm/shmipc"
)

// ---- the server process ----------------------------------------------------

// server is the echo server child process.
type server struct {
	cmd     *exec.Cmd
	stdin   io.WriteCloser
	dir     string
	shmSock string
	udsSock string
	tcpAddr string
	once    sync.Once
}

// startServer starts this program as the echo server and waits until it
// listens.
func startServer(transports []string) (*server, error) {
	dir, err := os.MkdirTemp("", "pingpong-")
	if err != nil {
		return nil, err
	}
	s := &server{dir: dir, shmSock: filepath.Join(dir, "shm.sock"), udsSock: filepath.Join(dir, "uds.sock")}
	args := []string{serveArg, "-dir", dir, "-transports", strings.Join(transports, ","), "-spin", spinTime.String(), fmt.Sprintf("-conn=%t", connAPI)}
	if serverProfile != "" {
		args = append(args, "-cpuprofile", serverProfile)
	}
	// If this process dies, the server's standard input ends; and in case
	// that is ever not enough, the kernel sends it SIGTERM (it cleans up on
	// either).
	if s.cmd, err = selfCommand(syscall.SIGTERM, args...); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	s.cmd.Stderr = os.Stderr
	if s.stdin, err = s.cmd.StdinPipe(); err == nil {
		var stdout io.ReadCloser
		if stdout, err = s.cmd.StdoutPipe(); err == nil {
			if err = s.cmd.Start(); err == nil {
				track(s)
				err = s.waitReady(stdout)
			}
		}
	}
	if err != nil {
		s.stop()
		return nil, fmt.Errorf("starting the echo server: %w", err)
	}
	return s, nil
}

// waitReady reads the server's "ready <tcp address>" line.
func (s *server) waitReady(stdout io.Reader) error {
	type line struct {
		text string
		err  error
	}
	ch := make(chan line, 1)
	go func() {
		br := bufio.NewReader(stdout)
		text, err := br.ReadString('\n')
		ch <- line{text, err}
		io.Copy(io.Discard, br) // until the server exits
	}()
	select {
	case l := <-ch:
		f := strings.Fields(l.text)
		if l.err != nil || len(f) != 2 || f[0] != "ready" {
			return fmt.Errorf("it did not report ready (%q, %v)", l.text, l.err)
		}
		s.tcpAddr = f[1]
		return nil
	case <-time.After(10 * time.Second):
		return errors.New("it did not report ready within 10 s")
	}
}

func (s *server) pid() int { return s.cmd.Process.Pid }

// stop closes the server's standard input, which makes it exit, waits for
// it (killing it if it takes more than 3 s) and removes its directory.
func (s *server) stop() {
	s.once.Do(func() {
		if s.cmd.Process != nil {
			s.stdin.Close()
			done := make(chan struct{})
			go func() { s.cmd.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(3 * time.Second):
				s.cmd.Process.Kill()
				<-done
			}
		}
		os.RemoveAll(s.dir)
		untrack(s)
	})
}

// serveMain is the echo server: it listens on the transports asked for,
// prints "ready <tcp address or ->" and echoes until its standard input
// ends.
func serveMain(args []string) {
	log.SetFlags(0)
	log.SetPrefix("pingpong server: ")
	fs := flag.NewFlagSet("pingpong "+serveArg, flag.ExitOnError)
	dir := fs.String("dir", "", "directory for the Unix sockets")
	transports := fs.String("transports", strings.Join(allTransports, ","), "transports to serve")
	fs.DurationVar(&spinTime, "spin", spinTime, "shmipc ConsumerSpinTime")
	fs.BoolVar(&connAPI, "conn", false, "echo on shmipc streams through their net.Conn methods")
	profile := fs.String("cpuprofile", "", "write a CPU profile of the server to this file")
	fs.Parse(args)
	if *dir == "" {
		log.Fatal("-dir is required")
	}
	stopProfile := func() {}
	if *profile != "" {
		var err error
		if stopProfile, err = startProfile(*profile); err != nil {
			log.Fatal(err)
		}
	}
	// Ctrl-C reaches the whole process group; the client decides when the
	// server stops (by closing our standard input), so that it can clean up.
	// SIGTERM (also sent by the kernel if the client dies) stops it at once.
	signal.Ignore(syscall.SIGINT)
	stop := make(chan struct{}, 2)
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM)
	go func() {
		<-term
		stop <- struct{}{}
	}()

	var closers []io.Closer
	tcpAddr := "-"
	chunk := sliceChunk(shmipc.DefaultConfig())
	for _, t := range strings.Split(*transports, ",") {
		switch t {
		case "shm":
			ln, err := shmipc.Listen("unix", filepath.Join(*dir, "shm.sock"), shmConfig())
			if err != nil {
				log.Fatal(err)
			}
			closers = append(closers, ln)
			go func() {
				for {
					st, err := ln.AcceptStream()
					if err != nil {
						return
					}
					if connAPI {
						go echoConn(st)
					} else {
						go echoShm(st, chunk)
					}
				}
			}()
		case "uds", "tcp":
			network, addr := "unix", filepath.Join(*dir, "uds.sock")
			if t == "tcp" {
				network, addr = "tcp", "127.0.0.1:0"
			}
			ln, err := net.Listen(network, addr)
			if err != nil {
				log.Fatal(err)
			}
			if t == "tcp" {
				tcpAddr = ln.Addr().String()
			}
			closers = append(closers, ln)
			go func() {
				for {
					c, err := ln.Accept()
					if err != nil {
						return
					}
					go echoConn(c)
				}
			}()
		}
	}
	fmt.Printf("ready %s\n", tcpAddr)
	go func() {
		io.Copy(io.Discard, os.Stdin) // returns when the client closes the pipe or dies
		stop <- struct{}{}
	}()
	<-stop
	for _, c := range closers {
		c.Close() // removes the socket files
	}
	os.Remove(*dir) // the client removes it too; whoever comes second fails
	stopProfile()
	os.Exit(0)
}

// echoShm echoes messages of the announced size, reading them in place
// from shared memory and copying them into the reply's shared memory.
func echoShm(st *shmipc.Stream, chunk int) {
	defer st.Close()
	r, w := st.BufferReader(), st.BufferWriter()
	head, err := r.ReadBytes(4)
	if err != nil {
		return
	}
	size := int(binary.BigEndian.Uint32(head))
	st.BufferReader().ReleasePreviousRead()
	if size > maxSize {
		log.Printf("shm stream %d: message size %d is too large", st.ID(), size)
		return
	}
	for {
		for off := 0; off < size; {
			c := min(chunk, size-off)
			b, err := r.ReadBytes(c)
			if err != nil {
				if off > 0 || !errors.Is(err, io.EOF) {
					log.Printf("shm stream %d: %v", st.ID(), err)
				}
				return
			}
			if _, err := w.WriteBytes(b); err != nil {
				log.Printf("shm stream %d: %v", st.ID(), err)
				return
			}
			off += c
		}
		st.BufferReader().ReleasePreviousRead()
		if err := st.Flush(false); err != nil {
			log.Printf("shm stream %d: %v", st.ID(), err)
			return
		}
	}
}

// echoConn echoes messages of the announced size on a plain connection.
func echoConn(c net.Conn) {
	defer c.Close()
	var head [4]byte
	if _, err := io.ReadFull(c, head[:]); err != nil {
		return
	}
	size := int(binary.BigEndian.Uint32(head[:]))
	if size > maxSize {
		log.Printf("%s: message size %d is too large", c.LocalAddr().Network(), size)
		return
	}
	buf := make([]byte, size)
	for {
		if _, err := io.ReadFull(c, buf); err != nil {
			if !errors.Is(err, io.EOF) {
				log.Printf("%s: %v", c.LocalAddr().Network(), err)
			}
			return
		}
		if _, err := c.Write(buf); err != nil {
			log.Printf("%s: %v", c.LocalAddr().Network(), err)
			return
		}
	}
}

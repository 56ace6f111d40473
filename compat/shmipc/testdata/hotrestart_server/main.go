// Command hotrestart_server is a callback echo server that hands its
// clients over to a new process of itself on SIGUSR1: the new process
// listens on the same path, then this one runs HotRestart, waits for
// IsHotRestartDone and exits.
package main

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/goshm/shmipc/compat/shmipc"
)

type listenCbImpl struct{}

func (listenCbImpl) OnNewStream(s *shmipc.Stream) {
	if err := s.SetCallbacks(&echo{s}); err != nil {
		fmt.Println("SetCallbacks:", err)
	}
}

func (listenCbImpl) OnShutdown(reason string) { fmt.Println("shutdown:", reason) }

type echo struct{ s *shmipc.Stream }

func (e *echo) OnData(reader shmipc.BufferReader) {
	data, err := reader.ReadBytes(reader.Len())
	if err != nil {
		return
	}
	if _, err := e.s.BufferWriter().WriteBytes(data); err != nil {
		return
	}
	e.s.Flush(false)
	e.s.ReleaseReadAndReuse()
}

func (e *echo) OnLocalClose()  {}
func (e *echo) OnRemoteClose() {}

func main() {
	epoch, _ := strconv.ParseUint(os.Getenv("SERVER_EPOCH"), 10, 64)
	dir, err := os.Getwd()
	if err != nil {
		panic(err)
	}
	conf := shmipc.NewDefaultListenerConfig(filepath.Join(dir, "ipc_test.sock"), "unix")
	ln, err := shmipc.NewListener(listenCbImpl{}, conf)
	if err != nil {
		panic(err)
	}
	ln.SetUnlinkOnClose(false)
	go ln.Run()
	fmt.Println("listening", epoch, os.Getpid())
	if epoch > 0 { // started by the previous server: tell it
		ready := os.NewFile(3, "ready")
		ready.Write([]byte("listening\n"))
		ready.Close()
	}

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGUSR1)
	<-sig
	r, w, err := os.Pipe()
	if err != nil {
		panic(err)
	}
	next := exec.Command(os.Args[0])
	next.Env = append(os.Environ(), "SERVER_EPOCH="+strconv.FormatUint(epoch+1, 10))
	next.Stdout, next.Stderr = os.Stdout, os.Stderr
	next.ExtraFiles = []*os.File{w}
	if err := next.Start(); err != nil {
		panic(err)
	}
	w.Close()
	// Once the new server says so, it has the socket path.
	if _, err := bufio.NewReader(r).ReadString('\n'); err != nil {
		panic("the new server did not start: " + err.Error())
	}
	for {
		err := ln.HotRestart(epoch + 1)
		if err == nil {
			break
		}
		if err != shmipc.ErrInHandshakeStage && err != shmipc.ErrHotRestartInProgress {
			panic(err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	for !ln.IsHotRestartDone() {
		time.Sleep(10 * time.Millisecond)
	}
	fmt.Println("hot restart done")
	ln.Close()
}

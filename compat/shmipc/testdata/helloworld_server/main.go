// Command helloworld_server answers one client's hello messages, in the
// shape of shmipc-go's hello world server.
package main

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"syscall"

	"github.com/goshm/shmipc/compat/shmipc"
)

func main() {
	dir, err := os.Getwd()
	if err != nil {
		panic(err)
	}
	udsPath := filepath.Join(dir, "ipc_test.sock")
	_ = syscall.Unlink(udsPath)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: udsPath, Net: "unix"})
	if err != nil {
		panic(err)
	}
	defer ln.Close()
	fmt.Println("listening")

	conn, err := ln.Accept()
	if err != nil {
		panic(err)
	}
	defer conn.Close()
	conf := shmipc.DefaultConfig()
	server, err := shmipc.Server(conn, conf)
	if err != nil {
		panic("new ipc server failed " + err.Error())
	}
	defer server.Close()

	stream, err := server.AcceptStream()
	if err != nil {
		panic(err)
	}
	defer stream.Close()
	reader := stream.BufferReader()
	for {
		requestMsg, err := reader.ReadString(len("client say hello world!!!"))
		if err != nil {
			fmt.Println("server stream ended:", err == shmipc.ErrEndOfStream || err == shmipc.ErrSessionShutdown)
			return
		}
		fmt.Println("server receive request message:" + requestMsg)

		respMsg := "server hello world!!!"
		writer := stream.BufferWriter()
		if err := writer.WriteString(respMsg); err != nil {
			panic("buffer writeString failed " + err.Error())
		}
		if err := stream.Flush(true); err != nil {
			panic("stream write failed " + err.Error())
		}
		reader.ReleasePreviousRead()
	}
}

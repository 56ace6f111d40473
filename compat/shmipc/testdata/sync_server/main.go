// Command sync_server serves idl requests synchronously (Server,
// AcceptStream, a goroutine per stream), in the shape of shmipc-go's
// best-practice server.
package main

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"syscall"

	"github.com/goshm/shmipc/compat/shmipc"
	"github.com/goshm/shmipc/compat/shmipc/testdata/idl"
)

func handleStream(s *shmipc.Stream) {
	defer s.Close()
	req := &idl.Request{}
	resp := &idl.Response{}
	for {
		// 1. deserialize the request
		if err := req.ReadFromShm(s.BufferReader()); err != nil {
			if err != shmipc.ErrEndOfStream && err != shmipc.ErrSessionShutdown {
				fmt.Println("stream read request failed,", err)
			}
			return
		}
		// 2. handle it
		resp.ID = req.ID
		resp.Name = req.Name
		resp.Image = req.Key
		// 3. serialize the response
		if err := resp.WriteToShm(s.BufferWriter()); err != nil {
			fmt.Println("write response to share memory failed,", err)
			return
		}
		if err := s.Flush(false); err != nil {
			fmt.Println("flush response failed,", err)
			return
		}
		s.ReleaseReadAndReuse()
		req.Reset()
		resp.Reset()
	}
}

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
	for {
		conn, err := ln.Accept()
		if err != nil {
			fmt.Println("accept error:", err)
			return
		}
		go func() {
			defer conn.Close()
			conf := shmipc.DefaultConfig()
			server, err := shmipc.Server(conn, conf)
			if err != nil {
				fmt.Println("shmipc.Server failed:", err)
				return
			}
			defer server.Close()
			for {
				stream, err := server.AcceptStream()
				if err != nil {
					return
				}
				go handleStream(stream)
			}
		}()
	}
}

// Command callback_client sends idl requests and receives the responses
// through stream callbacks; it prints "done <n>" after -n requests.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/goshm/shmipc/compat/shmipc"
	"github.com/goshm/shmipc/compat/shmipc/testdata/idl"
)

type clientCbImpl struct {
	resp   idl.Response
	result chan uint64
	closed chan struct{}
}

func (c *clientCbImpl) OnData(reader shmipc.BufferReader) {
	if err := c.resp.ReadFromShm(reader); err != nil {
		fmt.Println("read response failed:", err)
		return
	}
	c.result <- c.resp.ID
	c.resp.Reset()
}

func (c *clientCbImpl) OnLocalClose() { close(c.closed) }

func (c *clientCbImpl) OnRemoteClose() { fmt.Println("server closed the stream") }

func main() {
	n := flag.Int("n", 1000, "requests")
	flag.Parse()
	dir, err := os.Getwd()
	if err != nil {
		panic(err)
	}
	conf := shmipc.DefaultSessionManagerConfig()
	conf.UnixPath = filepath.Join(dir, "ipc_test.sock")
	sm, err := shmipc.NewSessionManager(conf)
	if err != nil {
		panic(err)
	}
	defer sm.Close()
	stream, err := sm.GetStream()
	if err != nil {
		panic(err)
	}
	cb := &clientCbImpl{result: make(chan uint64, 1), closed: make(chan struct{})}
	if err := stream.SetCallbacks(cb); err != nil {
		panic(err)
	}
	req := &idl.Request{Name: "callback", Key: make([]byte, 100)}
	for i := 0; i < *n; i++ {
		req.ID = uint64(i)
		if err := req.WriteToShm(stream.BufferWriter()); err != nil {
			panic(err)
		}
		if err := stream.Flush(false); err != nil {
			panic(err)
		}
		if id := <-cb.result; id != req.ID {
			panic(fmt.Sprintf("response %d to request %d", id, req.ID))
		}
	}
	stream.Close()
	<-cb.closed
	fmt.Println("done", *n, stream.StreamID() > 0)
}

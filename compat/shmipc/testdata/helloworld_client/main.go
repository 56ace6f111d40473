// Command helloworld_client sends hello messages through a SessionManager,
// in the shape of shmipc-go's hello world client.
package main

import (
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/goshm/shmipc/compat/shmipc"
)

func main() {
	dir, err := os.Getwd()
	if err != nil {
		panic(err)
	}
	conf := shmipc.DefaultSessionManagerConfig()
	conf.Address = filepath.Join(dir, "ipc_test.sock")
	conf.Network = "unix"
	conf.MemMapType = shmipc.MemMapTypeMemFd
	conf.SessionNum = 1
	conf.InitializeTimeout = 100 * time.Second
	smgr, err := shmipc.NewSessionManager(conf)
	if err != nil {
		panic("create client session failed, " + err.Error())
	}
	defer smgr.Close()

	stream, err := smgr.GetStream()
	if err != nil {
		panic("client open stream failed, " + err.Error())
	}
	for i := 0; i < 3; i++ {
		requestMsg := "client say hello world!!!"
		writer := stream.BufferWriter()
		if err := writer.WriteString(requestMsg); err != nil {
			panic("buffer writeString failed " + err.Error())
		}
		if err := stream.Flush(false); err != nil {
			panic("stream write failed " + err.Error())
		}
		reader := stream.BufferReader()
		respData, err := reader.ReadBytes(len("server hello world!!!"))
		if err != nil {
			panic("stream read failed " + err.Error())
		}
		fmt.Println("client receive response message:" + string(respData))
		stream.ReleaseReadAndReuse()
	}
	smgr.PutBack(stream)
}

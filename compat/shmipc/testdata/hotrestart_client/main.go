// Command hotrestart_client sends echo requests without pause for -d
// through a SessionManager, which follows the server through hot
// restarts; it prints the requests made and failed.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/goshm/shmipc/compat/shmipc"
)

func main() {
	d := flag.Duration("d", 3*time.Second, "how long to send")
	flag.Parse()
	dir, err := os.Getwd()
	if err != nil {
		panic(err)
	}
	conf := shmipc.DefaultSessionManagerConfig()
	conf.Address = filepath.Join(dir, "ipc_test.sock")
	conf.Network = "unix"
	conf.SessionNum = 2
	sm, err := shmipc.NewSessionManager(conf)
	if err != nil {
		panic(err)
	}
	defer sm.Close()
	var requests, failures int
	msg := []byte("hello hot restart")
	for end := time.Now().Add(*d); time.Now().Before(end); requests++ {
		stream, err := sm.GetStream()
		if err != nil {
			failures++
			continue
		}
		stream.SetDeadline(time.Now().Add(time.Second))
		if _, err := stream.Write(msg); err != nil {
			stream.Close()
			failures++
			continue
		}
		got, err := stream.BufferReader().ReadBytes(len(msg))
		if err != nil || string(got) != string(msg) {
			stream.Close()
			failures++
			continue
		}
		sm.PutBack(stream)
		time.Sleep(time.Millisecond)
	}
	fmt.Println("requests", requests, "failures", failures)
}

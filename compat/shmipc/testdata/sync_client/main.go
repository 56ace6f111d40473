// Command sync_client sends idl requests from several goroutines through
// the global SessionManager, in the shape of shmipc-go's best-practice
// client; it prints "done <n>" after -n requests per goroutine.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/goshm/shmipc/compat/shmipc"
	"github.com/goshm/shmipc/compat/shmipc/testdata/idl"
)

var count uint64

func newClient(n int) error {
	req := &idl.Request{}
	resp := &idl.Response{}
	key := make([]byte, 4096)
	for i := 0; i < n; i++ {
		stream, err := shmipc.GlobalSessionManager().GetStream()
		if err != nil {
			return err
		}
		req.ID = uint64(i)
		req.Name = "xxx"
		req.Key = key
		if err := req.WriteToShm(stream.BufferWriter()); err != nil {
			return err
		}
		if err := stream.Flush(false); err != nil {
			return err
		}
		if err := resp.ReadFromShm(stream.BufferReader()); err != nil {
			return err
		}
		if resp.ID != req.ID || resp.Name != req.Name || len(resp.Image) != len(key) {
			return fmt.Errorf("response %d does not match request %d", resp.ID, req.ID)
		}
		stream.ReleaseReadAndReuse()
		shmipc.GlobalSessionManager().PutBack(stream)
		atomic.AddUint64(&count, 1)
		req.Reset()
		resp.Reset()
	}
	return nil
}

func main() {
	n := flag.Int("n", 1000, "requests per goroutine")
	flag.Parse()
	dir, err := os.Getwd()
	if err != nil {
		panic(err)
	}
	conf := shmipc.DefaultSessionManagerConfig()
	conf.Address = filepath.Join(dir, "ipc_test.sock")
	conf.Network = "unix"
	conf.SessionNum = 2
	conf.MaxStreamNum = 100
	conf.StreamMaxIdleTime = 5 * time.Second
	conf.ShareMemoryBufferCap = 32 << 20
	conf.BufferSliceSizes = []*shmipc.SizePercentPair{{Size: 8192 - 20, Percent: 50}, {Size: 32768 - 20, Percent: 50}}
	if _, err := shmipc.InitGlobalSessionManager(conf); err != nil {
		panic(err)
	}
	defer shmipc.GlobalSessionManager().Close()

	var wg sync.WaitGroup
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := newClient(*n); err != nil {
				fmt.Println("client failed:", err)
				os.Exit(1)
			}
		}()
	}
	wg.Wait()
	fmt.Println("done", atomic.LoadUint64(&count))
}

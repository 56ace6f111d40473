package shmipc

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"testing"
)

func TestSmoke(t *testing.T) {
	for _, mode := range []MemMapType{MemMapTypeMemFd, MemMapTypeDevShmFile} {
		sock := filepath.Join(t.TempDir(), "s.sock")
		conf := DefaultConfig()
		conf.MemMapType = mode
		conf.ShareMemoryPathPrefix = fmt.Sprintf("/dev/shm/smoke_%d", os.Getpid())
		ln, err := Listen("unix", sock, conf)
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				go func() { defer c.Close(); io.Copy(c, c) }()
			}
		}()
		sess, err := Dial("unix", sock, conf)
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range []int{1, 64, 8192, 300000, 4 << 20} {
			st, err := sess.OpenStream()
			if err != nil {
				t.Fatal(err)
			}
			msg := bytes.Repeat([]byte{byte(n)}, n)
			for i := range msg {
				msg[i] = byte(i * 7)
			}
			if _, err := st.Write(msg); err != nil {
				t.Fatal(err)
			}
			got, err := st.BufferReader().ReadBytes(n)
			if err != nil {
				t.Fatal(n, err)
			}
			if !bytes.Equal(got, msg) {
				t.Fatalf("mismatch at %d", n)
			}
			st.Close()
		}
		t.Log(mode, "ok", sess.buf.freeCounts())
		sess.Close()
		ln.Close()
	}
}

// Command helloworld starts a shmipc server and a client in one process:
// the client sends "hello", the server answers "world".
package main

import (
	"fmt"
	"io"
	"log"
	"os"
	"path/filepath"

	"github.com/goshm/shmipc"
)

func main() {
	dir, err := os.MkdirTemp("", "shmipc-hello")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "hello.sock")

	ln, err := shmipc.Listen("unix", sock, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer ln.Close()
	go server(ln)

	if err := client(sock); err != nil {
		log.Fatal(err)
	}
}

func server(ln *shmipc.Listener) {
	for {
		st, err := ln.AcceptStream()
		if err != nil {
			return
		}
		go func() {
			defer st.Close()
			req, err := st.BufferReader().ReadBytes(5) // zero-copy from shared memory
			if err != nil {
				return
			}
			fmt.Printf("server got %q\n", req)
			st.BufferReader().ReleasePreviousRead()
			st.Write([]byte("world"))
		}()
	}
}

func client(sock string) error {
	sess, err := shmipc.Dial("unix", sock, nil)
	if err != nil {
		return err
	}
	defer sess.Close()
	st, err := sess.OpenStream()
	if err != nil {
		return err
	}
	defer st.Close()
	if _, err := st.Write([]byte("hello")); err != nil {
		return err
	}
	reply := make([]byte, 5)
	if _, err := io.ReadFull(st, reply); err != nil {
		return err
	}
	fmt.Printf("client got %q\n", reply)
	return nil
}

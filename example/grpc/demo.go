package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// demo starts a server process and calls it over shmipc: unary calls small
// and large, a bidirectional stream, a call that runs past its deadline, and
// a graceful stop of the server.
func demo(out io.Writer) error {
	dir, err := tempDir()
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	srv, err := startServer(dir, "tuned", []string{transportShmipc})
	if err != nil {
		return err
	}
	defer srv.kill()
	fmt.Fprintf(out, "server process listening on %s\n", srv.addrs[transportShmipc])

	c, err := dial(transportShmipc, srv.addrs[transportShmipc], tunedOptions())
	if err != nil {
		return err
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	for _, size := range []int{64, 64 << 10, 4 << 20} {
		req := bytes.Repeat([]byte{'x'}, size)
		start := time.Now()
		resp, err := echo(ctx, c, req)
		if err != nil {
			return fmt.Errorf("unary %s: %w", sizeName(size), err)
		}
		if !bytes.Equal(resp, req) {
			return fmt.Errorf("unary %s: the echo differs", sizeName(size))
		}
		fmt.Fprintf(out, "unary echo of %s: ok in %v\n", sizeName(size), time.Since(start).Round(time.Microsecond))
	}

	stream, err := c.NewStream(ctx, bidiDesc, methodBidi)
	if err != nil {
		return err
	}
	for _, word := range []string{"one", "two", "three"} {
		msg := []byte(word)
		if err := stream.SendMsg(&msg); err != nil {
			return err
		}
		var got []byte
		if err := stream.RecvMsg(&got); err != nil {
			return err
		}
		fmt.Fprintf(out, "bidi stream: sent %q, received %q\n", word, got)
	}
	if err := stream.CloseSend(); err != nil {
		return err
	}
	var extra []byte
	if err := stream.RecvMsg(&extra); !errors.Is(err, io.EOF) {
		return fmt.Errorf("bidi stream end: %v, want io.EOF", err)
	}

	short, cancelShort := context.WithTimeout(ctx, 50*time.Millisecond)
	err = waitCall(short, c, time.Minute)
	cancelShort()
	if status.Code(err) != codes.DeadlineExceeded {
		return fmt.Errorf("a call past its deadline returned %v", err)
	}
	fmt.Fprintf(out, "a 1-minute call with a 50 ms deadline: %v\n", status.Code(err))

	st, err := getStats(ctx, c)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "server (pid %d): %d unary calls, %d cancelled waits, %d shmipc messages sent, %d wake-ups sent\n",
		st.Pid, st.Unary, st.Cancelled, st.Shmipc.MessagesOut, st.Shmipc.WakeupsSent)

	if err := srv.terminate(); err != nil {
		return err
	}
	if err := srv.wait(10 * time.Second); err != nil {
		return fmt.Errorf("server: %w: %s", err, srv.Output())
	}
	fmt.Fprintf(out, "server: %s", srv.Output())
	return nil
}

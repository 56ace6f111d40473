// Command callback_server serves idl requests from stream callbacks
// (NewListener, Run, SetCallbacks), in the shape of shmipc-go's
// best-practice callback server, with a Monitor that prints metrics.
package main

import (
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/goshm/shmipc/compat/shmipc"
	"github.com/goshm/shmipc/compat/shmipc/testdata/idl"
)

type listenCbImpl struct{}

func (l *listenCbImpl) OnNewStream(s *shmipc.Stream) {
	if err := s.SetCallbacks(&streamCbImpl{stream: s}); err != nil {
		fmt.Println("OnNewStream failed:", err)
	}
}

func (l *listenCbImpl) OnShutdown(reason string) {
	fmt.Println("OnShutdown reason:", reason)
}

type streamCbImpl struct {
	req    idl.Request
	resp   idl.Response
	stream *shmipc.Stream
}

func (s *streamCbImpl) OnData(reader shmipc.BufferReader) {
	// 1. deserialize the request
	if err := s.req.ReadFromShm(reader); err != nil {
		fmt.Println("read request failed:", err)
		return
	}
	// 2. handle it
	s.resp.ID = s.req.ID
	s.resp.Name = s.req.Name
	s.resp.Image = s.req.Key
	// 3. serialize the response
	if err := s.resp.WriteToShm(s.stream.BufferWriter()); err != nil {
		fmt.Println("write response failed:", err)
		return
	}
	if err := s.stream.Flush(false); err != nil {
		fmt.Println("flush response failed:", err)
		return
	}
	s.stream.ReleaseReadAndReuse()
	s.req.Reset()
	s.resp.Reset()
}

func (s *streamCbImpl) OnLoopbackError(err error) { fmt.Println("OnLoopbackError:", err) }

func (s *streamCbImpl) OnLocalClose() {}

func (s *streamCbImpl) OnRemoteClose() {}

type monitorImpl struct{ sessions int }

func (m *monitorImpl) OnEmitSessionMetrics(p shmipc.PerformanceMetrics, s shmipc.StabilityMetrics, sh shmipc.ShareMemoryMetrics, session *shmipc.Session) {
	m.sessions++
	fmt.Printf("metrics of %s: in %d out %d bytes, %d streams, %d of %d bytes in use\n", session.ID(),
		p.InFlowBytes, p.OutFlowBytes, s.ActiveStreamCount, sh.AllInUsedShareMemoryInBytes, sh.CapacityOfShareMemoryInBytes)
}

func (m *monitorImpl) Flush() error { return nil }

func main() {
	shmipc.SetLogLevel(3)
	dir, err := os.Getwd()
	if err != nil {
		panic(err)
	}
	udsPath := filepath.Join(dir, "ipc_test.sock")
	conf := shmipc.NewDefaultListenerConfig(udsPath, "unix")
	conf.Monitor = &monitorImpl{}
	ln, err := shmipc.NewListener(&listenCbImpl{}, conf)
	if err != nil {
		panic(err)
	}
	fmt.Println("listening")
	go func() {
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
		<-sig
		ln.Close()
	}()
	if err := ln.Run(); err != nil {
		fmt.Println("Run:", err)
	}
}

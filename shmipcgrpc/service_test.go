package shmipcgrpc_test

// A small Echo service written out by hand (no protoc): messages are raw
// bytes, carried by a codec registered as "bytes", so that what is measured
// is gRPC and the transport, not protobuf.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"

	"github.com/goshm/shmipc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/peer"
)

// bytesCodec carries a message as its bytes: a *[]byte, or a
// *mem.BufferSlice for code that copies nothing (the echo handlers and the
// benchmark's client).
type bytesCodec struct{}

const codecName = "bytes"

func init() { encoding.RegisterCodecV2(bytesCodec{}) }

func (bytesCodec) Name() string { return codecName }

func (bytesCodec) Marshal(v any) (mem.BufferSlice, error) {
	switch p := v.(type) {
	case *[]byte:
		return mem.BufferSlice{mem.SliceBuffer(*p)}, nil
	case *mem.BufferSlice:
		return *p, nil // gRPC frees it once sent
	}
	return nil, fmt.Errorf("bytes codec: cannot marshal %T", v)
}

func (bytesCodec) Unmarshal(data mem.BufferSlice, v any) error {
	switch p := v.(type) {
	case *[]byte:
		*p = data.Materialize()
		return nil
	case *mem.BufferSlice:
		data.Ref() // kept past Unmarshal; the receiver frees it
		*p = data
		return nil
	}
	return fmt.Errorf("bytes codec: cannot unmarshal into %T", v)
}

// callOpts selects the bytes codec for every call of a client.
var callOpts = grpc.WithDefaultCallOptions(grpc.CallContentSubtype(codecName))

const (
	serviceName = "shmipcgrpc.test.Echo"
	methodUnary = "/" + serviceName + "/Unary" // returns the request
	methodPeer  = "/" + serviceName + "/Peer"  // peerInfo of the call, as the server sees it
	methodStats = "/" + serviceName + "/Stats" // shmipc.AggregateStats of the server process
	methodBidi  = "/" + serviceName + "/Bidi"  // echoes each message
)

var echoDesc = grpc.ServiceDesc{
	ServiceName: serviceName,
	HandlerType: (*any)(nil),
	Methods: []grpc.MethodDesc{
		{MethodName: "Unary", Handler: unaryEcho},
		{MethodName: "Peer", Handler: jsonHandler(func(ctx context.Context) any { return peerInfoOf(peer.FromContext(ctx)) })},
		{MethodName: "Stats", Handler: jsonHandler(func(context.Context) any { return shmipc.AggregateStats() })},
	},
	Streams: []grpc.StreamDesc{
		{StreamName: "Bidi", Handler: bidiEcho, ServerStreams: true, ClientStreams: true},
	},
}

var bidiDesc = &echoDesc.Streams[0]

// unaryEcho returns the request as it arrived, without copying it.
func unaryEcho(_ any, _ context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
	var req mem.BufferSlice
	if err := dec(&req); err != nil {
		return nil, err
	}
	return &req, nil
}

// jsonHandler is a method that ignores its request and returns fn's value
// as JSON.
func jsonHandler(fn func(context.Context) any) grpc.MethodHandler {
	return func(_ any, ctx context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
		var req []byte
		if err := dec(&req); err != nil {
			return nil, err
		}
		resp, err := json.Marshal(fn(ctx))
		return &resp, err
	}
}

// bidiEcho sends back each message until the client closes its side.
func bidiEcho(_ any, stream grpc.ServerStream) error {
	for {
		var msg mem.BufferSlice
		if err := stream.RecvMsg(&msg); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		if err := stream.SendMsg(&msg); err != nil {
			return err
		}
	}
}

// peerInfo is what one side of a call knows of the other.
type peerInfo struct {
	AuthType      string `json:"authType"` // "" without transport security
	SecurityLevel string `json:"securityLevel"`
	RemoteNetwork string `json:"remoteNetwork"`
	LocalNetwork  string `json:"localNetwork"`
}

func peerInfoOf(p *peer.Peer, ok bool) peerInfo {
	var info peerInfo
	if !ok {
		return info
	}
	if p.Addr != nil {
		info.RemoteNetwork = p.Addr.Network()
	}
	if p.LocalAddr != nil {
		info.LocalNetwork = p.LocalAddr.Network()
	}
	if p.AuthInfo != nil {
		info.AuthType = p.AuthInfo.AuthType()
		if c, ok := p.AuthInfo.(interface {
			GetCommonAuthInfo() credentials.CommonAuthInfo
		}); ok {
			info.SecurityLevel = c.GetCommonAuthInfo().SecurityLevel.String()
		}
	}
	return info
}

// echo makes one Unary call.
func echo(ctx context.Context, cc grpc.ClientConnInterface, req []byte, opts ...grpc.CallOption) ([]byte, error) {
	var resp []byte
	err := cc.Invoke(ctx, methodUnary, &req, &resp, opts...)
	return resp, err
}

// getJSON calls a method that returns JSON and decodes its response into v.
func getJSON(ctx context.Context, cc grpc.ClientConnInterface, method string, v any) error {
	var req, resp []byte
	if err := cc.Invoke(ctx, method, &req, &resp); err != nil {
		return err
	}
	return json.Unmarshal(resp, v)
}

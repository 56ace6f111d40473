module github.com/goshm/shmipc/example/grpc

go 1.26.0

require (
	github.com/goshm/shmipc v0.0.0
	github.com/goshm/shmipc/shmipcgrpc v0.0.0
	google.golang.org/grpc v1.85.0
)

require (
	github.com/bytedance/gopkg v0.1.1 // indirect
	github.com/cloudwego/gopkg v0.1.4 // indirect
	github.com/cloudwego/netpoll v0.7.2 // indirect
	golang.org/x/net v0.60.0 // indirect
	golang.org/x/sys v0.49.0 // indirect
	golang.org/x/text v0.42.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260817212433-ac3dfec99bb1 // indirect
	google.golang.org/protobuf v1.36.12 // indirect
)

replace github.com/goshm/shmipc => ../..

replace github.com/goshm/shmipc/shmipcgrpc => ../../shmipcgrpc

module github.com/goshm/shmipc/internal/conntest

go 1.26.0

require (
	github.com/goshm/shmipc v0.0.0
	golang.org/x/net v0.60.0
)

require (
	github.com/bytedance/gopkg v0.1.1 // indirect
	github.com/cloudwego/gopkg v0.1.4 // indirect
	github.com/cloudwego/netpoll v0.7.2 // indirect
	golang.org/x/sys v0.49.0 // indirect
)

replace github.com/goshm/shmipc => ../..

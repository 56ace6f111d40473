module github.com/goshm/shmipc

go 1.26.0

require (
	github.com/cloudwego/netpoll v0.7.2
	golang.org/x/sys v0.49.0
)

require (
	github.com/bytedance/gopkg v0.1.1 // indirect
	github.com/cloudwego/gopkg v0.1.4 // indirect
)

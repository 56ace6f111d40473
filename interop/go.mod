module github.com/goshm/shmipc/interop

go 1.26.0

replace github.com/goshm/shmipc => ../

require (
	github.com/cloudwego/shmipc-go v0.2.0
	github.com/goshm/shmipc v0.0.0
)

require (
	github.com/bytedance/gopkg v0.1.1 // indirect
	github.com/cloudwego/gopkg v0.1.4 // indirect
	github.com/cloudwego/netpoll v0.7.2 // indirect
	github.com/go-ole/go-ole v1.2.6 // indirect
	github.com/power-devops/perfstat v0.0.0-20210106213030-5aafc221ea8c // indirect
	github.com/shirou/gopsutil/v3 v3.22.1 // indirect
	github.com/yusufpapurcu/wmi v1.2.2 // indirect
	golang.org/x/sys v0.49.0 // indirect
)

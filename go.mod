module github.com/goshm/shmipc

go 1.26.0

require (
	github.com/stretchr/testify v1.12.1 // indirect
	golang.org/x/sys v0.49.0 // indirect
)

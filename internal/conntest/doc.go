// Package conntest holds no code: its test runs golang.org/x/net/nettest's
// net.Conn conformance suite against shmipc streams.
//
// It is a module of its own so that golang.org/x/net, which the suite
// comes from, is not a requirement of github.com/goshm/shmipc. Run it from
// this directory:
//
//	go test -race -count=1 ./...
package conntest

package main

import "testing"

// TestRun runs the demo: a server and a client exchanging requests and
// responses through the netpoll codec over shmipc.
func TestRun(t *testing.T) {
	if err := run(); err != nil {
		t.Fatal(err)
	}
}

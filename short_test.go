package shmipc

// The quick form of the suite (go test -short): long tests (soak, scale,
// multi-process churn, time-boxed loops) run shorter, or on one mapping
// mode, so that the whole suite stays under a minute on two cores.

import "testing"

// shortOr returns full, or short with -short.
func shortOr[T any](full, short T) T {
	if testing.Short() {
		return short
	}
	return full
}

// testModes is bothModes, or memfd alone (the default mode) with -short.
func testModes() []MemMapType {
	return shortOr(bothModes, []MemMapType{MemMapTypeMemFd})
}

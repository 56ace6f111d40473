//go:build !race

package shmipc

// raceReleaseIO and raceAcquireIO tell the race detector what order sending
// and receiving imply (raceio_on.go); without it they do nothing.
func raceReleaseIO() {}
func raceAcquireIO() {}

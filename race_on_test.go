//go:build race

package shmipc

// raceEnabled reports whether the race detector is on: it multiplies the
// memory a process uses, so memory bounds on this process are not checked.
const raceEnabled = true

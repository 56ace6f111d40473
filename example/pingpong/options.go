package main

// A run's options: their defaults, the -quick run, and their checks.

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
)

// options is one run's configuration.
type options struct {
	sizes      []int
	n          int           // round trips for sizes up to 4 KiB; fewer for larger ones
	transports []string      // from allTransports
	svg        string        // chart path; "" for none
	idle       time.Duration // how long the idle shm session is watched; 0 to skip
	jsonPath   string        // "" for none, "-" for stdout
	minRun     time.Duration // short round trips are repeated for at least this long
	maxRun     time.Duration // cap on the timed part of one measurement
	hogs       int           // CPU-bound processes that run alongside the measurements

	// The many-streams mode (streams > 0, streams.go).
	streams  int           // clients at once, a stream or connection each
	duration time.Duration // timed part of one measurement
	rounds   int           // measurements of each transport and size, alternating
}

// check reports the first option that makes no sense.
func (o options) check() error {
	switch {
	case o.n < 1:
		return fmt.Errorf("-n %d: want at least 1", o.n)
	case o.hogs < 0:
		return fmt.Errorf("-hogs %d: want 0 or more", o.hogs)
	case o.streams < 0:
		return fmt.Errorf("-streams %d: want 0 (single-stream latency) or more", o.streams)
	case o.streams > 0 && o.duration <= 0:
		return fmt.Errorf("-duration %v: want more than 0", o.duration)
	case o.streams > 0 && o.rounds < 1:
		return fmt.Errorf("-rounds %d: want at least 1", o.rounds)
	}
	return nil
}

func defaultOptions() options {
	return options{
		sizes:      []int{64, 1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20},
		n:          20000,
		transports: allTransports,
		svg:        "pingpong.svg",
		idle:       2 * time.Second,
		minRun:     time.Second,
		maxRun:     4 * time.Second,
		duration:   2 * time.Second,
		rounds:     5,
	}
}

// quickOptions turns o into the -quick run, except for what the flags in
// set chose explicitly.
func quickOptions(o options, set map[string]bool) options {
	if !set["sizes"] && o.streams == 0 {
		o.sizes = []int{64, 256 << 10} // one small, one large
	}
	if !set["duration"] {
		o.duration = 200 * time.Millisecond
	}
	if !set["rounds"] {
		o.rounds = 2
	}
	if !set["n"] {
		o.n = 300
	}
	if !set["idle"] {
		o.idle = 200 * time.Millisecond
	}
	if !set["minrun"] {
		o.minRun = 20 * time.Millisecond
	}
	if !set["maxrun"] {
		o.maxRun = time.Second
	}
	return o
}

func parseTransports(s string) ([]string, error) {
	var out []string
	for _, t := range strings.Split(s, ",") {
		t = strings.ToLower(strings.TrimSpace(t))
		if t == "" || slices.Contains(out, t) {
			continue
		}
		if !slices.Contains(allTransports, t) {
			return nil, fmt.Errorf("unknown transport %q: want shm, uds or tcp", t)
		}
		out = append(out, t)
	}
	if len(out) == 0 {
		return nil, errors.New("no transports")
	}
	return out, nil
}

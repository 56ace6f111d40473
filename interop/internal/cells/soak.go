package cells

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// SoakCounts is what a soak did.
type SoakCounts struct {
	RoundTrips atomic.Int64
	Streams    atomic.Int64
}

// Soak runs workers goroutines until stop is closed. Each opens a stream,
// makes a few round trips on it and closes it, over and over. Every other
// worker sends frames of FallbackSize, which go as fallback data both ways
// when the client's region is 1 MiB; the others send small frames through
// shared memory. The first error ends the soak and is returned.
func Soak(lib Lib, workers int, stop <-chan struct{}, counts *SoakCounts) error {
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	quit := make(chan struct{})
	var once sync.Once
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				case <-quit:
					return
				default:
				}
				if err := soakStream(lib, w, i, counts); err != nil {
					errs <- fmt.Errorf("worker %d, stream %d: %w", w, i, err)
					once.Do(func() { close(quit) })
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	return errors.Join(collect(errs)...)
}

func soakStream(lib Lib, w, i int, counts *SoakCounts) error {
	st, err := lib.Open()
	if err != nil {
		return fmt.Errorf("open: %w", err)
	}
	defer st.Close()
	for r := range 4 {
		n := 1 + (w*131+i*31+r*7)%4000
		if w%2 == 1 {
			n = FallbackSize - r
		}
		if err := RoundTrip(st, Pattern(n, w+i+r)); err != nil {
			return err
		}
		counts.RoundTrips.Add(1)
	}
	counts.Streams.Add(1)
	if err := st.Close(); err != nil {
		return fmt.Errorf("close: %w", err)
	}
	return nil
}

// StopAfter returns a channel closed after d, for Soak's stop.
func StopAfter(d time.Duration) <-chan struct{} {
	c := make(chan struct{})
	time.AfterFunc(d, func() { close(c) })
	return c
}

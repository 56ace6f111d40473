package main

import (
	"math"
	"math/bits"
	"time"
)

// latencyHist counts durations in buckets of at most 1/64 of their value
// (exact below 128 ns), so that millions of round trips of many clients
// can be recorded without memory growing or allocating while timing, and
// their percentiles read with less than 1 % error.
type latencyHist struct {
	counts [histBuckets]uint64
	n      uint64
	max    time.Duration
}

const (
	histSubBits = 6 // 2^6 buckets per doubling
	histSub     = 1 << histSubBits
	histBuckets = 40 * histSub // up to 2^39 ns, about 9 minutes
)

// histBucket is the bucket of v ns: v itself below 2·histSub, above that
// the top histSubBits+1 bits of v and its magnitude.
func histBucket(v uint64) int {
	if v < 2*histSub {
		return int(v)
	}
	shift := bits.Len64(v) - histSubBits - 1
	return min(shift*histSub+int(v>>shift), histBuckets-1)
}

// histValue is the middle of bucket i, in ns.
func histValue(i int) float64 {
	if i < 2*histSub {
		return float64(i)
	}
	shift := i/histSub - 1
	low := uint64(i%histSub+histSub) << shift
	return float64(low) + float64(uint64(1)<<shift)/2
}

func (h *latencyHist) record(d time.Duration) {
	h.counts[histBucket(uint64(max(d, 0)))]++
	h.n++
	h.max = max(h.max, d)
}

func (h *latencyHist) merge(o *latencyHist) {
	for i, c := range o.counts {
		h.counts[i] += c
	}
	h.n += o.n
	h.max = max(h.max, o.max)
}

// percentile is the nearest-rank p-quantile, in µs (0 without samples).
func (h *latencyHist) percentile(p float64) float64 {
	if h.n == 0 {
		return 0
	}
	rank := uint64(max(1, math.Ceil(p*float64(h.n))))
	var seen uint64
	for i, c := range h.counts {
		seen += c
		if seen >= rank {
			// The bucket's middle, but never above the largest sample.
			return min(histValue(i), float64(h.max)) / 1e3
		}
	}
	return us(h.max)
}

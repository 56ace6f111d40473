package shmipc

// Prefetching a kept slice for the next message.
//
// The peer wrote a kept slice (reuse.go) on another core, so each line of
// the next message copied into it is first fetched from there. Prefetching
// the lines for writing when the slice is kept starts those transfers at
// once, while the stream waits for its peer: 64 streams x 4 KiB between
// processes made 3.1 against 2.9 times a Unix socket's round trips per
// second (docs/bench/HISTORY.md).

// prefetchMax bounds how much of a slice is prefetched: a few times the
// number of lines a core fetches at once, beyond which prefetches queue up
// or are dropped.
const prefetchMax = 16 << 10

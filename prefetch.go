package shmipc

// Prefetching a kept slice for the next message.
//
// A stream between two processes keeps the slice of the message it has just
// read and writes its next message in it (reuse.go). The peer wrote that
// slice on another core, so when the next message is copied in, every line
// of it is first fetched from that core and its copy there invalidated, and
// the copy's stores wait for that one line after another. Prefetching the
// lines for writing when the slice is kept starts all of those transfers at
// once, while the stream waits for its peer, and the copy then finds them in
// its own cache. 64 streams x 4 KiB between processes (example/pingpong
// -streams 64, six alternating pairs of runs): median 3.11x a Unix
// socket's round trips per second against 2.88x, p99 0.09-0.11x against
// 0.13-0.22x; 8 streams 2.36x against 2.01-2.16x (two pairs). Between two
// sessions of one process the writer's core is the one that read the
// slice, so there is nothing to fetch, and the prefetches cost time (one
// stream of 16 KB 11 % slower): they are not made there. Prefetching a
// received message for reading before its reader ran did not measure
// better (709 k and 768 k round trips per second against 833 k and 754 k
// in two pairs) and was not kept.

// prefetchMax bounds how much of a slice is prefetched: a few times the
// number of lines a core fetches at once, beyond which prefetches queue up
// or are dropped.
const prefetchMax = 16 << 10

// Package interop tests this module's library against CloudWeGo's two
// reference implementations of Shmipc, each running as a real process: the
// Go module github.com/cloudwego/shmipc-go (program goref) and the Rust
// crate shmipc (program rustref, built with cargo). It is a module of its
// own so that the references stay out of the library's requirements.
//
// The tests start the reference programs; the test process itself is this
// library's side, a client or a server. Cells, for each reference and role:
// v3 (memfd) and v2 (files) over a Unix socket and v2 over TCP loopback;
// message sizes to 40 MiB, 16 concurrent streams, 4 sessions, 1,000
// sequential streams, close ordering after fallback data, the reference
// killed with SIGKILL, and a soak with fallback data in both directions.
//
// The Rust program is found through SHMIPC_RUSTREF (its path), or built
// with cargo into a temporary directory when that is unset.
package interop

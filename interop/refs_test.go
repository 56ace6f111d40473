package interop

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// reference is one reference implementation's echo program.
type reference struct {
	name     string // "go" or "rust"
	bin      string // the built program
	buildErr error  // why there is none
}

var (
	goRef   = &reference{name: "go"}
	rustRef = &reference{name: "rust"}
)

// transport is how a cell's client reaches its server.
type transport struct {
	name string
	mode string // the client's mapping mode: "memfd" (v3) or "file" (v2)
	tcp  bool   // TCP loopback instead of a Unix socket
}

var transports = []transport{
	{name: "v3-memfd-unix", mode: "memfd"},
	{name: "v2-file-unix", mode: "file"},
	{name: "v2-file-tcp", mode: "file", tcp: true},
}

// addr returns the address of a cell's server: its Unix socket, or a TCP
// port on loopback that was free a moment ago.
func (tr transport) addr(t *testing.T, n names) string {
	t.Helper()
	if !tr.tcp {
		return "unix:" + n.sock
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return "tcp:" + ln.Addr().String()
}

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "shmipc-interop-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	buildGoRef(dir)
	buildRustRef(dir)
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func buildGoRef(dir string) {
	goRef.bin = filepath.Join(dir, "goref")
	out, err := exec.Command("go", "build", "-o", goRef.bin, "./goref").CombinedOutput()
	if err != nil {
		goRef.buildErr = fmt.Errorf("go build ./goref: %v\n%s", err, out)
	}
}

// buildRustRef takes the program from SHMIPC_RUSTREF (as .ci/run builds
// it), or builds it with cargo.
func buildRustRef(dir string) {
	if bin := os.Getenv("SHMIPC_RUSTREF"); bin != "" {
		rustRef.bin = bin
		if _, err := os.Stat(bin); err != nil {
			rustRef.buildErr = fmt.Errorf("SHMIPC_RUSTREF: %v", err)
		}
		return
	}
	cargo, err := exec.LookPath("cargo")
	if err != nil {
		rustRef.buildErr = fmt.Errorf("rustref is not built: set SHMIPC_RUSTREF to the program, or put cargo on PATH (%v)", err)
		return
	}
	target := filepath.Join(dir, "cargo-target")
	cmd := exec.Command(cargo, "build", "--locked", "--release", "--manifest-path", "rustref/Cargo.toml", "--target-dir", target)
	if out, err := cmd.CombinedOutput(); err != nil {
		rustRef.buildErr = fmt.Errorf("cargo build rustref: %v\n%s", err, out)
		return
	}
	rustRef.bin = filepath.Join(target, "release", "rustref")
}

func (r *reference) need(t *testing.T) {
	t.Helper()
	if r.buildErr != nil {
		t.Fatal(r.buildErr)
	}
}

// startServer starts the reference's echo server at addr and waits until
// it listens.
func (r *reference) startServer(t *testing.T, addr string) *refProc {
	t.Helper()
	p := startRef(t, r.bin, "-server", "-addr", addr)
	if _, err := p.waitLine(10*time.Second, func(l string) bool { return strings.HasPrefix(l, "listening") }); err != nil {
		t.Fatalf("%s server at %s: %v", r.name, addr, err)
	}
	return p
}

// startClient starts the reference's client running cell against addr.
func (r *reference) startClient(t *testing.T, addr string, tr transport, n names, cell string, extra ...string) *refProc {
	t.Helper()
	args := append([]string{"-client", "-addr", addr, "-mode", tr.mode, "-prefix", n.prefix, "-cell", cell}, extra...)
	return startRef(t, r.bin, args...)
}

// runClient runs cell in the reference's client and checks that it passed.
func (r *reference) runClient(t *testing.T, addr string, tr transport, n names, cell string, extra ...string) *refProc {
	t.Helper()
	p := r.startClient(t, addr, tr, n, cell, extra...)
	if err := p.wait(3 * time.Minute); err != nil {
		t.Fatalf("%s client, cell %s: %v", r.name, cell, err)
	}
	if _, err := p.waitLine(time.Second, func(l string) bool { return l == "PASS "+cell }); err != nil {
		t.Fatalf("%s client, cell %s: exited 0 without PASS: %v", r.name, cell, err)
	}
	return p
}

package shmipc

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// The README's Go snippets are complete programs, each headed by a comment
// naming its file ("// server/main.go"); the gRPC one ("// grpc/…") is
// built by example/grpc's test. They are built here against this
// module, exactly as a user would copy them, and the server and client are
// run as two processes.
func TestReadmeSnippets(t *testing.T) {
	waitsInParallel(t)
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	repo, err := filepath.Abs(".")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	sock := filepath.Join(dir, fmt.Sprintf("hello_%d_%x.sock", os.Getpid(), rand.Uint32()))
	blocks := regexp.MustCompile("(?s)```go\n(// ([a-z/]+\\.go)\n.*?)```").FindAllSubmatch(readme, -1)
	if len(blocks) < 2 {
		t.Fatalf("README has %d Go snippets, want the server and the client at least", len(blocks))
	}
	for _, b := range blocks {
		if strings.HasPrefix(string(b[2]), "grpc/") {
			continue // needs gRPC: example/grpc's TestReadmeGRPCSnippet builds it
		}
		path := filepath.Join(dir, string(b[2]))
		src := strings.ReplaceAll(string(b[1]), "/tmp/hello.sock", sock)
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	gomod := fmt.Sprintf("module readme.example\n\ngo 1.26.0\n\nrequire github.com/goshm/shmipc v0.0.0\n\nreplace github.com/goshm/shmipc => %s\n", repo)
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte(gomod), 0o644); err != nil {
		t.Fatal(err)
	}
	sum, err := os.ReadFile("go.sum")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "go.sum"), sum, 0o644); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "bin")
	build := exec.Command("go", "build", "-mod=mod", "-o", bin+"/", "./...")
	build.Dir = dir
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("the README's snippets do not build: %v\n%s", err, out)
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var serverOut bytes.Buffer
	server := exec.CommandContext(ctx, filepath.Join(bin, "server"))
	server.Stdout, server.Stderr = &serverOut, &serverOut
	if err := server.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		server.Process.Kill()
		server.Wait()
	}()
	for start := time.Now(); ; time.Sleep(10 * time.Millisecond) {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		if time.Since(start) > 10*time.Second {
			t.Fatalf("the server did not listen within 10s:\n%s", serverOut.String())
		}
	}
	out, err := exec.CommandContext(ctx, filepath.Join(bin, "client")).CombinedOutput()
	if err != nil || !strings.Contains(string(out), `reply "hello"`) {
		t.Fatalf("client: %v\n%s\nserver:\n%s", err, out, serverOut.String())
	}
}

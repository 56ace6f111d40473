package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// The root README's gRPC snippet, headed "// grpc/….go", is built here as
// a user would copy it (it may use shmipcgrpc): the root module's README
// test cannot, since gRPC is not a dependency of the root module.
func TestReadmeGRPCSnippet(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := regexp.MustCompile("(?s)```go\n(// grpc/([a-z_]+\\.go)\n.*?)```").FindAllSubmatch(readme, -1)
	if len(blocks) == 0 {
		t.Fatal("the README has no Go snippet headed // grpc/<file>.go")
	}
	repo, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for _, b := range blocks {
		if err := os.WriteFile(filepath.Join(dir, string(b[2])), b[1], 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// The snippet declares functions; a main that refers to them makes it
	// a program that must build with nothing unused.
	main := "package main\n\nfunc main() {\n\t_, _ = dialShm, serveShm\n}\n"
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(main), 0o644); err != nil {
		t.Fatal(err)
	}
	gomod, err := os.ReadFile("go.mod")
	if err != nil {
		t.Fatal(err)
	}
	mod := strings.Replace(string(gomod), "module github.com/goshm/shmipc/example/grpc", "module readme.grpc", 1)
	mod = regexp.MustCompile(`(?m)^replace github.com/goshm/shmipc(/shmipcgrpc)? => .*$`).ReplaceAllString(mod, "")
	mod += "\nreplace github.com/goshm/shmipc => " + repo + "\n"
	mod += "\nreplace github.com/goshm/shmipc/shmipcgrpc => " + filepath.Join(repo, "shmipcgrpc") + "\n"
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte(mod), 0o644); err != nil {
		t.Fatal(err)
	}
	sum, err := os.ReadFile("go.sum")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "go.sum"), sum, 0o644); err != nil {
		t.Fatal(err)
	}
	build := exec.Command("go", "vet", "-mod=mod", ".")
	build.Dir = dir
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("the README's gRPC snippet does not build: %v\n%s", err, out)
	}
}

package shmipcgrpc_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// The Go snippets of README.md, each headed "// grpc/<file>.go", build as a
// program a user would copy them into.
func TestReadmeSnippet(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := regexp.MustCompile("(?s)```go\n(// grpc/([a-z_]+\\.go)\n.*?)```").FindAllSubmatch(readme, -1)
	if len(blocks) == 0 {
		t.Fatal("README.md has no Go snippet headed // grpc/<file>.go")
	}
	here, err := filepath.Abs(".")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for _, b := range blocks {
		if err := os.WriteFile(filepath.Join(dir, string(b[2])), b[1], 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// A main that refers to the snippet's functions: nothing may be unused.
	main := "package main\n\nfunc main() {\n\t_, _ = dialShm, serveShm\n}\n"
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(main), 0o644); err != nil {
		t.Fatal(err)
	}
	gomod, err := os.ReadFile("go.mod")
	if err != nil {
		t.Fatal(err)
	}
	mod := strings.Replace(string(gomod), "module github.com/goshm/shmipc/shmipcgrpc", "module readme.grpc", 1)
	mod = regexp.MustCompile(`(?m)^replace github.com/goshm/shmipc => .*$`).ReplaceAllString(mod, "")
	mod += "\nrequire github.com/goshm/shmipc/shmipcgrpc v0.0.0\n"
	mod += "\nreplace github.com/goshm/shmipc => " + filepath.Dir(here) + "\n"
	mod += "\nreplace github.com/goshm/shmipc/shmipcgrpc => " + here + "\n"
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
	vet := exec.Command("go", "vet", "-mod=mod", ".")
	vet.Dir = dir
	if out, err := vet.CombinedOutput(); err != nil {
		t.Fatalf("the README's snippet does not build: %v\n%s", err, out)
	}
}

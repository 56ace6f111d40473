package shmipc

import (
	"bytes"
	"context"
	"fmt"
	"go/ast"
	"go/build"
	"go/doc"
	"go/parser"
	"go/token"
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

var (
	docFileRef    = regexp.MustCompile(`[A-Za-z0-9_./-]+\.(?:go|md)\b`)
	docSectionRef = regexp.MustCompile(`([A-Za-z0-9_./-]+\.md)[ ,]*((?:§ ?[0-9][0-9.]*[0-9](?:, )?)+)`)
	docAnySection = regexp.MustCompile(`§ ?([0-9][0-9.]*[0-9]|[0-9])`)
)

// TestGoDocReferences checks what `go doc -all` shows of the package: every
// file it names is in the repository, and every section it cites (§n) is a
// section of the file named with it.
func TestGoDocReferences(t *testing.T) {
	bp, err := build.Default.ImportDir(".", 0) // the files go doc reads
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	var files []*ast.File
	for _, name := range bp.GoFiles {
		f, err := parser.ParseFile(fset, name, nil, parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	d, err := doc.NewFromFiles(fset, files, "github.com/goshm/shmipc")
	if err != nil {
		t.Fatal(err)
	}
	type text struct{ where, doc string }
	texts := []text{{"package doc", d.Doc}}
	add := func(where, s string) { texts = append(texts, text{where, s}) }
	values := func(vs []*doc.Value) {
		for _, v := range vs {
			add(strings.Join(v.Names, ", "), v.Doc)
			for _, spec := range v.Decl.Specs { // each entry of a block has its own
				if vs := spec.(*ast.ValueSpec); vs.Doc != nil {
					add(vs.Names[0].Name, vs.Doc.Text())
				}
			}
		}
	}
	funcs := func(fs []*doc.Func) {
		for _, f := range fs {
			add(f.Name, f.Doc)
		}
	}
	values(d.Consts)
	values(d.Vars)
	funcs(d.Funcs)
	for _, ty := range d.Types {
		add(ty.Name, ty.Doc)
		values(ty.Consts)
		values(ty.Vars)
		funcs(ty.Funcs)
		for _, m := range ty.Methods {
			add(ty.Name+"."+m.Name, m.Doc)
		}
		// Documented fields and methods of exported structs and interfaces.
		for _, spec := range ty.Decl.Specs {
			ts, ok := spec.(*ast.TypeSpec)
			if !ok {
				continue
			}
			var fields *ast.FieldList
			switch x := ts.Type.(type) {
			case *ast.StructType:
				fields = x.Fields
			case *ast.InterfaceType:
				fields = x.Methods
			}
			if fields == nil {
				continue
			}
			for _, f := range fields.List {
				if len(f.Names) == 0 || !f.Names[0].IsExported() {
					continue
				}
				add(ty.Name+"."+f.Names[0].Name, f.Doc.Text()+f.Comment.Text())
			}
		}
	}

	sections := map[string]map[string]bool{} // file -> its numbered sections
	sectionsOf := func(file string) map[string]bool {
		if s, ok := sections[file]; ok {
			return s
		}
		s := map[string]bool{}
		b, _ := os.ReadFile(file)
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "#") {
				if f := strings.Fields(strings.TrimLeft(line, "#")); len(f) > 0 {
					s[strings.TrimSuffix(f[0], ".")] = true
				}
			}
		}
		sections[file] = s
		return s
	}
	checked := 0
	for _, tx := range texts {
		s := strings.Join(strings.Fields(tx.doc), " ") // references may be wrapped
		for _, f := range docFileRef.FindAllString(s, -1) {
			checked++
			if _, err := os.Stat(f); err != nil {
				t.Errorf("%s: names %s, which is not in the repository", tx.where, f)
			}
		}
		cited := map[int]bool{}
		for _, m := range docSectionRef.FindAllStringSubmatchIndex(s, -1) {
			file := s[m[2]:m[3]]
			for _, sec := range docAnySection.FindAllStringSubmatch(s[m[4]:m[5]], -1) {
				if !sectionsOf(file)[sec[1]] {
					t.Errorf("%s: cites %s §%s, which has no such section", tx.where, file, sec[1])
				}
			}
			for i := m[4]; i < m[5]; i++ {
				cited[i] = true
			}
		}
		for _, m := range docAnySection.FindAllStringIndex(s, -1) {
			if !cited[m[0]] {
				t.Errorf("%s: cites a section (%q) without naming its file", tx.where, s[m[0]:m[1]])
			}
		}
	}
	if checked == 0 {
		t.Error("no file named in the documentation: the test finds nothing to check")
	}
}

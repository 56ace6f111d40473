// Command modsize reports what `go get` downloads of the module in the
// current directory: the files the module zip holds, their bytes, and the
// size of the zip. It follows the module zip's rules (golang.org/x/mod/zip):
// a directory with a go.mod of its own is another module and is left out
// with all below it, and so are vendor directories. The files are those
// git tracks. It fails if the counts exceed the limits given.
//
//	go run ./.ci/modsize -files 250 -zip 1500000
package main

import (
	"archive/zip"
	"bytes"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"sort"
	"strings"
)

func main() {
	maxFiles := flag.Int("files", 0, "most files allowed (0: no limit)")
	maxZip := flag.Int64("zip", 0, "most bytes of the zip allowed (0: no limit)")
	maxBytes := flag.Int64("bytes", 0, "most bytes of the files allowed (0: no limit)")
	top := flag.Int("top", 5, "list this many of the largest files")
	flag.Parse()

	out, err := exec.Command("git", "ls-files", "-z").Output()
	if err != nil {
		fail("git ls-files: %v", err)
	}
	files := strings.Split(strings.TrimRight(string(out), "\x00"), "\x00")
	nested := map[string]bool{}
	for _, f := range files {
		if path.Base(f) == "go.mod" && f != "go.mod" {
			nested[path.Dir(f)] = true
		}
	}
	var kept []string
	for _, f := range files {
		if !excluded(f, nested) {
			kept = append(kept, f)
		}
	}

	type sized struct {
		name string
		size int64
	}
	var all []sized
	var total int64
	var buf bytes.Buffer
	zw := zip.NewWriter(&buf)
	for _, f := range kept {
		data, err := os.ReadFile(f)
		if err != nil {
			fail("%v", err)
		}
		w, err := zw.Create("github.com/goshm/shmipc@v0.0.0/" + f)
		if err != nil {
			fail("%v", err)
		}
		if _, err := io.Copy(w, bytes.NewReader(data)); err != nil {
			fail("%v", err)
		}
		total += int64(len(data))
		all = append(all, sized{f, int64(len(data))})
	}
	if err := zw.Close(); err != nil {
		fail("%v", err)
	}
	sort.Slice(all, func(i, j int) bool { return all[i].size > all[j].size })
	fmt.Printf("module zip: %d files, %d bytes (%d bytes zipped)\n", len(kept), total, buf.Len())
	for _, s := range all[:min(*top, len(all))] {
		fmt.Printf("  %8d  %s\n", s.size, s.name)
	}
	bad := false
	if *maxFiles > 0 && len(kept) > *maxFiles {
		fmt.Printf("more than %d files\n", *maxFiles)
		bad = true
	}
	if *maxZip > 0 && int64(buf.Len()) > *maxZip {
		fmt.Printf("the zip is more than %d bytes\n", *maxZip)
		bad = true
	}
	if *maxBytes > 0 && total > *maxBytes {
		fmt.Printf("the files are more than %d bytes\n", *maxBytes)
		bad = true
	}
	if bad {
		os.Exit(1)
	}
}

// excluded reports whether the module zip leaves f out: it lies below a
// nested module's directory or in a vendor directory.
func excluded(f string, nested map[string]bool) bool {
	for d := path.Dir(f); d != "."; d = path.Dir(d) {
		if nested[d] || path.Base(d) == "vendor" {
			return true
		}
	}
	return false
}

func fail(format string, a ...any) {
	fmt.Fprintf(os.Stderr, "modsize: "+format+"\n", a...)
	os.Exit(2)
}

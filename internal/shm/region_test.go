package shm

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestRegionFileChecks checks what the server accepts as a region file a
// client names: a file the client's user owns, still under the name it was
// opened by. A file of another user is refused, and so is a file whose name
// was taken over by another file between the open and the check.
func TestRegionFileChecks(t *testing.T) {
	dir := t.TempDir()
	self := uint32(os.Getuid())
	path := filepath.Join(dir, "region")
	if err := os.WriteFile(path, make([]byte, 64), 0o600); err != nil {
		t.Fatal(err)
	}
	fd, err := OpenRegionFile(path, dir, self)
	if err != nil {
		t.Fatalf("own file refused: %v", err)
	}
	CloseFds(fd)

	if _, err := OpenRegionFile(path, dir, self+1); !errors.Is(err, ErrRegionNotOwned) ||
		!strings.Contains(err.Error(), fmt.Sprintf("region file %s is owned by uid %d, the peer is uid %d", path, self, self+1)) {
		t.Errorf("file of uid %d named by uid %d: error %v, want one wrapping ErrRegionNotOwned that names both", self, self+1, err)
	}

	fd, err = OpenRegionFile(path, dir, self)
	if err != nil {
		t.Fatal(err)
	}
	defer CloseFds(fd)
	other := filepath.Join(dir, "other")
	if err := os.WriteFile(other, make([]byte, 64), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(other, path); err != nil {
		t.Fatal(err)
	}
	if err := checkRegionFile(fd, path, self); err == nil || !strings.Contains(err.Error(), "was replaced") {
		t.Errorf("a name taken over after the open: error %v, want one saying the file was replaced", err)
	}
}
